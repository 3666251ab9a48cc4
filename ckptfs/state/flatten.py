"""Nested state dicts <-> flat maps keyed by canonical keys (formats/README.md §Keys, §Values).

Containers are dicts (str or int keys), lists and tuples; leaves are tensors or plain Python
values (None, bool, int, float, str). Every container is recorded with its kind, so nesting,
empty containers and int-vs-str keys round-trip exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import MalformedIndexError, UnsupportedValueError
from ckptfs.layout.keys import Path, decode_key, encode_key
from ckptfs.layout.values import encode_value, path_order
from ckptfs.state.shards import is_tensor_like

Json = Any


@dataclass
class FlatState:
    """A state dict taken apart: leaves and containers keyed by canonical key."""

    tensors: dict[str, Any] = field(default_factory=dict)  #: key -> tensor-like
    values: dict[str, Json] = field(default_factory=dict)  #: key -> encoded value
    containers: dict[str, str] = field(default_factory=dict)  #: key -> dict|list|tuple
    paths: dict[str, Path] = field(default_factory=dict)  #: key -> path, for every leaf


def flatten(state_dict: Mapping[str, Any]) -> FlatState:
    """Take ``state_dict`` apart. Raises UnsupportedValueError naming the offending key."""
    if not isinstance(state_dict, Mapping):
        raise UnsupportedValueError(
            f"a state dict must be a dict, got {type(state_dict).__name__}"
        )
    flat = FlatState()
    _walk(state_dict, (), flat)
    return flat


def _walk(obj: Any, path: Path, flat: FlatState) -> None:
    if is_tensor_like(obj):
        key = encode_key(path)
        flat.tensors[key] = obj
        flat.paths[key] = path
        return
    if isinstance(obj, Mapping | list | tuple):
        if path:
            flat.containers[encode_key(path)] = (
                "dict" if isinstance(obj, Mapping) else "list" if isinstance(obj, list) else "tuple"
            )
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for k, v in items:
            if isinstance(k, bool) or not isinstance(k, str | int):
                where = encode_key(path) if path else "<root>"
                raise UnsupportedValueError(
                    f"key {k!r} under {where!r} is a {type(k).__name__}; dict keys must be str or int"
                )
            _walk(v, (*path, k), flat)
        return
    if not path:
        raise UnsupportedValueError("a state dict must be a dict")
    key = encode_key(path)
    flat.values[key] = encode_value(obj, key)
    flat.paths[key] = path


_ROOT = object()  # the root has no key; "" is the key of the path ("",)


def unflatten(containers: Mapping[str, str], leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild a nested state dict from container kinds and already-decoded leaves."""
    root: dict[Any, Any] = {}
    nodes: dict[Any, Any] = {_ROOT: root}
    for key, kind in containers.items():
        if kind not in ("dict", "list", "tuple"):
            raise MalformedIndexError(f"containers[{key!r}]: unknown kind {kind!r}")
        nodes[key] = {} if kind == "dict" else []  # tuples are frozen at the end
    entries = [(k, nodes[k]) for k in containers] + list(leaves.items())
    for key, value in sorted(entries, key=lambda kv: path_order(decode_key(kv[0]))):
        path = decode_key(key)
        parent_key = encode_key(path[:-1]) if len(path) > 1 else _ROOT
        parent = nodes.get(parent_key)
        if parent is None:
            raise MalformedIndexError(f"key {key!r}: its container {parent_key!r} is not recorded")
        if isinstance(parent, list):
            if path[-1] != len(parent):
                raise MalformedIndexError(f"key {key!r}: list items must be numbered 0..n-1")
            parent.append(value)
        else:
            parent[path[-1]] = value
    for key in sorted(containers, key=lambda k: -len(decode_key(k))):
        if containers[key] == "tuple":
            path = decode_key(key)
            parent = nodes[encode_key(path[:-1]) if len(path) > 1 else _ROOT]
            parent[path[-1]] = tuple(nodes[key])
            nodes[key] = parent[path[-1]]
    return root


def set_path(root: Any, path: Path, value: Any) -> Any:
    """Set ``value`` at ``path`` in place; tuples on the way are rebuilt. Returns the root."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    child = set_path(root[head], rest, value) if rest else value
    if isinstance(root, tuple):
        items = list(root)
        items[head] = child
        return type(root)(items)
    root[head] = child
    return root
