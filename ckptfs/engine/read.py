"""The read engine: turn read pieces into byte reads, run them, and place the bytes.

Bytes land directly in the target tensor when its region is contiguous in memory; otherwise
they land in a compact or span buffer and are copied once into the target.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ckptfs.errors import IntegrityError
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.backend import Backend, EncodedChunk, RawChunk
from ckptfs.layout.checksum import checksum
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.geometry import c_strides, region_runs
from ckptfs.layout.index import TensorEntry
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.planning.load_plan import ReadPiece


@dataclass(frozen=True, slots=True)
class TensorRead:
    """Fill ``target`` (one rank's local tensor) from ``pieces`` of ``entry``."""

    entry: TensorEntry
    target: torch.Tensor
    pieces: tuple[ReadPiece, ...]


@dataclass
class _FileWork:
    reads: list[ReadInto]
    after: list[Callable[[], None]]


#: Scratch memory (bytes) the reader may hold at once for regions that cannot be read in place.
SCRATCH_BUDGET = 512 << 20


class _ByteBudget:
    """A counting semaphore over bytes; a request larger than the budget waits for it to be
    empty and then runs alone."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used, self.peak = limit, 0, 0
        self.cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)

    async def release(self, n: int) -> None:
        async with self.cond:
            self.used -= n
            self.cond.notify_all()


def _typed(buf: bytearray | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


async def execute_reads(store: Store, backend: Backend, jobs: Sequence[TensorRead], *,
                        verify: bool = True, scratch_budget: int | None = None) -> int:
    """Run every read; returns the number of bytes the targets needed.

    Reads into contiguous CPU targets need no memory; the others get scratch buffers, allocated
    batch by batch so that at most ``scratch_budget`` bytes of scratch exist at once.
    """
    per_file: dict[str, list[tuple[int, Callable[[_FileWork], None]]]] = defaultdict(list)
    encoded: list[tuple[TensorRead, ReadPiece, EncodedChunk]] = []
    keys_of: dict[str, set[str]] = defaultdict(set)  # file -> keys read from it (for errors)
    needed = 0
    sources = await backend.chunk_sources(
        [(job.entry, p.chunk) for job in jobs for p in job.pieces], store)
    it = iter(sources)
    for job in jobs:
        dt = from_name(job.entry.dtype, job.entry.key)
        for piece in job.pieces:
            src = next(it)
            needed += piece.src.volume * dt.itemsize
            if isinstance(src, RawChunk):
                keys_of[src.file].add(job.entry.key)
                per_file[src.file].append(_plan_raw(job, piece, src, dt.torch, dt.itemsize,
                                                    store.config.max_gap, verify))
            else:
                encoded.append((job, piece, src))
    scratch_budget = SCRATCH_BUDGET if scratch_budget is None else scratch_budget
    budget = _ByteBudget(scratch_budget)

    async def run_file(path: str, planned: list[tuple[int, Callable[[_FileWork], None]]]) -> None:
        for cost, batch in _batches(planned, scratch_budget):
            await budget.acquire(cost)
            try:
                work = _FileWork([], [])
                for materialize in batch:
                    materialize(work)
                try:
                    await store.read_into(path, work.reads)
                except FileNotFoundError as e:
                    raise _missing_file(sorted(keys_of[path]), e) from None
                if work.after:
                    await asyncio.to_thread(_run_all, work.after)
            finally:
                await budget.release(cost)

    async def run_encoded(job: TensorRead, piece: ReadPiece, src: EncodedChunk) -> None:
        cost = 2 * _nbytes(piece.chunk.shape, from_name(job.entry.dtype).itemsize)
        await budget.acquire(cost)
        try:
            await _run_encoded(store, job, piece, src, verify)
        finally:
            await budget.release(cost)

    await gather_all(*(run_file(p, w) for p, w in per_file.items()),  # a failure cancels the rest
                     *(run_encoded(j, p, s) for j, p, s in encoded))
    return needed


def _missing_file(keys: list[str], e: FileNotFoundError) -> IntegrityError:
    """A data file the index lists is gone: the checkpoint is damaged."""
    return IntegrityError(f"key(s) {', '.join(map(repr, keys))}: a data file is missing ({e})")


def _run_all(fns: list[Callable[[], None]]) -> None:
    for f in fns:
        f()


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    for n in shape:
        itemsize *= n
    return itemsize


def _batches(planned: list[tuple[int, Callable[[_FileWork], None]]], budget: int):
    """Consecutive pieces whose scratch fits the budget (a lone oversized piece is a batch)."""
    batch: list[Callable[[_FileWork], None]] = []
    cost = 0
    for c, fn in planned:
        if batch and cost + c > budget:
            yield cost, batch
            batch, cost = [], 0
        batch.append(fn)
        cost += c
    if batch:
        yield cost, batch


def _plan_raw(job: TensorRead, piece: ReadPiece, src: RawChunk, dtype: torch.dtype,
              itemsize: int, max_gap: int, verify: bool) -> tuple[int, Callable[[_FileWork], None]]:
    """(scratch bytes, a function adding this piece's reads and post-copies to a _FileWork)."""
    chunk = piece.chunk
    layout = src.stored_shape or chunk.shape
    dst = job.target[piece.dst.slices()]
    starts, run = region_runs(layout, itemsize, piece.src)
    check = chunk.checksum if verify and piece.whole_chunk and layout == chunk.shape else None
    key = job.entry.key

    def verify_bytes(buf) -> None:
        if check is not None and checksum(buf) != check:
            raise IntegrityError(
                f"key {key!r}: chunk at {list(chunk.offsets)} in {src.file} fails its checksum "
                f"(index says {check}, data gives {checksum(buf)})"
            )

    if len(starts) == 1 and dst.device.type == "cpu" and dst.is_contiguous():
        def direct(work: _FileWork) -> None:
            mv = tensor_bytes(dst)
            work.reads.append(ReadInto(src.offset + int(starts[0]), mv))
            if check is not None:
                work.after.append(lambda: verify_bytes(mv))

        return 0, direct
    if len(starts) == 1:
        def compact(work: _FileWork) -> None:
            buf = bytearray(run)
            work.reads.append(ReadInto(src.offset + int(starts[0]), memoryview(buf)))

            def place() -> None:
                verify_bytes(buf)
                dst.copy_(_typed(buf, dtype, piece.src.shape))

            work.after.append(place)

        return run, compact
    span = int(starts[-1]) + run - int(starts[0])
    gaps = span - run * len(starts)
    if gaps <= max_gap * (len(starts) - 1):
        def spanned(work: _FileWork) -> None:
            # one read of the whole span, then one strided copy out of it
            buf = bytearray(span)
            work.reads.append(ReadInto(src.offset + int(starts[0]), memoryview(buf)))

            def place() -> None:
                flat = _typed(buf, dtype, (span // itemsize,))
                dst.copy_(flat.as_strided(piece.src.shape, c_strides(layout)))

            work.after.append(place)

        return span, spanned

    def runs(work: _FileWork) -> None:
        # far-apart runs: read each into its slot of a compact buffer
        buf = bytearray(run * len(starts))
        mv = memoryview(buf)
        for i, s in enumerate(starts.tolist()):
            work.reads.append(ReadInto(src.offset + s, mv[i * run : (i + 1) * run]))
        work.after.append(lambda: dst.copy_(_typed(buf, dtype, piece.src.shape)))

    return run * len(starts), runs


async def _run_encoded(store: Store, job: TensorRead, piece: ReadPiece, src: EncodedChunk,
                       verify: bool) -> None:
    try:
        if src.start is None:
            data = await store.get(src.file)
        else:
            data = await store.get_range(src.file, src.start, src.end)
    except FileNotFoundError as e:
        raise _missing_file([job.entry.key], e) from None
    chunk = piece.chunk
    dt = from_name(job.entry.dtype, job.entry.key)

    def place() -> None:
        raw = src.decode(data)
        want = dt.itemsize
        for n in chunk.shape:
            want *= n
        if len(raw) != want:
            raise IntegrityError(
                f"key {job.entry.key!r}: chunk at {list(chunk.offsets)} in {src.file} decodes "
                f"to {len(raw)} bytes, expected {want}"
            )
        if verify and chunk.checksum is not None and checksum(raw) != chunk.checksum:
            raise IntegrityError(
                f"key {job.entry.key!r}: chunk at {list(chunk.offsets)} in {src.file} fails its "
                f"checksum (index says {chunk.checksum}, data gives {checksum(raw)})"
            )
        buf = raw if isinstance(raw, bytearray) else bytearray(raw)
        full = _typed(buf, dt.torch, chunk.shape)
        job.target[piece.dst.slices()].copy_(full[piece.src.slices()])

    await asyncio.to_thread(place)
