"""The read engine: turn read pieces into byte reads, run them, and place the bytes.

Bytes land directly in the target tensor when its region is contiguous CPU memory; otherwise
they land in scratch leased from the engine's buffer pool (engine/buffers.py) and are copied
once into the target. The pool bounds scratch held at once (``IOConfig.scratch_bytes``): each
file's pieces are read in batches whose scratch fits the budget, so a load of any size needs
at most that much extra memory.

Regions of CUDA targets go through a ring of pinned buffers instead (engine/ring.py,
``IOConfig.ring_bytes``): pieces are cut to fit a ring slot, read compact into it, and copied
to the device asynchronously, the copy started before the slot's check so that the two overlap
(a mismatch fails the load); a chunk cut into several pieces is still checked whole (the CRCs
of its pieces, combined). With ``IOConfig.gds`` chunks may go straight to the device
(engine/gds.py). The CUDA paths run in tests/test_gpu.py on a GPU machine (docs/guide/gpu.md).

A batch's reads go to the store in waves of about ``_WAVE`` bytes that run concurrently; each
wave's checksums and copies start as soon as its own reads are done, so they overlap the later
reads instead of following the last one (a chunk larger than a wave is read in parts whose
CRCs are combined).
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.engine.buffers import BufferPool
from ckptfs.engine.gds import DirectReads, gds_reader
from ckptfs.engine.ring import Completion, Ring, cuda_ring
from ckptfs.errors import IntegrityError
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all, settled
from ckptfs.layout.backend import Backend, EncodedChunk, RawChunk
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum, combine, crc_of, render
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.geometry import c_order_cuts, c_strides, region_runs
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.nogc import paused_gc
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
    pending: list[Completion]  #: copies started out of the batch's buffer (ring batches)


#: (scratch bytes, fn(work, scratch view of exactly that many bytes)) for one piece
_Planned = tuple[int, Callable[[_FileWork, memoryview], None]]

#: bytes of reads per wave: a wave's checks and copies run while later waves are read
_WAVE = 32 << 20
#: a file whose pieces all go straight into their targets and need at most this many bytes is
#: small; at least ``_SMALL_GROUP`` of them are read in groups of that many (``Store.read_files``):
#: 20,000 one-array zarr files, cold, took 10 s one ``read_into`` each, against 3.3 s for plain
#: reads from 16 threads
_SMALL_FILE = 1 << 20
_SMALL_GROUP = 64
_NO_SCRATCH = memoryview(b"")
#: bytes of each part of a region read through the ring (at most a slot), and of its waves:
#: each part is read, checked and copied to the device on its own. Large parts measured fastest
#: on an H100 host (bench/gpu.py; 4-16 MiB parts were 2-5x slower: each device copy costs
#: about 0.2 ms to start there), so a slot of the default ring holds one part
RING_PIECE = 64 << 20


def _typed(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


async def read_tensors(store: Store, index: Index, jobs: Sequence[TensorRead], *,
                       verify: bool = True) -> tuple[int, int]:
    """Fill the jobs' targets from the checkpoint ``index`` describes, with the index's backend
    and a scratch pool bounded by the store's ``IOConfig.scratch_bytes`` (and, for CUDA targets,
    a pinned ring of ``IOConfig.ring_bytes``); returns (bytes the targets needed, peak scratch
    and ring bytes held at once)."""
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    pool = BufferPool(limit=store.config.scratch_bytes)
    cfg = store.config
    ring = cuda_ring((j.target for j in jobs), ring_bytes=cfg.ring_bytes, slots=cfg.ring_slots)
    direct = gds_reader(store, verify) if ring is not None and cfg.gds else None
    try:
        with paused_gc():  # a piece of planning per small tensor (layout/nogc.py)
            needed = await execute_reads(store, backend, jobs, pool=pool, verify=verify,
                                         ring=ring, direct=direct)
    except BaseException:
        if ring is not None:
            await ring.close(quiet=True)  # the first error is the one to raise
        raise
    if ring is not None:
        await ring.close()
    return needed, pool.peak + (ring.pool.peak if ring is not None else 0)


async def execute_reads(store: Store, backend: Backend, jobs: Sequence[TensorRead], *,
                        pool: BufferPool, verify: bool = True, ring: Ring | None = None,
                        direct: DirectReads | None = None) -> int:
    """Run every read; returns the number of bytes the targets needed.

    Reads into contiguous CPU targets need no scratch; the others lease it from ``pool``, or
    from ``ring`` for the targets it accepts (``direct`` may read some of those in place).
    ``verify`` checks the crc32c of every chunk read whole. A missing or short data file is an
    IntegrityError naming the file and the keys read from it.
    """
    per_file: dict[str, list[_Planned]] = defaultdict(list)
    ring_file: dict[str, list[_Planned]] = defaultdict(list)  # pieces through the ring
    encoded: list[tuple[TensorRead, ReadPiece, EncodedChunk]] = []
    keys_of: dict[str, set[str]] = defaultdict(set)  # file -> keys read from it (for errors)
    file_bytes: dict[str, int] = defaultdict(int)  # file -> bytes its pieces need
    needed = 0
    sources = await backend.chunk_sources(
        [(job.entry, p.chunk) for job in jobs for p in job.pieces], store)
    it = iter(sources)
    for job in jobs:
        dt = from_name(job.entry.dtype, job.entry.key)
        ringed = ring is not None and ring.accepts(job.target)
        for piece in job.pieces:
            src = next(it)
            needed += piece.src.volume * dt.itemsize
            if isinstance(src, RawChunk):
                keys_of[src.file].add(job.entry.key)
                file_bytes[src.file] += piece.src.volume * dt.itemsize
                if ringed and direct is not None and direct.add(job, piece, src, dt.itemsize):
                    continue
                if ringed:
                    ring_file[src.file].extend(_plan_ring(job, piece, src, dt.torch, dt.itemsize,
                                                          verify, ring))
                    continue
                per_file[src.file].extend(_plan_raw(job, piece, src, dt.torch, dt.itemsize,
                                                    store.config.max_gap, verify))
            else:
                encoded.append((job, piece, src))
    limit = pool.budget.limit

    async def read_wave(path: str, wave: _FileWork) -> None:
        try:
            await store.read_into(path, wave.reads)
        except (FileNotFoundError, EOFError) as e:
            raise _read_failed(path, keys_of[path], e) from None

    async def run_stream(path: str, waves: list[_FileWork]) -> None:
        """Read ``waves`` one after the other; each wave's checks and copies run while the
        next waves are read."""
        afters: list[asyncio.Future[None]] = []
        try:
            for wave in waves:
                await read_wave(path, wave)
                if wave.after:
                    afters.append(asyncio.ensure_future(_run_after(wave.after)))
        except BaseException:
            for a in afters:
                a.cancel()
            if afters:
                await asyncio.wait(afters)  # nothing copies out of the lease once it is back
            raise
        await gather_all(*afters)

    async def run_batch(path: str, lease, batch, via: Ring | None) -> None:
        pending: list[Completion] = []  # copies started out of the lease (ring batches)
        wave = _WAVE if via is None else RING_PIECE
        try:
            waves = [_FileWork([], [], pending)]
            scratch, pos, size = lease.view, 0, 0
            for c, materialize in batch:
                if size >= wave:
                    waves.append(_FileWork([], [], pending))
                    size = 0
                n = len(waves[-1].reads)
                materialize(waves[-1], scratch[pos : pos + c])
                size += sum(r.dest.nbytes for r in waves[-1].reads[n:])
                pos += c
            await gather_all(*(run_stream(path, s)
                               for s in _streams(waves, store.read_streams(path))))
        finally:
            if via is None:
                await pool.release(lease)
            else:  # reused once the copies out of it complete
                await via.release(lease, pending)

    async def run_file(path: str, planned: list[_Planned]) -> None:
        for cost, batch in _batches(planned, limit):
            await run_batch(path, await pool.lease(cost), batch, None)

    async def run_ring_file(path: str, planned: list[_Planned], via: Ring) -> None:
        """The file's batches in file order, each in a slot of its own as soon as one is free:
        the reads into one slot overlap the checks and device copies out of the others."""
        started: list[asyncio.Future[None]] = []
        try:
            for cost, batch in _batches(planned, via.slot_bytes):
                if any(t.done() and not t.cancelled() and t.exception() for t in started):
                    break  # a batch failed: lease no more (gather_all below raises it)
                started.append(asyncio.ensure_future(
                    run_batch(path, await via.lease(cost), batch, via)))
        except BaseException:
            for t in started:
                t.cancel()
            if started:
                await asyncio.wait(started)
            raise
        await gather_all(*started)

    async def run_small(files: list[tuple[str, list[_Planned]]]) -> None:
        """Small files read straight into their targets (no scratch), as one group: one store
        call (a local store reads them in one worker thread) and one run of their checks."""
        works = []
        for path, planned in files:
            work = _FileWork([], [], [])
            for _, materialize in planned:
                materialize(work, _NO_SCRATCH)
            works.append((path, work))
        errors = await store.read_files([(path, w.reads) for path, w in works])
        for (path, _), e in zip(works, errors):
            if e is not None:  # returned, not raised here: no context to suppress
                raise _read_failed(path, keys_of[path], e)
        after = [fn for _, w in works for fn in w.after]
        if after:
            await _run_after(after)

    small = [(p, w) for p, w in per_file.items()
             if file_bytes[p] <= _SMALL_FILE and all(c == 0 for c, _ in w)]
    if len(small) < _SMALL_GROUP:  # only many small files are grouped (W4, zarr's file per array)
        small = []
    for p, _ in small:
        del per_file[p]

    async def run_encoded(job: TensorRead, piece: ReadPiece, src: EncodedChunk) -> None:
        cost = 2 * _nbytes(piece.chunk.shape, from_name(job.entry.dtype).itemsize)
        async with pool.budget.hold(cost):  # the fetched bytes and the decoded ones
            await _run_encoded(store, job, piece, src, verify)

    await gather_all(*(run_file(p, w) for p, w in per_file.items()),  # a failure cancels the rest
                     *(run_small(small[i : i + _SMALL_GROUP]) for i in range(0, len(small), _SMALL_GROUP)),
                     *(run_ring_file(p, w, ring) for p, w in ring_file.items()),  # type: ignore[arg-type]
                     *(run_encoded(j, p, s) for j, p, s in encoded),
                     *((direct.run(store, _damaged, keys_of),) if direct is not None else ()))
    return needed


def _damaged(file: str, keys: set[str] | list[str], what: str) -> IntegrityError:
    """A data file the index lists is gone or short: the checkpoint is damaged."""
    return IntegrityError(f"key(s) {', '.join(map(repr, sorted(keys)))}: {file}: {what}")


def _read_failed(file: str, keys: set[str], e: BaseException) -> BaseException:
    """What a failed read of ``file`` raises: a missing or short file is ``_damaged``; any other
    error is itself."""
    if isinstance(e, FileNotFoundError):
        return _damaged(file, keys, f"the data file is missing ({e})")
    if isinstance(e, EOFError):
        return _damaged(file, keys, f"the data file is truncated ({e})")
    return e


def _run_all(fns: list[Callable[[], None]]) -> None:
    for f in fns:
        f()


async def _run_after(fns: list[Callable[[], None]]) -> None:
    """Run ``fns`` in a worker thread; if cancelled, still wait for the thread, so that nothing
    copies out of a buffer after it was given back."""
    await settled(asyncio.get_running_loop().run_in_executor(None, _run_all, fns))


def _nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    for n in shape:
        itemsize *= n
    return itemsize


def _streams(waves: list[_FileWork], streams: int | None) -> list[list[_FileWork]]:
    """``waves`` (in file order) as ``streams`` runs of consecutive waves, each read in order;
    one wave per run when the store has no preference."""
    if streams is None or len(waves) <= streams:
        return [[w] for w in waves]
    waves = sorted(waves, key=lambda w: min((r.start for r in w.reads), default=0))
    n = len(waves)
    return [waves[i * n // streams : (i + 1) * n // streams] for i in range(streams)]


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
            raise _mismatch(key, chunk, file, got)

    return check


def _mismatch(key: str, chunk: ChunkEntry, file: str, got: str) -> IntegrityError:
    return IntegrityError(f"key {key!r}: chunk at {list(chunk.offsets)} in {file} fails its "
                          f"checksum (index says {chunk.checksum}, data gives {got})")


def _combined_checkers(key: str, chunk: ChunkEntry, file: str, sizes: list[int],
                       whole: bool) -> list[Callable[[memoryview], None] | None]:
    """Checks for the parts of one chunk (of ``sizes`` bytes, in C order), fed in any order
    from any thread: the last one to run combines their CRCs and compares with the index's."""
    if not (whole and chunk.checksum is not None):
        return [None] * len(sizes)
    crcs = [0] * len(sizes)
    left, lock = [len(sizes)], threading.Lock()

    def part(i: int) -> Callable[[memoryview], None]:
        def check(data: memoryview) -> None:
            crcs[i] = crc_of(data)
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            total = 0
            for c, n in zip(crcs, sizes, strict=True):
                total = combine(total, c, n)
            if render(total) != chunk.checksum:
                raise _mismatch(key, chunk, file, render(total))

        return check

    return [part(i) for i in range(len(sizes))]


def _plan_ring(job: TensorRead, piece: ReadPiece, src: RawChunk, dtype: torch.dtype,
               itemsize: int, verify: bool, ring: Ring) -> list[_Planned]:
    """``piece`` cut to fit ``ring``'s slots, each part read compact into a slot and copied out
    by ``ring.copier``; a chunk read whole is checked across its parts (their CRCs computed in
    any order, on any thread, and combined by the last), after its device copy was started."""
    parts = split_piece(piece, itemsize, min(ring.slot_bytes, RING_PIECE))
    if len(parts) == 1:
        checks = [_checker(job.entry.key, piece.chunk, src.file, verify, piece.whole_chunk)]
    else:
        checks = _combined_checkers(job.entry.key, piece.chunk, src.file,
                                    [p.src.volume * itemsize for p in parts],
                                    verify and piece.whole_chunk)
    return [_plan_raw(job, p, src, dtype, itemsize, 0, c, ring.copier)[0]
            for p, c in zip(parts, checks, strict=True)]


def split_piece(piece: ReadPiece, itemsize: int, limit: int) -> list[ReadPiece]:
    """``piece`` cut into pieces of at most ``limit`` bytes, in the C order of its region
    (``geometry.c_order_cuts``)."""
    cuts = c_order_cuts(piece.src.shape, itemsize, limit)
    if len(cuts) == 1:
        return [piece]
    return [ReadPiece(piece.chunk, Box(_add(piece.src.offsets, c.offsets), c.shape),
                      Box(_add(piece.dst.offsets, c.offsets), c.shape)) for c in cuts]


def _add(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x + y for x, y in zip(a, b, strict=True))


def _plan_raw(job: TensorRead, piece: ReadPiece, src: RawChunk, dtype: torch.dtype,
              itemsize: int, max_gap: int,
              check: bool | Callable[[memoryview | torch.Tensor], None] | None,
              copier: Callable[[torch.Tensor, torch.Tensor], Completion] | None = None,
              ) -> list[_Planned]:
    """(scratch bytes, a function adding reads and post-copies to a _FileWork) for ``piece``:
    one, or for a region read in place, one per ``_WAVE`` bytes of it. ``check``: the checker
    to run on the piece's bytes, or (True) that the engine verifies chunks read whole.
    With ``copier`` (a ring piece) the region is read compact and copied out by it."""
    chunk = piece.chunk
    layout = src.stored_shape or chunk.shape  # padded chunks hold their elements in a corner
    starts: Any  # np.ndarray of run starts, or (0,)
    if (src.stored_shape is None and piece.src.shape == chunk.shape
            and piece.dst.shape == tuple(job.target.shape)):
        # a whole unpadded chunk filling the whole target (small tensors): one run, no slicing
        dst, starts, run = job.target, (0,), _nbytes(chunk.shape, itemsize)
    else:
        dst = job.target[piece.dst.slices()]
        starts, run = region_runs(layout, itemsize, piece.src)
    if (copier is None and len(starts) == 1 and dst.device.type == "cpu"
            and dst.is_contiguous()):
        # straight into the target, in parts of a wave each, every part checked on arrival
        mv = tensor_bytes(dst)
        at = src.offset + int(starts[0])
        cuts = range(0, mv.nbytes, _WAVE)
        checks = _combined_checkers(job.entry.key, chunk, src.file,
                                    [min(_WAVE, mv.nbytes - o) for o in cuts],
                                    check is True and piece.whole_chunk)
        return [(0, _direct(ReadInto(at + o, mv[o : o + _WAVE]), c))
                for o, c in zip(cuts, checks, strict=True)]
    if check is True:
        check = _checker(job.entry.key, chunk, src.file, True, piece.whole_chunk)
    return [_plan_copied(job, piece, dtype, itemsize, max_gap, check or None, copier, layout, dst,
                         starts, run, src.offset)]


def _direct(read: ReadInto, check: Callable[[memoryview], None] | None,
            ) -> Callable[[_FileWork, memoryview], None]:
    def direct(work: _FileWork, _: memoryview) -> None:
        work.reads.append(read)
        if check is not None:
            work.after.append(lambda: check(read.dest))

    return direct


def _plan_copied(job: TensorRead, piece: ReadPiece, dtype: torch.dtype, itemsize: int,
                 max_gap: int, check: Callable[[memoryview | torch.Tensor], None] | None,
                 copier: Callable[[torch.Tensor, torch.Tensor], Completion] | None,
                 layout: tuple[int, ...], dst: torch.Tensor, starts, run: int,
                 offset: int) -> _Planned:
    """A piece read into scratch, then checked and copied into ``dst`` (or by ``copier``)."""

    def place(work: _FileWork, buf: memoryview) -> None:
        """Check ``buf`` and copy it into ``dst``; a ring part's device copy is started first
        and runs while the CPU checks the slot (a failed check still fails the load)."""
        region = _typed(buf, dtype, piece.src.shape)
        if copier is not None:
            work.pending.append(copier(dst, region))
        if check is not None:
            check(buf)
        if copier is None:
            dst.copy_(region)

    if len(starts) == 1:
        def compact(work: _FileWork, buf: memoryview) -> None:
            work.reads.append(ReadInto(offset + int(starts[0]), buf))
            work.after.append(lambda: place(work, buf))

        return run, compact
    span = int(starts[-1]) + run - int(starts[0])
    gaps = span - run * len(starts)
    if copier is None and gaps <= max_gap * (len(starts) - 1):
        def spanned(work: _FileWork, buf: memoryview) -> None:
            # one read of the whole span, then one strided copy out of it
            work.reads.append(ReadInto(offset + int(starts[0]), buf))

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
            work.reads.append(ReadInto(offset + s, buf[i * run : (i + 1) * run]))
        work.after.append(lambda: place(work, buf))

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
