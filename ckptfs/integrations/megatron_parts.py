"""What a Megatron-Core ``ShardedTensor`` is in a checkpoint, and the DCP container that hands a
rank's boxes of one tensor to DCP's planners (``ckptfs.megatron``'s strategies save and load
through ``ckptfs.dcp``).

A ``ShardedTensor`` is one box of its global tensor (``global_offset``; prepended axes are size 1
in the box). The distributed optimizer's ``flattened_range`` (megatron-core 0.15) is a 1-D slice
of the flattened local chunk, which is no box of the tensor: it is stored as Megatron's own
``torch_dist`` stores it, on the chunk grid (``grid``), where it is one. A rank may hold several
boxes of one key (stacked layers: one per layer; with the distributed optimizer, a flat slice per
layer): ``Parts`` gives DCP each as its own chunk. Attributes are read duck-typed, so this module
does not import Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ckptfs.errors import MismatchError, UnsupportedValueError
from ckptfs.layout.boxes import Box
from ckptfs.layout.geometry import c_strides


@dataclass(frozen=True)
class Part:
    """One box of a stored tensor: ``data`` (shaped as the box) at ``offsets`` of a tensor of
    ``shape`` as stored; after a load ``finish`` (if any) copies it into the ShardedTensor."""

    key: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor
    finish: Callable[[], None] | None = None


class Parts(torch.Tensor):
    """A rank's boxes of one tensor, as DCP's planners take them: the ``_Checkpointable``
    protocol DTensor implements (its write items, its chunk list, the tensor of one chunk).
    Megatron's own ``LocalShardsContainer`` is the same idea for boxes of the tensor itself."""

    _parts: tuple[Part, ...]

    @staticmethod
    def __new__(cls, parts: Sequence[Part]) -> Parts:
        first = parts[0]
        for p in parts:
            if p.shape != first.shape or p.data.dtype != first.data.dtype:
                raise UnsupportedValueError(
                    f"ckptfs.megatron: key {first.key!r} is held by this rank as {len(parts)} "
                    f"shards of different stored shapes or dtypes ({list(first.shape)} "
                    f"{first.data.dtype}, {list(p.shape)} {p.data.dtype}): a flattened_range "
                    f"among plain shards, or shards of different global shapes")
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(first.shape),
                                                   dtype=first.data.dtype)

    def __init__(self, parts: Sequence[Part]) -> None:
        self._parts = tuple(parts)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:  # (Tensor's is a C function)
        raise NotImplementedError(f"ckptfs.megatron.Parts holds a rank's boxes for DCP; {func} "
                                  f"is not defined on it")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(p.offsets), i),
                          type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(p.offsets), p.data.shape),
                              properties=TensorProperties.create_from_tensor(p.data),
                              size=torch.Size(p.shape)))
                for i, p in enumerate(self._parts)]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(p.offsets), p.data.shape) for p in self._parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        at = index.index
        if at is not None and at < len(self._parts) and \
                tuple(self._parts[at].offsets) == tuple(index.offset or ()):
            return self._parts[at].data
        for p in self._parts:
            if tuple(p.offsets) == tuple(index.offset or ()):
                return p.data
        raise UnsupportedValueError(f"ckptfs.megatron: key {index.fqn!r} has no box at "
                                    f"{list(index.offset or ())} on this rank")

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"Parts({self._parts[0].key!r}, {len(self._parts)} boxes of {list(self.shape)})"


def saved_part(sh: Any, data: torch.Tensor) -> Part:
    """The box Megatron's ``sh`` (holding ``data``) is saved as: its own, or for a flattened
    range its box of the chunk grid."""
    if is_flat(sh):
        cells, index = grid(sh)
        r = sh.flattened_range
        return Part(sh.key, (*cells, math.prod(sh.local_shape)), (*index, r.start),
                    data.reshape((1,) * len(cells) + (r.stop - r.start,)))
    return Part(sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape)))


def is_flat(sh: Any) -> bool:
    return getattr(sh, "flattened_range", None) is not None


def empty_range(sh: Any) -> bool:
    """A flattened range with no element (the distributed optimizer gives one to the ranks
    whose part of the flat buffer misses the parameter): nothing to save or load."""
    r = getattr(sh, "flattened_range", None)
    return r is not None and r.stop <= r.start


def grid(sh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The chunk grid of a flattened ShardedTensor, as Megatron's torch_dist lays it out: a
    tensor of global shape ``[X, Y]`` cut in local chunks ``[x, y]`` is stored as the tensor
    ``[X // x, Y // y, x * y]`` whose row ``[i, j]`` is chunk ``(i, j)`` flattened, so each
    rank's flat range of its chunk is one box of it. Returns (grid shape, this chunk's index)."""
    local = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    cells, index = [], []
    for n, size, off in zip(sh.global_shape, local, sh.global_offset, strict=True):
        if size == 0 or n % size or off % size:
            raise UnsupportedValueError(
                f"ckptfs.megatron: key {sh.key!r} has a flattened_range but its local shape "
                f"{tuple(sh.local_shape)} at {tuple(sh.global_offset)} does not tile its global "
                f"shape {tuple(sh.global_shape)} (a flattened tensor needs a regular grid)")
        cells.append(n // size)
        index.append(off // size)
    return tuple(cells), tuple(index)


def load_part(sh: Any, stored: tuple[int, ...], url: str) -> Part:
    """What to read for ``sh`` from a tensor stored with shape ``stored``: its own box when
    the checkpoint lays the key out as ``sh`` does (its global shape, or the chunk grid of a
    flattened range); else the natural region ``sh`` needs, read into a buffer from the
    global tensor or from the chunk grid of another local shape, then copied into ``sh.data``."""
    direct = saved_part(sh, sh.data)
    shape = tuple(sh.global_shape)
    if stored == direct.shape:
        return direct
    region = _region(sh)
    if stored == shape:
        buf = torch.empty(region.shape, dtype=sh.data.dtype)
        return Part(sh.key, shape, region.offsets, buf, lambda: _fill(sh, region, buf))
    saved = _saved_chunk(shape, stored)
    if saved is None:
        raise MismatchError(
            f"checkpoint {url}: key {sh.key!r} is stored with shape {list(stored)}; the target "
            f"has global shape {list(shape)}"
            + (f" (stored as the chunk grid {list(direct.shape)})" if is_flat(sh) else ""))
    lo = tuple(o // n for o, n in zip(region.offsets, saved, strict=True))
    hi = tuple(-(-e // n) for e, n in zip(region.ends, saved, strict=True))
    counts = tuple(b - a for a, b in zip(lo, hi, strict=True))
    rows = torch.empty((*counts, stored[-1]), dtype=sh.data.dtype)
    inner = Box(tuple(o - a * n for o, a, n in zip(region.offsets, lo, saved, strict=True)),
                region.shape)

    def finish() -> None:
        k = len(counts)
        cells = rows.view(*counts, *saved).permute(*(i for d in range(k) for i in (d, k + d)))
        _fill(sh, region, cells.reshape([c * n for c, n in zip(counts, saved, strict=True)])[
            inner.slices()])

    return Part(sh.key, stored, (*lo, 0), rows, finish)


def _region(sh: Any) -> Box:
    """The box of the global tensor ``sh`` holds: its local chunk, or for a flattened range the
    smallest box of the chunk that holds the range and whose elements follow one another in
    the chunk's flat order (some whole rows of one axis, the axes before it fixed)."""
    chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    if not is_flat(sh):
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
    cells = stored[:-1]
    if len(cells) != len(shape) or any(f <= 0 or n % f for n, f in zip(shape, cells, strict=True)):
        return None
    chunk = tuple(n // f for n, f in zip(shape, cells, strict=True))
    return chunk if math.prod(chunk) == stored[-1] else None


def _fill(sh: Any, region: Box, values: torch.Tensor) -> None:
    """Copy ``values`` (the natural ``region``) into ``sh.data``."""
    if not is_flat(sh):
        sh.data.view(region.shape).copy_(values)
        return
    chunk = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    first = sum((o - g) * s for o, g, s in zip(region.offsets, sh.global_offset, c_strides(chunk),
                                               strict=True))
    r = sh.flattened_range
    at = r.start - first
    sh.data.copy_(values.reshape(-1)[at:at + r.stop - r.start])


__all__ = ["Part", "Parts", "empty_range", "grid", "is_flat", "load_part", "saved_part"]
