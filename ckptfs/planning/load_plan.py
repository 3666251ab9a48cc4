"""Who reads what: intersect a rank's local shard with the stored chunks of its key."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from ckptfs.errors import MalformedIndexError, ShardingError
from ckptfs.layout.boxes import Box, first_overlap
from ckptfs.layout.index import ChunkEntry, TensorEntry


@dataclass(frozen=True, slots=True)
class ReadPiece:
    """Copy region ``src`` of a stored chunk into region ``dst`` of the local tensor."""

    chunk: ChunkEntry
    src: Box  #: in the chunk's coordinates
    dst: Box  #: in the local tensor's coordinates

    @property
    def whole_chunk(self) -> bool:
        return self.src.shape == self.chunk.shape


def _outside(entry: TensorEntry, c: ChunkEntry) -> MalformedIndexError:
    return MalformedIndexError(f"key {entry.key!r}: chunk {Box(c.offsets, c.shape)} lies outside "
                               f"the tensor's shape {list(entry.shape)}")


def _candidates(entry: TensorEntry, local: Box) -> Sequence[ChunkEntry]:
    """The chunks that may meet ``local``: with many chunks, only those whose extent along the
    first dimension can reach it (bisection on the chunks ordered by their first offset). Every
    chunk is checked for its number of dimensions and its extent along the first (a chunk
    outside the tensor is refused even when it does not meet ``local``); ``plan_reads`` checks
    the candidates' other dimensions."""
    chunks = entry.chunks
    if len(chunks) < 64 or not local.shape:
        return chunks
    nd, n0 = len(entry.shape), entry.shape[0]
    for c in chunks:
        if len(c.offsets) != nd or len(c.shape) != nd or c.offsets[0] + c.shape[0] > n0:
            raise _outside(entry, c)
    first = [c.offsets[0] for c in chunks]
    order: Sequence[ChunkEntry] = chunks
    if any(a > b for a, b in itertools.pairwise(first)):
        order = sorted(chunks, key=lambda c: c.offsets[0])
        first.sort()
    reach = max(c.shape[0] for c in chunks)
    lo = bisect.bisect_right(first, local.offsets[0] - reach)
    hi = bisect.bisect_left(first, local.offsets[0] + local.shape[0])
    return order[lo:hi]


def plan_reads(entry: TensorEntry, local: Box) -> list[ReadPiece]:
    """The pieces that fill ``local``, each element exactly once (formats/README.md §2.1):
    MalformedIndexError for a chunk outside the tensor's shape, ShardingError when the chunks
    leave a hole in ``local`` or overlap in it, before anything is read."""
    pieces = []
    covered = 0
    shape, nd = entry.shape, len(entry.shape)
    l_off, l_end = local.offsets, local.ends
    whole: dict[tuple[int, ...], Box] = {}  # the src of a chunk read whole, one per chunk shape
    for c in _candidates(entry, local):
        off, size = c.offsets, c.shape
        ends = tuple(map(operator.add, off, size))
        if len(off) != nd or len(size) != nd or not all(map(operator.le, ends, shape)) \
                or (nd and (min(off) < 0 or min(size) < 0)):
            raise _outside(entry, c)
        lo = tuple(map(max, off, l_off))
        hi = tuple(map(min, ends, l_end))
        if lo == off and hi == ends and (not nd or min(size) > 0):  # inside the region: whole
            src = whole.get(size)
            if src is None:
                src = whole[size] = Box((0,) * nd, size)
            common = size
        else:
            common = tuple(map(operator.sub, hi, lo))
            if nd and min(common) <= 0:
                continue
            src = Box(tuple(map(operator.sub, lo, off)), common)
        pieces.append(ReadPiece(c, src, Box(tuple(map(operator.sub, lo, l_off)), common)))
        covered += math.prod(common)
    if covered != local.volume:
        raise ShardingError(
            f"key {entry.key!r}: the checkpoint's chunks cover {covered} of the {local.volume} "
            f"elements this rank needs ({local})"
        )
    both = first_overlap([p.dst for p in pieces]) if len(pieces) > 1 else None
    if both is not None:  # the volumes add up, so an overlap hides a hole
        a, b = (Box(tuple(x + o for x, o in zip(q.offsets, local.offsets, strict=True)), q.shape)
                for q in both)
        raise ShardingError(f"key {entry.key!r}: the checkpoint's chunks overlap ({a} and {b}) "
                            f"and leave a hole of the same size in {local}")
    return pieces
