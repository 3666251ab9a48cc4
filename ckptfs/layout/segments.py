"""Index segments (formats/README.md §2.6): the values a segmented root lists.

A large index is written as a small **root** (``ckptfs.index.json``, the commit point) and
**segment** files under ``index/<save_id>/``, each written by one rank, holding the chunk rows
of a run of tensors. The root lists, per tensor, the **blocks** of its rows: where each block
lies in which segment, its CRC-32C and the bounding box of its chunks, so that a reader reads
only the blocks overlapping the regions it needs. This module holds those values and the
writer's rules (which rank writes which tensors, how rows are cut into blocks); encoding and
decoding the rows is in ``segment_rows.py``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

from ckptfs.errors import MalformedIndexError
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import crc_of

#: the required feature of a segmented index (formats/README.md §2.6)
SEGMENTS = "index_segments"
#: the minor version of format 1 that introduced segments
SEGMENTS_MINOR_VERSION = 3
#: the required feature of a segmented index whose packed rows name their file by its position
#: in the root's ``file_table`` (formats/README.md §2.6, index 1.4)
SEGMENT_FILE_IDS = "segment_file_ids"
#: the minor version of format 1 that introduced ``segment_file_ids``
FILE_IDS_MINOR_VERSION = 4
#: *writer*: an index of at least this many chunks is written segmented (below it, whole)
SEGMENT_MIN_CHUNKS = 65_536
#: *writer*: the rows a segment file holds at most, unless one tensor has more
SEGMENT_ROWS = 65_536
#: *writer*: the rows of a block at most
ROWS_PER_BLOCK = 64
#: the directory of a save's segment files: ``index/<save_id>/``
SEGMENT_DIR = "index"
_MAX = 2**62
_HEX = re.compile("[0-9a-f]{8}")
_HEX_RUN = re.compile("[0-9a-f]*")


class _Chunk(Protocol):
    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class Block:
    """A run of one tensor's chunk rows in a segment: its byte range, CRC-32C and the
    bounding box ``[lo, hi)`` of its chunks."""

    segment: int  #: position in the root's ``segments`` (-1: not numbered yet, an owner's part)
    byte_offset: int
    byte_length: int
    crc: str  #: the CRC-32C of the block's bytes, 8 lowercase hex digits
    lo: tuple[int, ...]
    hi: tuple[int, ...]

    def overlaps(self, box: Box) -> bool:
        """Whether some chunk of the block may overlap ``box`` (an empty box overlaps nothing)."""
        return all(lo < o + n and o < hi and n > 0
                   for lo, hi, o, n in zip(self.lo, self.hi, box.offsets, box.shape, strict=True))

    def numbered(self, segment: int) -> Block:
        return Block(segment, self.byte_offset, self.byte_length, self.crc, self.lo, self.hi)

    def to_row(self) -> list[Any]:
        return [self.segment, self.byte_offset, self.byte_length, self.crc, list(self.lo),
                list(self.hi)]

    @classmethod
    def from_row(cls, row: Any, segments: int, ndim: int,
                 where: str | Callable[[], str]) -> Block:
        """A root's block row ``[segment, byte_offset, byte_length, crc, lo, hi]``, checked."""
        if type(row) is list and len(row) == 6:  # the common case, checked in one expression
            seg, off, length, crc, lo, hi = row
            if (type(seg) is int and 0 <= seg < segments and type(off) is int
                    and 0 <= off <= _MAX and type(length) is int and 0 <= length <= _MAX
                    and type(crc) is str and len(crc) == 8 and _HEX.fullmatch(crc) is not None
                    and type(lo) is list and type(hi) is list and len(lo) == ndim == len(hi)
                    and all(type(x) is int and type(y) is int and 0 <= x <= y <= _MAX
                            for x, y in zip(lo, hi))):
                return cls(seg, off, length, crc, tuple(lo), tuple(hi))
        return cls._from_row_checked(row, segments, ndim,
                                     where if isinstance(where, str) else where())

    @classmethod
    def _from_row_checked(cls, row: Any, segments: int, ndim: int, where: str) -> Block:
        """``from_row`` checking each part in turn, to name what is wrong."""
        if not isinstance(row, list) or len(row) != 6:
            raise MalformedIndexError(f"{where}: a block must be a list of 6 items")
        seg, off, length, crc, lo, hi = row
        for name, v, top in (("segment", seg, segments - 1), ("byte_offset", off, _MAX),
                             ("byte_length", length, _MAX)):
            if not _int(v) or not 0 <= v <= top:
                raise MalformedIndexError(f"{where}: {name} {v!r} is not an int in [0, {top}]")
        if not isinstance(crc, str) or len(crc) != 8 or crc.strip("0123456789abcdef"):
            raise MalformedIndexError(f"{where}: crc {crc!r} is not 8 lowercase hex digits")
        for name, v in (("lo", lo), ("hi", hi)):
            if (not isinstance(v, list) or len(v) != ndim
                    or not all(_int(x) and 0 <= x <= _MAX for x in v)):
                raise MalformedIndexError(f"{where}: {name} must be {ndim} ints in [0, 2**62]")
        if any(map(operator.gt, lo, hi)):
            raise MalformedIndexError(f"{where}: lo {lo} lies beyond hi {hi}")
        return cls(seg, off, length, crc, tuple(lo), tuple(hi))


class ReadBlocks(Sequence[Block]):
    """A root tensor's blocks as read, checked: made into ``Block`` values when first used. A
    root lists tens of thousands of blocks and a rank looks at those of the tensors it loads."""

    __slots__ = ("_blocks", "_rows")

    def __init__(self, rows: list[list[Any]]) -> None:
        self._rows: list[list[Any]] | None = rows
        self._blocks: tuple[Block, ...] | None = None

    def _made(self) -> tuple[Block, ...]:
        if self._blocks is None:
            assert self._rows is not None
            self._blocks = tuple(Block(s, o, n, c, tuple(lo), tuple(hi))
                                 for s, o, n, c, lo, hi in self._rows)
            self._rows = None
        return self._blocks

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else len(self._made())

    def __getitem__(self, i: Any) -> Any:
        return self._made()[i]

    def __iter__(self) -> Iterator[Block]:
        return iter(self._made())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReadBlocks | tuple):
            return self._made() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._made())

    def __repr__(self) -> str:
        return repr(self._made())

    def __reduce__(self) -> tuple[Any, ...]:
        return tuple, (self._made(),)


def blocks_of(rows: Any, segments: int, ndim: int) -> Sequence[Block] | None:
    """A root tensor's block rows, checked column by column when every one is well formed (as
    ``Block.from_row`` checks it), made into ``Block`` values when first used; None when some
    row is not well formed (the row-by-row checks then name it)."""
    if type(rows) is not list or not all(type(r) is list and len(r) == 6 for r in rows):
        return None
    if not rows:
        return ()
    segs, offs, lens, crcs, los, his = zip(*rows)
    ints = [*segs, *offs, *lens]
    if (set(map(type, ints)) != {int} or min(ints) < 0 or max(ints) > _MAX
            or max(segs) >= segments or set(map(type, crcs)) != {str}
            or set(map(len, crcs)) != {8} or _HEX_RUN.fullmatch("".join(crcs)) is None
            or set(map(type, los)) != {list} or set(map(type, his)) != {list}
            or set(map(len, los + his)) != {ndim}):
        return None
    lo, hi = [*chain.from_iterable(los)], [*chain.from_iterable(his)]
    if lo and (set(map(type, lo + hi)) != {int} or min(lo) < 0 or max(hi) > _MAX
               or not all(map(operator.le, lo, hi))):
        return None
    return ReadBlocks(rows)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, slots=True)
class SegmentFile:
    """A segment file as its writer reports it: path, size and CRC-32C ("crc32c:...")."""

    path: str
    size: int
    checksum: str


@dataclass(frozen=True, slots=True)
class SegmentPart:
    """What one segment's owner reports to the coordinator: the file and, per tensor key, the
    blocks of its rows (``segment`` -1: the coordinator numbers them); ``table``: the digest of
    the file table its packed rows number (``table_digest``; None: rows name files by path)."""

    file: SegmentFile
    blocks: tuple[tuple[str, tuple[Block, ...]], ...]
    table: str | None = None


@dataclass(frozen=True, slots=True)
class Owner:
    """*Writer*: segment ``pos`` holds the tensors ``keys[start:stop]`` (in index order) and is
    written by ``rank``."""

    pos: int
    rank: int
    start: int
    stop: int


def table_digest(table: Sequence[str]) -> str:
    """*Writer*: what an owner and the coordinator compare to know that the rows number the
    root's ``file_table`` (its paths in order): their count and the CRC-32C of their lines."""
    return f"{len(table)}:{crc_of(''.join(p + chr(10) for p in table).encode()):08x}"


def numbering(files: Iterable[str]) -> dict[str, int]:
    """*Writer*: the root's ``file_table`` as written (every file once, in code point order of
    the path) as positions by path: what an owner numbers its packed rows with."""
    return {p: i for i, p in enumerate(sorted(set(files)))}


def segment_path(save_id: str, pos: int) -> str:
    """The path of a save's segment ``pos``: ``index/<save_id>/s00000.json``."""
    return f"{SEGMENT_DIR}/{save_id}/s{pos:05d}.json"


def partition(counts: Sequence[int], world: int, rows: int = SEGMENT_ROWS) -> tuple[Owner, ...]:
    """*Writer*: the tensors (their chunk counts, in index order) cut into contiguous runs of
    about ``rows`` rows (a tensor is never split), at most one run per rank; run ``s`` of ``n``
    is written by rank ``s * world // n`` (spread over the ranks, so over the nodes)."""
    total = sum(counts)
    target = max(rows, math.ceil(total / max(world, 1)), 1)
    runs: list[tuple[int, int]] = []
    start, held = 0, 0
    for i, n in enumerate(counts):
        if held and held + n > target:
            runs.append((start, i))
            start, held = i, 0
        held += n
    if start < len(counts) or not runs:
        runs.append((start, len(counts)))
    return tuple(Owner(s, s * world // len(runs), a, b) for s, (a, b) in enumerate(runs))


def block_order(chunks: Sequence[_Chunk]) -> list[_Chunk]:
    """*Writer*: a tensor's rows in block order: sorted by offsets, taking the dimensions with
    the fewest distinct offsets first (ties: lower dimension first), so that the blocks cut from
    the run are narrow along the dimensions readers split (a tensor-parallel column strip is one
    run)."""
    if len(chunks) < 2:
        return list(chunks)
    ndim = len(chunks[0].offsets)
    distinct = [len({c.offsets[d] for c in chunks}) for d in range(ndim)]
    dims = sorted(range(ndim), key=lambda d: (distinct[d], d))
    return sorted(chunks, key=lambda c: tuple(c.offsets[d] for d in dims))


def bounding(chunks: Sequence[_Chunk]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The bounding box ``(lo, hi)`` of ``chunks`` (at least one)."""
    lo = tuple(map(min, *(c.offsets for c in chunks))) if len(chunks) > 1 else chunks[0].offsets
    ends = [tuple(map(operator.add, c.offsets, c.shape)) for c in chunks]
    hi = tuple(map(max, *ends)) if len(ends) > 1 else ends[0]
    return tuple(lo), tuple(hi)
