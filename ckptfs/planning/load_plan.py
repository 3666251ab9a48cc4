"""Who reads what: intersect a rank's local shard with the stored chunks of its key."""

from __future__ import annotations

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


def plan_reads(entry: TensorEntry, local: Box) -> list[ReadPiece]:
    """The pieces that fill ``local``, each element exactly once (formats/README.md §2.1):
    MalformedIndexError for a chunk outside the tensor's shape, ShardingError when the chunks
    leave a hole in ``local`` or overlap in it, before anything is read."""
    pieces = []
    covered = 0
    for c in entry.chunks:
        cbox = Box(c.offsets, c.shape)
        if not cbox.in_bounds(entry.shape):
            raise MalformedIndexError(f"key {entry.key!r}: chunk {cbox} lies outside the tensor's "
                                      f"shape {list(entry.shape)}")
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
    both = first_overlap([p.dst for p in pieces]) if len(pieces) > 1 else None
    if both is not None:  # the volumes add up, so an overlap hides a hole
        a, b = (Box(tuple(x + o for x, o in zip(q.offsets, local.offsets, strict=True)), q.shape)
                for q in both)
        raise ShardingError(f"key {entry.key!r}: the checkpoint's chunks overlap ({a} and {b}) "
                            f"and leave a hole of the same size in {local}")
    return pieces
