"""Byte ranges as values, and the coalescing policy of the storage layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ByteRange:
    """Bytes ``[start, end)`` of one file."""

    start: int  #: first byte
    end: int  #: one past the last byte

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class ReadInto:
    """Read ``len(dest)`` bytes starting at ``start`` into the writable buffer ``dest``."""

    start: int  #: first byte in the file
    dest: memoryview  #: writable, C-contiguous byte buffer

    @property
    def end(self) -> int:
        return self.start + self.dest.nbytes


@dataclass(frozen=True, slots=True)
class Coalesced:
    """One request covering several reads, gaps included."""

    span: ByteRange
    reads: tuple[ReadInto, ...]


def coalesce(reads: Sequence[ReadInto], max_gap: int, max_span: int) -> list[Coalesced]:
    """Merge reads whose gap is at most ``max_gap`` bytes, up to ``max_span`` bytes per request.

    Overlapping reads are allowed (they share the fetched span). Order of the result follows
    the file offsets.
    """
    out: list[Coalesced] = []
    cur: list[ReadInto] = []
    start = end = 0
    for r in sorted(reads, key=lambda r: r.start):
        if cur and r.start - end <= max_gap and max(end, r.end) - start <= max_span:
            cur.append(r)
            end = max(end, r.end)
            continue
        if cur:
            out.append(Coalesced(ByteRange(start, end), tuple(cur)))
        cur, start, end = [r], r.start, r.end
    if cur:
        out.append(Coalesced(ByteRange(start, end), tuple(cur)))
    return out
