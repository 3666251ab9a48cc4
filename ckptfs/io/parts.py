"""Cut a file given as buffers (and ``StreamedPart``s) into write or upload pieces without
joining the whole file."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from contextlib import closing
from typing import cast

from ckptfs.io.store import Buffer, Part
from ckptfs.io.streamed import StreamedPart

MIN_PART = 5 * 2**20  #: S3's smallest part (all but the last)
MAX_PARTS = 10_000  #: S3's most parts per upload


def byte_view(p: Buffer) -> memoryview:
    """``p`` as a flat view of unsigned bytes (``len`` is its byte count), without copying."""
    mv = memoryview(p)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def part_bytes(p: Part) -> int:
    return p.nbytes if isinstance(p, StreamedPart) else memoryview(p).nbytes


def total_bytes(parts: Sequence[Part]) -> int:
    return sum(part_bytes(p) for p in parts)


def views(parts: Sequence[Part]) -> Generator[memoryview, None, None]:
    """The flat byte views of ``parts`` in order; a ``StreamedPart``'s views are valid only until
    the next one is asked for (write each before asking)."""
    for p in parts:
        if isinstance(p, StreamedPart):
            yield from p.stream()  # closing this generator closes the stream too
        else:
            yield byte_view(p)


def materialized(parts: Sequence[Part]) -> tuple[Buffer, ...]:
    """``parts`` with each ``StreamedPart`` copied into host bytes (for a store that does not
    take streamed parts); plain buffers are passed through."""
    if not any(isinstance(p, StreamedPart) for p in parts):
        return cast("tuple[Buffer, ...]", tuple(parts))  # no StreamedPart among them
    out: list[Buffer] = []
    for p in parts:
        if isinstance(p, StreamedPart):
            buf, pos = bytearray(p.nbytes), 0
            with closing(p.stream()) as stream:
                for v in stream:
                    buf[pos : pos + v.nbytes] = v
                    pos += v.nbytes
            out.append(buf)
        else:
            out.append(p)
    return tuple(out)


def part_size_for(total: int, wanted: int) -> int:
    """``wanted``, raised to S3's minimum and so that ``total`` fits in 10,000 parts."""
    size = max(wanted, MIN_PART)
    return max(size, -(-total // MAX_PARTS))


def pieces(parts: Sequence[Part], size: int, *,
           keep: bool = False) -> Generator[list[memoryview], None, None]:
    """Consecutive pieces of ``size`` bytes (the last may be shorter) as lists of zero-copy
    views into ``parts``; the caller joins or writes one piece at a time, before asking for the
    next. Bytes of a ``StreamedPart`` are valid only until then; with ``keep`` (a caller that
    holds pieces longer) they are copied as they come."""
    cur: list[memoryview] = []
    have = 0
    for p in parts:
        streamed = isinstance(p, StreamedPart) and not keep
        with closing(_flat(p, keep)) as flat:  # a write stopped early ends the stream now
            for mv in flat:
                while mv.nbytes:
                    take = min(size - have, mv.nbytes)
                    cur.append(mv[:take])
                    mv = mv[take:]
                    have += take
                    if have == size:
                        yield cur
                        cur, have = [], 0
                if streamed and have:
                    yield cur  # a streamed view is only good until the stream goes on
                    cur, have = [], 0
    if have:
        yield cur


def _flat(p: Part, keep: bool) -> Generator[memoryview, None, None]:
    if not isinstance(p, StreamedPart):
        yield byte_view(p)
        return
    with closing(p.stream()) as stream:
        for v in stream:
            yield memoryview(bytes(v)) if keep else v


async def pieces_async(parts: Sequence[Part], size: int) -> AsyncIterator[list[memoryview]]:
    """``pieces(parts, size, keep=True)`` for a caller on the event loop: where a
    ``StreamedPart`` takes part, each piece is made in a worker thread (its stream blocks)."""
    it = pieces(parts, size, keep=True)
    try:
        if not any(isinstance(p, StreamedPart) for p in parts):
            for piece in it:
                yield piece
            return
        while (made := await asyncio.to_thread(_next, it)) is not None:
            yield made
    finally:
        it.close()


def _next(it: Iterator[list[memoryview]]) -> list[memoryview] | None:
    return next(it, None)


async def joined(parts: Sequence[Part]) -> bytes:
    """All of ``parts`` as one bytes object (a small file's single request)."""
    async for piece in pieces_async(parts, max(1, total_bytes(parts))):
        return join(piece)
    return b""


def join(piece: list[memoryview]) -> bytes:
    """One piece as bytes (the only copy made of uploaded data)."""
    return piece[0].tobytes() if len(piece) == 1 else b"".join(piece)
