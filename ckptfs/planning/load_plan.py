"""Who reads what: intersect a rank's local shard with the stored chunks of its key."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box
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


def _candidates(entry: TensorEntry, local: Box) -> Sequence[ChunkEntry]:
    """The chunks that may meet ``local``: with many chunks, only those whose extent along the
    first dimension can reach it (bisection on the chunks ordered by their first offset)."""
    chunks = entry.chunks
    if len(chunks) < 64 or not local.shape:
        return chunks
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
    """The pieces that fill ``local``; raises ShardingError if the chunks leave a hole."""
    pieces = []
    covered = 0
    for c in _candidates(entry, local):
        cbox = Box(c.offsets, c.shape)
        common = cbox.intersect(local)
        if common is None:
            continue
        pieces.append(ReadPiece(c, common.relative_to(cbox), common.relative_to(local)))
        covered += common.volume
    if covered != local.volume:
        raise ShardingError(
            f"key {entry.key!r}: the checkpoint's chunks cover {covered} of the {local.volume} "
            f"elements this rank needs ({local})"
        )
    return pieces
