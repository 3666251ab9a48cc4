"""Nested state dicts <-> flat maps keyed by canonical keys (formats/README.md §3).

Containers are dicts (str or int keys), lists and tuples; leaves are tensors or plain Python
values (None, bool, int, float, str). Every container is recorded with its kind, so nesting,
empty containers and int-vs-str keys round-trip exactly; every key is also listed in ``order``
(depth-first, parents before children, dict items in insertion order), so dict order does too.

``PerRank(value)`` marks state each rank holds for itself (RNG states, data-loader positions):
on rank r it stands for a dict ``{r: value}`` (formats/README.md §3.4), so the ranks' values are
stored side by side under ``<key>/<rank>`` instead of being taken for replicas.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ckptfs.errors import MalformedIndexError, UnsupportedValueError
from ckptfs.layout.keys import Path, check_unicode, child_key, decode_key, encode_key
from ckptfs.layout.values import component_order, encode_value
from ckptfs.state.shards import TENSOR_LIKE, is_plain_tensor

Json = Any


@dataclass(frozen=True)
class PerRank:
    """State that differs per rank and must come back to the same rank: ``value`` (a plain
    tensor, a plain value, or a container of them) is saved under ``<key>/<rank>``, next to the
    other ranks' values, and a load on rank r fills it from ``<key>/<r>``. Without it, a plain
    tensor or value is a replica every rank holds alike (a save raises when they differ)."""

    value: Any


@dataclass
class FlatState:
    """A state dict taken apart: leaves and containers keyed by canonical key."""

    tensors: dict[str, Any] = field(default_factory=dict)  #: key -> tensor-like
    values: dict[str, Json] = field(default_factory=dict)  #: key -> encoded value
    containers: dict[str, str] = field(default_factory=dict)  #: key -> dict|list|tuple
    paths: dict[str, Path] = field(default_factory=dict)  #: key -> path, for every leaf
    order: list[str] = field(default_factory=list)  #: every key, depth-first in insertion order
    per_rank: dict[str, Path] = field(default_factory=dict)  #: PerRank keys -> their paths
    private: set[str] = field(default_factory=set)  #: keys inside a PerRank (this rank's own)


def flatten(state_dict: Mapping[str, Any], rank: int | None = None) -> FlatState:
    """Take ``state_dict`` apart (``rank``: where ``PerRank`` values go). Raises
    UnsupportedValueError naming the offending key."""
    if not isinstance(state_dict, Mapping):
        raise UnsupportedValueError(
            f"a state dict must be a dict, got {type(state_dict).__name__}"
        )
    flat = FlatState()
    _walk(state_dict, (), None, flat, rank, False)
    return flat


def _walk(obj: Any, path: Path, key: str | None, flat: FlatState, rank: int | None,
          private: bool) -> None:
    """``key``: the canonical key of ``path`` (None at the root), built one component at a
    time instead of encoding the whole path again at every leaf."""
    if isinstance(obj, PerRank):
        key = "<root>" if key is None else key  # None only at the root
        if not path or private:
            raise UnsupportedValueError(f"key {key!r}: PerRank must wrap a value inside the "
                                        f"state dict, and cannot be nested in another PerRank")
        if rank is None:
            raise UnsupportedValueError(f"key {key!r}: PerRank is only meaningful in "
                                        f"ckptfs.save and ckptfs.load")
        flat.containers[key] = "dict"
        flat.per_rank[key] = path
        flat.order.append(key)
        _walk(obj.value, (*path, rank), child_key(key, rank), flat, rank, True)
        return
    if isinstance(obj, TENSOR_LIKE):
        assert key is not None
        if private and not is_plain_tensor(obj):
            raise UnsupportedValueError(f"key {key!r}: PerRank holds plain tensors and values, "
                                        f"not {type(obj).__name__}")
        flat.tensors[key] = obj
        flat.paths[key] = path
        flat.order.append(key)
        if private:
            flat.private.add(key)
        return
    if isinstance(obj, Mapping | list | tuple):
        if key is not None:
            flat.containers[key] = (
                "dict" if isinstance(obj, Mapping) else "list" if isinstance(obj, list) else "tuple"
            )
            flat.order.append(key)
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for k, v in items:
            if isinstance(k, bool) or not isinstance(k, str | int):
                where = key if key is not None else "<root>"
                raise UnsupportedValueError(
                    f"key {k!r} under {where!r} is a {type(k).__name__}; dict keys must be str or int"
                )
            if isinstance(k, str) and not k.isascii():
                check_unicode(k, f"key {k!r} under {key if key is not None else '<root>'!r}")
            _walk(v, (*path, k), child_key(key, k), flat, rank, private)
        return
    if not path:
        raise UnsupportedValueError("a state dict must be a dict")
    assert key is not None
    flat.values[key] = encode_value(obj, key)
    flat.paths[key] = path
    flat.order.append(key)
    if private:
        flat.private.add(key)


def merge_order(orders: Iterable[Sequence[str]], keys: Iterable[str]) -> list[str]:
    """The index's ``order`` from every rank's ``FlatState.order``: the lowest rank's order,
    then keys only later ranks hold, as they list them; restricted to ``keys`` (all keys of the
    index), any key no rank listed last. Parents stay before their children."""
    wanted = set(keys)
    out: dict[str, None] = {}
    for order in orders:
        for k in order:
            if k in wanted:
                out.setdefault(k, None)
    out.update((k, None) for k in sorted(wanted - out.keys()))
    return list(out)


_ROOT = object()  # the root has no key; "" is the key of the path ("",)


def unflatten(containers: Mapping[str, str], leaves: Mapping[str, Any],
              order: Sequence[str] | None = None) -> dict[str, Any]:
    """Rebuild a nested state dict from container kinds and already-decoded leaves.

    Dict items are inserted in the order of ``order`` (the index's, formats/README.md §3.2);
    without it (indexes written before order was recorded) in the canonical component order,
    ints first, then strs. List and tuple items are placed by index and must be 0..n-1."""
    root: dict[Any, Any] = {}
    nodes: dict[Any, Any] = {_ROOT: root}
    for key, kind in containers.items():
        if kind not in ("dict", "list", "tuple"):
            raise MalformedIndexError(f"containers[{key!r}]: unknown kind {kind!r}")
        nodes[key] = {} if kind == "dict" else []  # tuples are frozen at the end
    children: dict[Any, list[tuple[Any, str, Any]]] = defaultdict(list)  # parent -> (name, key, node)
    for key, value in [*((k, nodes[k]) for k in containers), *leaves.items()]:
        path = decode_key(key)
        parent = encode_key(path[:-1]) if len(path) > 1 else _ROOT
        if parent not in nodes:
            raise MalformedIndexError(f"key {key!r}: its container {parent!r} is not recorded")
        children[parent].append((path[-1], key, value))
    pos = {k: i for i, k in enumerate(order)} if order is not None else None
    for parent, items in children.items():
        node = nodes[parent]
        if isinstance(node, list):
            items.sort(key=lambda it: component_order(it[0]))
            if [it[0] for it in items] != list(range(len(items))):
                bad = next(it[1] for i, it in enumerate(items) if it[0] != i)
                raise MalformedIndexError(f"key {bad!r}: list items must be numbered 0..n-1")
            node.extend(it[2] for it in items)
            continue
        if pos is not None:
            items.sort(key=lambda it: pos.get(it[1], len(pos)))
        else:
            items.sort(key=lambda it: component_order(it[0]))
        for name, _, value in items:
            node[name] = value
    for key in sorted(containers, key=lambda k: -len(decode_key(k))):
        if containers[key] == "tuple":
            path = decode_key(key)
            parent_node = nodes[encode_key(path[:-1]) if len(path) > 1 else _ROOT]
            parent_node[path[-1]] = nodes[key] = tuple(nodes[key])
    return root


def set_path(root: Any, path: Path, value: Any) -> Any:
    """Set ``value`` at ``path`` in place; tuples and ``PerRank`` wrappers on the way are rebuilt
    (a PerRank stands for ``{rank: value}``). Returns the root."""
    if not path:
        return value
    if isinstance(root, PerRank):
        return PerRank(set_path(root.value, path[1:], value))
    head, rest = path[0], path[1:]
    child = set_path(root[head], rest, value) if rest else value
    if isinstance(root, tuple):
        items = list(root)
        items[cast(int, head)] = child  # a tuple's path component is its index
        return type(root)(items)
    root[head] = child
    return root
