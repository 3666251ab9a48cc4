"""Cut a file given as buffers into upload parts without joining the whole file."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ckptfs.io.store import Buffer

MIN_PART = 5 * 2**20  #: S3's smallest part (all but the last)
MAX_PARTS = 10_000  #: S3's most parts per upload


def byte_view(p: Buffer) -> memoryview:
    """``p`` as a flat view of unsigned bytes (``len`` is its byte count), without copying."""
    mv = memoryview(p)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def total_bytes(parts: Sequence[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def part_size_for(total: int, wanted: int) -> int:
    """``wanted``, raised to S3's minimum and so that ``total`` fits in 10,000 parts."""
    size = max(wanted, MIN_PART)
    return max(size, -(-total // MAX_PARTS))


def pieces(parts: Sequence[Buffer], size: int) -> Iterator[list[memoryview]]:
    """Consecutive pieces of ``size`` bytes (the last may be shorter) as lists of zero-copy
    views into ``parts``; the caller joins one piece at a time."""
    cur: list[memoryview] = []
    have = 0
    for p in parts:
        mv = byte_view(p)
        while mv.nbytes:
            take = min(size - have, mv.nbytes)
            cur.append(mv[:take])
            mv = mv[take:]
            have += take
            if have == size:
                yield cur
                cur, have = [], 0
    if have:
        yield cur


def join(piece: list[memoryview]) -> bytes:
    """One piece as bytes (the only copy made of uploaded data)."""
    return piece[0].tobytes() if len(piece) == 1 else b"".join(piece)
