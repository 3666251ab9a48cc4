"""Megatron-Core's non-tensor state, read and written (formats/torch_dist-1.md §Megatron-Core).

``megatron.core.dist_checkpointing.save`` splits a state dict into ShardedTensors, ShardedObjects
and the rest, the *common state*. Up to megatron-core 0.18 the common state is ``common.pt``
(``torch.save`` of the dict); from 0.19 it is the ShardedObject ``common_state``, stored as the
DCP BYTE_IO item ``common_state/shard_0_1`` holding ``torch.save([dict])``, and a ``common.pt``
that is present is still read instead. ``dist_checkpointing.load`` merges the common state at the
root of the state dict it returns, and ckptfs exposes it there too. Every other ShardedObject is
stored under its unique key ``<key>/shard_<offsets>_<shape>`` (a one-item list in torch_dist, a
``<unique key>.pt`` file in zarr); ckptfs exposes its object under that unique key (one key
component).

Everything is read with the restricted value unpickler (torch_dist_pickle). A common-state value
ckptfs cannot represent is an error naming the file and the class; ``CKPTFS_MEGATRON_COMMON=skip``
leaves those values out with a warning instead.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Collection, Container, Mapping
from typing import Any

from ckptfs.errors import ForbiddenGlobalError, MalformedIndexError, UnsupportedValueError
from ckptfs.layout.backends.torch_dist_keys import class_name, expand_value
from ckptfs.layout.keys import decode_key, encode_key, parent_key
from ckptfs.layout.values import component_order, decode_value

Json = Any

CONFIG = "metadata.json"
COMMON_FILE = "common.pt"
COMMON_STATE = "common_state/shard_0_1"  #: the 0.19 common state's DCP item (its unique key)
#: set to "skip" to read a checkpoint whose common state holds values ckptfs cannot represent
COMMON_ENV = "CKPTFS_MEGATRON_COMMON"
#: a ShardedObject's unique key: <key>/shard_<offset>_<shape>, dot-joined ints
SHARDED_OBJECT = re.compile(r"(?P<key>.+)/shard_(?P<offset>\d+(?:\.\d+)*)_(?P<shape>\d+(?:\.\d+)*)")
#: the forms ckptfs writes the common state in (backend option ``megatron``)
FORMS = ("common_state", "common.pt")


# -- reading --------------------------------------------------------------------------------------


def merge_common(common: Any, source: str, values: dict[str, Json], containers: dict[str, str],
                 taken: Container[str], order: dict[str, None] | None = None) -> None:
    """Add Megatron's common state at the root; ``taken`` are keys already used (tensors).
    Its keys are appended to ``order`` in the dict's order."""
    if not isinstance(common, dict):
        raise MalformedIndexError(f"{source}: Megatron's common state is a {class_name(common)}, "
                                  f"not a dict")
    refused: list[str] = []
    for k, v in common.items():
        if isinstance(k, bool) or not isinstance(k, str | int):
            refused.append(f"key {k!r} ({class_name(k)})")
            continue
        key = encode_key((k,))
        if key in taken:
            raise MalformedIndexError(f"{source}: common-state key {key!r} is also a sharded item")
        expand_value(key, v, values, containers, refused, order)
    if not refused:
        return
    listed = "; ".join(refused[:10]) + (" ..." if len(refused) > 10 else "")
    if os.environ.get(COMMON_ENV) == "skip":
        warnings.warn(f"{source}: {len(refused)} common-state value(s) left out "
                      f"({COMMON_ENV}=skip): {listed}", stacklevel=4)
        return
    raise ForbiddenGlobalError(
        f"{source}: Megatron's common state holds {len(refused)} value(s) ckptfs cannot represent "
        f"and never unpickles: {listed}. ckptfs reads dicts, lists, tuples, None, bool, int, float "
        f"and str there. The sharded tensors are readable: set {COMMON_ENV}=skip to load the "
        f"checkpoint without these values"
    )


def sharded_object(obj: Any) -> Any:
    """The object of a ShardedObject's torch_dist item (Megatron saves ``[obj]``)."""
    return obj[0] if isinstance(obj, list) and len(obj) == 1 else obj


def common_of_item(obj: Any, source: str) -> Any:
    """The common state in the 0.19 ``common_state`` item (a one-item list)."""
    if not isinstance(obj, list) or len(obj) != 1:
        raise MalformedIndexError(f"{source}: item {COMMON_STATE!r} holds a {class_name(obj)}, "
                                  f"Megatron writes a one-item list")
    return obj[0]


# -- writing --------------------------------------------------------------------------------------


def config(form: str) -> dict[str, Json]:
    """metadata.json as the Megatron versions that read ``form`` write it."""
    cfg: dict[str, Json] = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    if form == "common.pt":  # <= 0.18 look up a common strategy too (0.19 ignores these)
        cfg.update(common_backend="torch", common_backend_version=1)
    return cfg


def common_state(tensors: Collection[str], values: Mapping[str, Json],
                 containers: Mapping[str, str]) -> dict[Any, Any]:
    """The common state Megatron's save makes of the state dict an index describes: the tree
    without its tensors. A container keeps its values; a non-empty container that only holds
    tensors is left out; an empty one stays (``dict_utils.extract_matching_values``). A list
    whose kept items would be renumbered (some items only tensors, others not) is refused:
    Megatron could not merge it back with the tensors."""
    tensors = set(tensors)
    children: dict[str | None, list[str]] = {}  #: parent key (None: the root) -> its keys
    for key in (*values, *containers):
        children.setdefault(parent_key(key), []).append(key)
    for key in tensors:
        children.setdefault(parent_key(key), []).append(key)

    def ordered(key: str | None) -> list[str]:
        return sorted(children.get(key, []), key=lambda k: component_order(decode_key(k)[-1]))

    def build(key: str) -> tuple[bool, Any]:
        """(keep, object) of the subtree at ``key``."""
        if key in values:
            return True, decode_value(values[key], key)
        if key in tensors:
            return False, None
        kids = ordered(key)
        built = [(k, *build(k)) for k in kids]
        kept = [(k, obj) for k, keep, obj in built if keep]
        kind = containers.get(key, "dict")
        if kind == "dict":
            return bool(kept) or not kids, {decode_key(k)[-1]: obj for k, obj in kept}
        if kept and len(kept) != len(kids):
            raise UnsupportedValueError(
                f"key {key!r}: a {kind} whose items are partly tensors only and partly other "
                f"values; Megatron's common state would renumber it, so it cannot be written for "
                f"Megatron (option megatron): use a dict"
            )
        items = [obj for _, obj in kept]
        return bool(kept) or not kids, tuple(items) if kind == "tuple" else items

    root = {}
    for key in ordered(None):
        keep, obj = build(key)
        if keep:
            root[decode_key(key)[-1]] = obj
    return root
