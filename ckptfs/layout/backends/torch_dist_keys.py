"""ckptfs canonical keys <-> DCP FQNs (formats/torch_dist-1.md §Keys).

DCP (torch >= 2.4, ``_traverse.traverse_state_dict``) flattens a nested state dict into items
named by the dot-joined object path: dict keys become ``str(k)``, list items stay ``int``.
A list holding no tensor and no dict (at any depth through lists) is one leaf, a tuple is always
one leaf, and an empty dict yields nothing. Every leaf that is not a tensor is one pickled
(BYTE_IO) item. ``dcp_leaves`` reproduces that traversal over a ckptfs index; the functions
below it turn DCP object paths and loaded BYTE_IO values back into ckptfs keys and values.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import UnsupportedValueError
from ckptfs.layout.backends.torch_dist_pickle import Opaque
from ckptfs.layout.keys import decode_key, encode_key, parent_key
from ckptfs.layout.values import component_order, decode_value, encode_value

Json = Any


@dataclass(frozen=True, slots=True)
class DcpLeaf:
    """One DCP item: a tensor, or a Python object written as BYTE_IO."""

    fqn: str
    path: tuple[str | int, ...]  #: DCP's object path (Metadata.planner_data)
    key: str  #: the ckptfs key of the node it comes from
    tensor: bool
    value: Any = None  #: the object of a BYTE_IO item


# -- ckptfs index -> DCP items --------------------------------------------------------------------


def dcp_leaves(tensors: Iterable[str], values: Mapping[str, Json],
               containers: Mapping[str, str]) -> list[DcpLeaf]:
    """The items DCP's flatten_state_dict makes of the state dict an index describes."""
    tensors = set(tensors)
    children: dict[str | None, list[str]] = defaultdict(list)  # None: the root
    for key in (*tensors, *values, *containers):
        children[parent_key(key)].append(key)
    tree = _Tree(tensors, values, containers, children)
    out: list[DcpLeaf] = []
    for key in tree.ordered(None):
        tree.walk(key, (str(tree.last(key)),), out)
    seen: dict[str, str] = {}
    for leaf in out:
        other = seen.setdefault(leaf.fqn, leaf.key)
        if other != leaf.key:
            raise UnsupportedValueError(
                f"keys {other!r} and {leaf.key!r} both become DCP item {leaf.fqn!r}; DCP joins "
                f"paths with '.', so torch_dist cannot store both"
            )
    return out


@dataclass
class _Tree:
    tensors: set[str]
    values: Mapping[str, Json]
    containers: Mapping[str, str]
    children: Mapping[str | None, list[str]]
    _last: dict[str, str | int] = field(default_factory=dict)

    def last(self, key: str) -> str | int:
        """The last component of ``key``, decoded once (sorting and walking both need it)."""
        c = self._last.get(key)
        if c is None:
            c = self._last[key] = decode_key(key)[-1]
        return c

    def ordered(self, key: str | None) -> list[str]:
        kids = self.children.get(key, [])
        return sorted(kids, key=lambda k: component_order(self.last(k)))

    def walk(self, key: str, path: tuple[str | int, ...], out: list[DcpLeaf]) -> None:
        fqn = ".".join(map(str, path))
        if key in self.tensors:
            out.append(DcpLeaf(fqn, path, key, True))
            return
        if key in self.values:
            out.append(DcpLeaf(fqn, path, key, False, decode_value(self.values[key], key)))
            return
        kind = self.containers[key]
        if kind == "tuple" or (kind == "list" and self.terminal_list(key)):
            out.append(DcpLeaf(fqn, path, key, False, self.build(key, key)))
            return
        for child in self.ordered(key):
            c = self.last(child)
            self.walk(child, (*path, c if kind == "list" else str(c)), out)

    def terminal_list(self, key: str) -> bool:
        """DCP's _is_terminal: no tensor and no dict among the items, lists checked inside."""
        for child in self.children.get(key, []):
            if child in self.tensors:
                return False
            kind = self.containers.get(child)
            if kind == "dict" or (kind == "list" and not self.terminal_list(child)):
                return False
        return True

    def build(self, key: str, leaf: str) -> Any:
        """The Python object of a subtree written as one BYTE_IO item."""
        if key in self.tensors:
            raise UnsupportedValueError(
                f"key {key!r} is a tensor inside {leaf!r}, which DCP stores as one pickled "
                f"object (a tuple, or a list without tensors or dicts); torch_dist cannot write "
                f"it from shards: use a list or a dict for containers of tensors"
            )
        if key in self.values:
            return decode_value(self.values[key], key)
        kind = self.containers[key]
        kids = self.ordered(key)
        if kind == "dict":
            return {self.last(k): self.build(k, leaf) for k in kids}
        items = [self.build(k, leaf) for k in kids]
        return tuple(items) if kind == "tuple" else items


# -- DCP items -> ckptfs keys and values ----------------------------------------------------------


def key_of_path(path: tuple[str | int, ...]) -> str:
    """The ckptfs key of a DCP object path. Dict keys stay strings: DCP wrote ``str(k)`` and
    does not record whether ``k`` was an int (as ``dcp.load`` hands them back)."""
    return encode_key(tuple(path))


def containers_of_paths(paths: Iterable[tuple[str | int, ...]]) -> dict[str, str]:
    """Container kinds implied by DCP object paths: an int component is a list index."""
    kinds: dict[str, str] = {}
    indices: dict[str, set[int]] = defaultdict(set)
    for path in paths:
        for i in range(1, len(path)):
            key = key_of_path(path[:i])
            c = path[i]
            kind = "list" if isinstance(c, int) else "dict"
            if kinds.setdefault(key, kind) != kind:
                kinds[key] = "dict"
            if isinstance(c, int):
                indices[key].add(c)
    for key, idx in indices.items():
        if kinds[key] == "list" and idx != set(range(len(idx))):
            kinds[key] = "dict"  # items DCP did not write (empty dicts): keep the indices
    return kinds


def expand_value(key: str, obj: Any, values: dict[str, Json], containers: dict[str, str],
                 skipped: list[str], order: dict[str, None] | None = None) -> None:
    """Add an unpickled object under ``key``: containers are opened into ckptfs containers and
    plain leaves; leaves that are not plain values (and keys that are neither str nor int) are
    listed in ``skipped`` as ``key (class)``. Keys added are appended to ``order`` depth first,
    dict items in the object's order."""
    if type(obj) in (dict, list, tuple):
        containers[key] = type(obj).__name__
        if order is not None:
            order.setdefault(key, None)
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        for k, v in items:
            if isinstance(k, bool) or not isinstance(k, str | int):
                skipped.append(f"{key}: key {k!r} ({class_name(k)})")
                continue
            expand_value(encode_key((*decode_key(key), k)), v, values, containers, skipped, order)
        return
    if type(obj) in (type(None), bool, int, float, str):  # exact: no subclass smuggles code
        values[key] = encode_value(obj, key)
        if order is not None:
            order.setdefault(key, None)
    else:
        skipped.append(f"{key} ({class_name(obj)})")


def class_name(obj: Any) -> str:
    """``module.class`` of ``obj``; for an unpickled stand-in, the class it stands for."""
    if isinstance(obj, Opaque):
        return obj.name
    return f"{type(obj).__module__}.{type(obj).__qualname__}"
