"""The read engine: turn read pieces into byte reads, run them, and place the bytes.

Bytes land directly in the target tensor when its region is contiguous CPU memory; otherwise
they land in scratch leased from the engine's buffer pool (engine/buffers.py) and are copied
once into the target. The pool bounds scratch held at once (``IOConfig.scratch_bytes``): each
file's pieces are read in batches whose scratch fits the budget, so a load of any size needs
at most that much extra memory.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ckptfs.engine.buffers import BufferPool
from ckptfs.errors import IntegrityError
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.backend import Backend, EncodedChunk, RawChunk
from ckptfs.layout.checksum import checksum
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.geometry import c_strides, region_runs
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import get_backend
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
    """The reads of one batch and what runs after them (checks, copies into targets)."""

    reads: list[ReadInto]
    after: list[Callable[[], None]]


#: (scratch bytes, fn(work, scratch view of exactly that many bytes)) for one piece
_Planned = tuple[int, Callable[[_FileWork, memoryview], None]]


def _typed(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


async def read_tensors(store: Store, index: Index, jobs: Sequence[TensorRead], *,
                       verify: bool = True) -> tuple[int, int]:
    """Fill the jobs' targets from the checkpoint ``index`` describes, with the index's backend
    and a scratch pool bounded by the store's ``IOConfig.scratch_bytes``; returns (bytes the
    targets needed, peak scratch bytes held at once)."""
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    pool = BufferPool(limit=store.config.scratch_bytes)
    needed = await execute_reads(store, backend, jobs, pool=pool, verify=verify)
    return needed, pool.peak


async def execute_reads(store: Store, backend: Backend, jobs: Sequence[TensorRead], *,
                        pool: BufferPool, verify: bool = True) -> int:
    """Run every read; returns the number of bytes the targets needed.

    Reads into contiguous CPU targets need no scratch; the others lease it from ``pool``.
    ``verify`` checks the crc32c of every chunk read whole. A missing or short data file is an
    IntegrityError naming the file and the keys read from it.
    """
    per_file: dict[str, list[_Planned]] = defaultdict(list)
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
    limit = pool.budget.limit

    async def run_file(path: str, planned: list[_Planned]) -> None:
        for cost, batch in _batches(planned, limit):
            lease = await pool.lease(cost)
            try:
                work = _FileWork([], [])
                scratch, pos = lease.view, 0
                for c, materialize in batch:
                    materialize(work, scratch[pos : pos + c])
                    pos += c
                try:
                    await store.read_into(path, work.reads)
                except FileNotFoundError as e:
                    raise _damaged(path, keys_of[path], f"the data file is missing ({e})") from None
                except EOFError as e:
                    raise _damaged(path, keys_of[path], f"the data file is truncated ({e})") from None
                if work.after:
                    await asyncio.to_thread(_run_all, work.after)
            finally:
                await pool.release(lease)

    async def run_encoded(job: TensorRead, piece: ReadPiece, src: EncodedChunk) -> None:
        cost = 2 * _nbytes(piece.chunk.shape, from_name(job.entry.dtype).itemsize)
        async with pool.budget.hold(cost):  # the fetched bytes and the decoded ones
            await _run_encoded(store, job, piece, src, verify)

    await gather_all(*(run_file(p, w) for p, w in per_file.items()),  # a failure cancels the rest
                     *(run_encoded(j, p, s) for j, p, s in encoded))
    return needed


def _damaged(file: str, keys: set[str] | list[str], what: str) -> IntegrityError:
    """A data file the index lists is gone or short: the checkpoint is damaged."""
    return IntegrityError(f"key(s) {', '.join(map(repr, sorted(keys)))}: {file}: {what}")


def _run_all(fns: list[Callable[[], None]]) -> None:
    for f in fns:
        f()


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    for n in shape:
        itemsize *= n
    return itemsize


def _batches(planned: list[_Planned], budget: int | None):
    """Consecutive pieces whose scratch fits the budget (a lone oversized piece is a batch)."""
    batch: list[tuple[int, Callable[[_FileWork, memoryview], None]]] = []
    cost = 0
    for c, fn in planned:
        if batch and budget is not None and cost + c > budget:
            yield cost, batch
            batch, cost = [], 0
        batch.append((c, fn))
        cost += c
    if batch:
        yield cost, batch


def _checker(key: str, chunk: ChunkEntry, file: str, verify: bool,
             whole: bool) -> Callable[[memoryview | torch.Tensor], None] | None:
    """A function checking the crc32c of a chunk's raw C-order bytes, when they are all read."""
    if not (verify and whole and chunk.checksum is not None):
        return None
    want = chunk.checksum

    def check(data: memoryview | torch.Tensor) -> None:
        got = checksum(tensor_bytes(data) if isinstance(data, torch.Tensor) else data)
        if got != want:
            raise IntegrityError(f"key {key!r}: chunk at {list(chunk.offsets)} in {file} fails its "
                                 f"checksum (index says {want}, data gives {got})")

    return check


def _plan_raw(job: TensorRead, piece: ReadPiece, src: RawChunk, dtype: torch.dtype,
              itemsize: int, max_gap: int, verify: bool) -> _Planned:
    """(scratch bytes, a function adding this piece's reads and post-copies to a _FileWork)."""
    chunk = piece.chunk
    layout = src.stored_shape or chunk.shape  # padded chunks hold their elements in a corner
    dst = job.target[piece.dst.slices()]
    starts, run = region_runs(layout, itemsize, piece.src)
    check = _checker(job.entry.key, chunk, src.file, verify, piece.whole_chunk)

    if len(starts) == 1 and dst.device.type == "cpu" and dst.is_contiguous():
        def direct(work: _FileWork, _: memoryview) -> None:
            mv = tensor_bytes(dst)
            work.reads.append(ReadInto(src.offset + int(starts[0]), mv))
            if check is not None:
                work.after.append(lambda: check(mv))

        return 0, direct
    if len(starts) == 1:
        def compact(work: _FileWork, buf: memoryview) -> None:
            work.reads.append(ReadInto(src.offset + int(starts[0]), buf))

            def place() -> None:
                if check is not None:
                    check(buf)
                dst.copy_(_typed(buf, dtype, piece.src.shape))

            work.after.append(place)

        return run, compact
    span = int(starts[-1]) + run - int(starts[0])
    gaps = span - run * len(starts)
    if gaps <= max_gap * (len(starts) - 1):
        def spanned(work: _FileWork, buf: memoryview) -> None:
            # one read of the whole span, then one strided copy out of it
            work.reads.append(ReadInto(src.offset + int(starts[0]), buf))

            def place() -> None:
                flat = _typed(buf, dtype, (span // itemsize,))
                region = flat.as_strided(piece.src.shape, c_strides(layout))
                if check is not None:  # a padded chunk read whole: check its compact bytes
                    region = region.contiguous()
                    check(region)
                dst.copy_(region)

            work.after.append(place)

        return span, spanned

    def runs(work: _FileWork, buf: memoryview) -> None:
        # far-apart runs: read each into its slot of a compact buffer
        for i, s in enumerate(starts.tolist()):
            work.reads.append(ReadInto(src.offset + s, buf[i * run : (i + 1) * run]))

        def place() -> None:
            if check is not None:
                check(buf)
            dst.copy_(_typed(buf, dtype, piece.src.shape))

        work.after.append(place)

    return run * len(starts), runs


async def _run_encoded(store: Store, job: TensorRead, piece: ReadPiece, src: EncodedChunk,
                       verify: bool) -> None:
    try:
        if src.start is None:
            data = await store.get(src.file)
        else:
            data = await store.get_range(src.file, src.start, src.end)
    except FileNotFoundError as e:
        raise _damaged(src.file, [job.entry.key], f"the data file is missing ({e})") from None
    chunk = piece.chunk
    dt = from_name(job.entry.dtype, job.entry.key)
    check = _checker(job.entry.key, chunk, src.file, verify, True)

    def place() -> None:
        raw = src.decode(data)
        want = _nbytes(chunk.shape, dt.itemsize)
        if memoryview(raw).nbytes != want:
            raise IntegrityError(
                f"key {job.entry.key!r}: chunk at {list(chunk.offsets)} in {src.file} decodes "
                f"to {memoryview(raw).nbytes} bytes, expected {want}"
            )
        buf = memoryview(raw if isinstance(raw, bytearray) else bytearray(raw))
        if check is not None:
            check(buf)
        full = _typed(buf, dt.torch, chunk.shape)
        job.target[piece.dst.slices()].copy_(full[piece.src.slices()])

    await asyncio.to_thread(place)
