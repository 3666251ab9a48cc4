"""``ckptfs.megatron``: strategies for Megatron-Core's ``dist_checkpointing`` that save and load
through ckptfs.

    # megatron-core 0.19.x: pass them explicitly, as Megatron's own
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.SaveStrategy())
    dist_checkpointing.load(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.LoadStrategy())
    # megatron-core 0.15.x: importing ckptfs.megatron registers backend ("ckptfs", 1)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("ckptfs", 1))
    dist_checkpointing.load(sd, ckpt_dir)            # metadata.json names ("ckptfs", 1)

Both subclass Megatron's ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy``
(0.19's ``save`` keeps only those) and are built without arguments. A save maps Megatron's
``ShardedTensor``s (global offsets; the main replica writes each box) to ckptfs's and calls
``ckptfs.save``; on 0.19 the common state goes with them, in Megatron's ``common_state`` form, so
Megatron's own reader reads the checkpoint too. A load fills the ``ShardedTensor``s' tensors in
place with ``ckptfs.load`` (resharded: other TP/DP layouts), from any checkpoint ckptfs reads
(its own, Megatron's torch_dist or zarr, DCP's). The distributed optimizer's
``flattened_range`` (0.15) is stored as Megatron's torch_dist stores it, on the chunk grid
(``_grid``), and loaded across DP and TP changes. Several ``ShardedTensor``s of one key on one
rank (0.15's stacked layers) that tile one box are saved as one copy of that box and loaded
into it, then copied back (``_Stacked``). Needs megatron-core (tested with 0.19.2 and
0.15.3).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.errors import ConfigError, UnsupportedValueError, UsageError
from ckptfs.layout.boxes import Box, first_overlap
from ckptfs.layout.geometry import c_strides
from ckptfs.layout.keys import decode_key
from ckptfs.load import load
from ckptfs.metadata import load_metadata
from ckptfs.save import save
from ckptfs.state.shards import ShardedTensor as _Shard

try:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies import torch as _mt
except ImportError as e:  # pragma: no cover - tested in the Megatron venvs
    raise ConfigError("ckptfs.megatron needs megatron-core (0.15.x or 0.19.x); install it: "
                      "pip install megatron-core") from e

try:  # megatron-core <= 0.18: the (backend, version) registry of default strategies
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        register_default_strategy,
    )
except ImportError:
    register_default_strategy = None

#: the backend name and version of ``metadata.json`` on megatron-core's registry (<= 0.18)
BACKEND, VERSION = "ckptfs", 1
#: the common-state key of megatron-core 0.19's sharded state dict
_COMMON = "common_state"
_REGISTRY = register_default_strategy is not None
#: the metadata.json backends whose checkpoints ckptfs reads
_READS = (BACKEND, "torch_dist", "zarr")


class SaveStrategy(_mt.TorchDistSaveShardedStrategy):
    """Megatron's sharded save through ``ckptfs.save``. ``ckptfs_backend``: the layout (default
    ``torch_dist``: Megatron's and DCP's readers read it too); ``storage_options``: the store's
    (``checkpoint_dir`` may be a URL ckptfs opens)."""

    def __init__(self, backend: str = BACKEND if _REGISTRY else "torch_dist", version: int = VERSION,
                 *, ckptfs_backend: str = "torch_dist",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, version)
        if not _REGISTRY and ckptfs_backend != "torch_dist":
            raise ConfigError(
                f"ckptfs.megatron.SaveStrategy: ckptfs_backend={ckptfs_backend!r}; with "
                f"megatron-core >= 0.19 dist_checkpointing.load reads the common state through "
                f"DCP, so the layout must be 'torch_dist'")
        self.ckptfs_backend = ckptfs_backend
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        # 0.15: Megatron's common strategy saves the ShardedObjects; 0.19: only the common
        # state comes as one, and it is saved here
        return not _REGISTRY

    def save(self, sharded_state_dict: dict, checkpoint_dir: Any) -> None:
        tree: dict[str, Any] = {}
        tensors: list[Any] = []
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedObject) and sh.key == _COMMON and not _REGISTRY:
                tree.update(sh.data)
            elif isinstance(sh, ShardedTensor):
                tensors.append(sh)
            else:
                raise UnsupportedValueError(
                    f"ckptfs.megatron: {_what(sh)} is not supported (ckptfs stores no pickled "
                    f"objects); keep it in the common state as plain values")
        for group in _by_key(tensors).values():
            one = _joined(group, save=True)
            _put(tree, one.key, _shard(one, one.data))
        native = not _REGISTRY and self.ckptfs_backend == "torch_dist"
        options = {"megatron": "common_state"} if native else {}
        save(tree, os.fspath(checkpoint_dir), backend=self.ckptfs_backend, backend_options=options,
             storage_options=self.storage_options or None)

    def async_save(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any) -> Any:
        raise UsageError("ckptfs.megatron.SaveStrategy: async_sharded_save is not supported; "
                         "save synchronously (or use ckptfs.CheckpointManager for background saves)")


class LoadStrategy(_mt.TorchDistLoadShardedStrategy):
    """Megatron's sharded load through ``ckptfs.load`` (any checkpoint ckptfs reads)."""

    def __init__(self, *, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return not _REGISTRY

    def load(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> dict:
        url = os.fspath(checkpoint_dir)
        options = self.storage_options or None
        tensors = [sh for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
        for sh in nested_values(sharded_state_dict):
            if not isinstance(sh, ShardedTensor):
                raise UnsupportedValueError(f"ckptfs.megatron: loading {_what(sh)} is not supported")
        stored = {k: shape for k, (shape, _) in _stored(url, options).items()}
        target: dict[str, Any] = {}
        copies: list[Callable[[], None]] = []
        for sh in tensors:
            if sh.data is None:
                sh.init_data("cpu")
        for group in _by_key(tensors).values():
            one = _joined(group, save=False)
            shard, copy = _target(one, stored.get(one.key))
            _put(target, one.key, shard)
            copies += [c for c in (copy, _splitter(one, group)) if c is not None]
        load(target, url, storage_options=options)
        for copy in copies:
            copy()
        return dict_list_map_inplace(lambda sh: sh.data if isinstance(sh, ShardedTensor) else sh,
                                     sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> dict:
        """Every tensor's key, global shape and dtype (from the index; no tensor data)."""
        out = {}
        stored = _stored(os.fspath(checkpoint_dir), self.storage_options or None)
        for key, (shape, dtype) in stored.items():
            meta = torch.empty(shape, dtype=_dtype(dtype), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: Any) -> dict:
        return self.load_tensors_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend not in _READS:
            raise ConfigError(f"ckptfs.megatron.LoadStrategy: metadata.json names backend "
                              f"{loaded_backend!r}; this strategy loads {list(_READS)}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise ConfigError(f"ckptfs.megatron.LoadStrategy: metadata.json names backend version "
                              f"{loaded_version!r}; this strategy knows version {VERSION}")


@dataclass(frozen=True)
class _Stacked:
    """Several ``ShardedTensor``s of one key on one rank that tile one box (Megatron's stacked
    layers: one shard per layer along a prepended axis), as one, in the fields ``_shard`` and
    ``_target`` read; ``data`` is a tensor of the whole box (a copy of the parts)."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: Any = 0
    prepend_axis_num: int = 0
    flattened_range: None = None


def _by_key(tensors: list[Any]) -> dict[str, list[Any]]:
    """The ``ShardedTensor``s with something to save or load, by key, in their order."""
    out: dict[str, list[Any]] = {}
    for sh in tensors:
        if not _empty_range(sh):
            out.setdefault(sh.key, []).append(sh)
    return out


def _box(sh: Any) -> Box:
    return Box(tuple(sh.global_offset), (1,) * sh.prepend_axis_num + tuple(sh.local_shape))


def _joined(group: list[Any], *, save: bool) -> Any:
    """The one shard of a key on this rank: the ``ShardedTensor`` itself, or a ``_Stacked`` of
    several that tile one box (on save holding a copy of their data; on load an empty buffer).
    Shards of one key that do not tile one box are refused, naming the key."""
    if len(group) == 1:
        return group[0]
    first = group[0]
    bound = _tiled(group)
    if bound is None:
        raise UnsupportedValueError(
            f"ckptfs.megatron: key {first.key!r} is held {len(group)} times by this rank and "
            f"its shards {[str(_box(sh)) for sh in group]} do not tile one box (a ckptfs shard "
            f"is one box per rank and key)")
    data = torch.empty(bound.shape, dtype=first.data.dtype, device=first.data.device)
    if save:
        for sh in group:
            data[_box(sh).relative_to(bound).slices()] = sh.data.reshape(_box(sh).shape)
    replica = first.replica_id if save else 0
    return _Stacked(first.key, data, tuple(first.global_shape), bound.offsets, bound.shape, replica)


def _tiled(group: list[Any]) -> Box | None:
    """The box several shards of one key tile (pairwise disjoint, filling it), or None when
    they do not: a flattened range, another global shape, dtype or replica among them, a gap
    or an overlap."""
    first = group[0]
    if any(_flat(sh) or tuple(sh.global_shape) != tuple(first.global_shape)
           or sh.data.dtype != first.data.dtype
           or is_main_replica(sh.replica_id) != is_main_replica(first.replica_id) for sh in group):
        return None
    boxes = [_box(sh) for sh in group]
    lo = tuple(map(min, *(b.offsets for b in boxes)))
    hi = tuple(map(max, *(b.ends for b in boxes)))
    bound = Box(lo, tuple(h - a for a, h in zip(lo, hi, strict=True)))
    if sum(b.volume for b in boxes) != bound.volume or first_overlap(boxes) is not None:
        return None
    return bound


def _splitter(one: Any, group: list[Any]) -> Callable[[], None] | None:
    """After a load into a ``_Stacked``: copy each part of its box into its shard's data."""
    if not isinstance(one, _Stacked):
        return None
    bound = Box(one.global_offset, one.local_shape)

    def split() -> None:
        for sh in group:
            sh.data.view(_box(sh).shape).copy_(one.data[_box(sh).relative_to(bound).slices()])

    return split


def _shard(sh: Any, data: torch.Tensor) -> _Shard:
    """ckptfs's ShardedTensor of Megatron's: the box at ``global_offset`` (prepended axes are
    size 1 in ``local_shape``); the main replica is replica 0, the others get the rank + 1. A
    ``flattened_range`` is a box of the chunk grid (``_grid``)."""
    replica = 0 if is_main_replica(sh.replica_id) else 1 + torch.distributed.get_rank()
    if _flat(sh):
        grid, index = _grid(sh)
        r = sh.flattened_range
        return _Shard(data.view((1,) * len(grid) + (r.stop - r.start,)),
                      (*grid, math.prod(sh.local_shape)), (*index, r.start), replica)
    return _Shard(data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape)),
                  tuple(sh.global_shape), tuple(sh.global_offset), replica)


def _flat(sh: Any) -> bool:
    return getattr(sh, "flattened_range", None) is not None


def _empty_range(sh: Any) -> bool:
    """A flattened range with no element (the distributed optimizer gives one to the ranks
    whose part of the flat buffer misses the parameter): nothing to save or load."""
    r = getattr(sh, "flattened_range", None)
    return r is not None and r.stop <= r.start


def _grid(sh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunk grid of a flattened ShardedTensor, as Megatron's torch_dist lays it out: a
    tensor of global shape ``[X, Y]`` cut in local chunks ``[x, y]`` is stored as the tensor
    ``[X // x, Y // y, x * y]`` whose row ``[i, j]`` is chunk ``(i, j)`` flattened, so each
    rank's flat range of its chunk is one box of it. Returns (grid shape, this chunk's index)."""
    local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    grid, index = [], []
    for n, size, off in zip(sh.global_shape, local, sh.global_offset, strict=True):
        if size == 0 or n % size or off % size:
            raise UnsupportedValueError(
                f"ckptfs.megatron: key {sh.key!r} has a flattened_range but its local shape "
                f"{tuple(sh.local_shape)} at {tuple(sh.global_offset)} does not tile its global "
                f"shape {tuple(sh.global_shape)} (a flattened tensor needs a regular grid)")
        grid.append(n // size)
        index.append(off // size)
    return tuple(grid), tuple(index)


def _stored(url: str, options: Mapping[str, Any] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every ShardedTensor key's stored shape and dtype name (from the index)."""
    out = {}
    for key, entry in load_metadata(url, storage_options=options).tensors.items():
        path = decode_key(key)
        if len(path) == 1 and isinstance(path[0], str):  # not a nested value's tensor
            out[path[0]] = (tuple(entry.shape), entry.dtype)
    return out


def _target(sh: Any, stored: tuple[int, ...] | None) -> tuple[_Shard, Callable[[], None] | None]:
    """What ckptfs loads for ``sh`` and what to do after: the shard itself when the checkpoint
    stores the key as ``sh`` lays it out (its global shape, or the chunk grid of a flattened
    range); else the natural region ``sh`` needs, read into a buffer from the global tensor or
    from the chunk grid of another local shape, then copied into ``sh.data``."""
    direct = _shard(sh, sh.data)
    shape = tuple(sh.global_shape)
    if stored is None or stored == direct.global_shape:
        return direct, None
    region = _region(sh)
    saved = _saved_chunk(shape, stored)
    if stored == shape:
        buf = torch.empty(region.shape, dtype=sh.data.dtype)
        return _Shard(buf, shape, region.offsets, 0), lambda: _fill(sh, region, buf)
    if saved is None:
        return direct, None  # ckptfs.load names the shape that does not match
    lo = tuple(o // n for o, n in zip(region.offsets, saved, strict=True))
    hi = tuple(-(-e // n) for e, n in zip(region.ends, saved, strict=True))
    counts = tuple(b - a for a, b in zip(lo, hi, strict=True))
    rows = torch.empty((*counts, stored[-1]), dtype=sh.data.dtype)
    inner = Box(tuple(o - a * n for o, a, n in zip(region.offsets, lo, saved, strict=True)),
                region.shape)

    def finish() -> None:
        k = len(counts)
        grid = rows.view(*counts, *saved).permute(*(i for d in range(k) for i in (d, k + d)))
        _fill(sh, region, grid.reshape([c * n for c, n in zip(counts, saved, strict=True)])[
            inner.slices()])

    return _Shard(rows, stored, (*lo, 0), 0), finish


def _region(sh: Any) -> Box:
    """The box of the global tensor ``sh`` holds: its local chunk, or for a flattened range the
    smallest box of the chunk that holds the range and whose elements follow one another in
    the chunk's flat order (some whole rows of one axis, the axes before it fixed)."""
    chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    if not _flat(sh):
        return Box(tuple(sh.global_offset), chunk)
    start, stop = sh.flattened_range.start, sh.flattened_range.stop - 1
    offsets, sizes = [], []
    for d, stride in enumerate(c_strides(chunk)):
        a, b = start // stride, stop // stride
        offsets.append(a)
        sizes.append(b - a + 1)
        if a != b:
            offsets += [0] * (len(chunk) - d - 1)
            sizes += chunk[d + 1:]
            break
        start, stop = start - a * stride, stop - a * stride
    return Box(tuple(o + g for o, g in zip(offsets, sh.global_offset, strict=True)), tuple(sizes))


def _saved_chunk(shape: tuple[int, ...], stored: tuple[int, ...]) -> tuple[int, ...] | None:
    """The local shape whose chunk grid of ``shape`` is ``stored``; None when it is none."""
    grid = stored[:-1]
    if len(grid) != len(shape) or any(f <= 0 or n % f for n, f in zip(shape, grid, strict=True)):
        return None
    chunk = tuple(n // f for n, f in zip(shape, grid, strict=True))
    return chunk if math.prod(chunk) == stored[-1] else None


def _fill(sh: Any, region: Box, values: torch.Tensor) -> None:
    """Copy ``values`` (the natural ``region``) into ``sh.data``."""
    if not _flat(sh):
        sh.data.view(region.shape).copy_(values)
        return
    chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    first = sum((o - g) * s for o, g, s in zip(region.offsets, sh.global_offset, c_strides(chunk),
                                               strict=True))
    r = sh.flattened_range
    at = r.start - first
    sh.data.copy_(values.reshape(-1)[at:at + r.stop - r.start])


def _put(tree: dict[str, Any], key: str, shard: _Shard) -> None:
    if key in tree:
        raise UnsupportedValueError(f"ckptfs.megatron: key {key!r} is both a tensor's and a "
                                    f"common state's")
    tree[key] = shard


def _what(sh: Any) -> str:
    return f"{type(sh).__name__} {getattr(sh, 'key', '?')!r}"


def _dtype(name: str) -> torch.dtype:
    from ckptfs.layout.dtypes import from_name

    return from_name(name, name).torch


if _REGISTRY:  # megatron-core <= 0.18: load dispatches on metadata.json's (backend, version)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())

__all__ = ["BACKEND", "VERSION", "LoadStrategy", "SaveStrategy"]
