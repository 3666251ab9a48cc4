"""Running a read schedule (load/schedule.py): the I/O of a load.

``read_tensors`` (what a load calls) and ``execute_reads`` fetch where each piece's chunk is,
schedule the reads (``schedule_reads``, no I/O) and run the schedule (``run_schedule``): every
file's batches concurrently, each batch's reads in waves whose checks and copies start as soon
as their own reads are done. A missing or short data file is an IntegrityError naming the file
and the keys read from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence

from ckptfs.engine.load.bases import with_bases
from ckptfs.engine.load.gds import DirectReads, gds_reader
from ckptfs.engine.load.schedule import (
    NO_SCRATCH,
    Batch,
    EncodedRead,
    FileReads,
    FileWork,
    ReadSchedule,
    TensorRead,
    checker,
    nbytes_of,
    schedule_reads,
    typed,
)
from ckptfs.engine.memory.buffers import BufferPool, Lease
from ckptfs.engine.memory.ring import Completion, Ring, cuda_ring
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import IntegrityError
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all, settled
from ckptfs.layout.backend import Backend, EncodedChunk
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import Index
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import ReadPiece


async def read_tensors(store: Store, index: Index, jobs: Sequence[TensorRead],
                       options: LoadOptions) -> tuple[int, int]:
    """Fill the jobs' targets from the checkpoint ``index`` describes, with the index's backend
    and a scratch pool bounded by ``options.scratch_bytes`` (and, for CUDA targets, a pinned
    ring of ``options.ring_bytes``); returns (bytes the targets needed, peak scratch and ring
    bytes held at once)."""
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    pool = BufferPool(limit=options.scratch_bytes)
    verify = options.verify
    ring = cuda_ring([j.target for j in jobs], ring_bytes=options.ring_bytes,
                     slots=options.ring_slots)
    direct = gds_reader(store, verify) if ring is not None and options.gds else None
    try:
        with paused_gc():  # a piece of planning per small tensor (layout/nogc.py)
            needed = await execute_reads(store, backend, jobs, pool=pool, verify=verify,
                                         ring=ring, direct=direct, wave=options.read_wave)
    except BaseException:
        if ring is not None:
            await ring.close(quiet=True)  # the first error is the one to raise
        raise
    if ring is not None:
        await ring.close()
    return needed, pool.peak + (ring.pool.peak if ring is not None else 0)


async def execute_reads(store: Store, backend: Backend, jobs: Sequence[TensorRead], *,
                        pool: BufferPool, verify: bool = True, ring: Ring | None = None,
                        direct: DirectReads | None = None,
                        wave: int = LoadOptions.read_wave) -> int:
    """Run every read; returns the number of bytes the targets needed.

    Reads into contiguous CPU targets need no scratch; the others lease it from ``pool``, or
    from ``ring`` for the targets it accepts (``direct`` may read some of those in place).
    ``verify`` checks the crc32c of every chunk read whole. A missing or short data file is an
    IntegrityError naming the file and the keys read from it. A chunk whose bytes fail their
    checksum is read once more, with every other read (they only fill the targets; not through
    ``ring`` or ``direct``): bytes damaged on the way must not fail a read of a sound checkpoint;
    failing again, the IntegrityError names the store's URL, key, chunk and file.
    """
    rereads = 1 if ring is None and direct is None else 0
    while True:
        try:
            return await _execute_once(store, backend, jobs, pool=pool, verify=verify, ring=ring,
                                       direct=direct, wave=wave)
        except IntegrityError as e:
            if not getattr(e, "mismatch", False):
                raise
            if not rereads:
                raise IntegrityError(f"{store.url}: {e}") from e
            rereads -= 1
            store.stats.retries += 1


async def _execute_once(store: Store, backend: Backend, jobs: Sequence[TensorRead], *,
                        pool: BufferPool, verify: bool, ring: Ring | None,
                        direct: DirectReads | None, wave: int) -> int:
    """One run of every read. Chunks stored in a base checkpoint (references,
    engine/load/bases.py) are read from it by the same reads and checks."""
    bases = await with_bases(store, [job.pieces for job in jobs])
    if bases is not None:
        store, pieces = bases
        # GPUDirect reads find a reference's file through the bases' routes (a local base's)
        direct = direct.through(store) if direct is not None else None
        jobs = [TensorRead(job.entry, job.target, tuple(ps))
                for job, ps in zip(jobs, pieces, strict=True)]
    try:
        sources = await backend.chunk_sources(
            [(job.entry, p.chunk) for job in jobs for p in job.pieces], store)
        schedule = schedule_reads(jobs, sources, max_gap=store.options.max_gap, verify=verify,
                                  budget=pool.budget.limit, ring=ring, direct=direct, wave=wave)
        await run_schedule(store, schedule, pool=pool, verify=verify, ring=ring, direct=direct)
    finally:
        if bases is not None:
            await store.close()  # the base stores it opened
    return schedule.needed


async def run_schedule(store: Store, schedule: ReadSchedule, *, pool: BufferPool, verify: bool,
                       ring: Ring | None = None, direct: DirectReads | None = None) -> None:
    """Run every read of ``schedule`` concurrently (a failure cancels the rest): scratch from
    ``pool``, ring slots from ``ring``, and ``direct``'s reads beside them."""
    keys = schedule.keys
    await _together(*(_read_file(store, f, pool, keys[f.path], schedule.wave)
                       for f in schedule.scratch),
                     *(_read_small(store, group, keys) for group in schedule.small),
                     *((_read_ring_file(store, f, ring, keys[f.path], schedule.ring_wave)
                        for f in schedule.ring)
                       if ring is not None else ()),
                     *(_read_encoded(store, pool, e, verify) for e in schedule.encoded),
                     *((direct.run(store, _damaged, keys),) if direct is not None else ()))


async def _together(*aws: Awaitable[None]) -> None:
    """Await ``aws`` concurrently (``gather_all``); a lone one is awaited in place, without a
    task of its own (a small load's one file, a batch's one stream)."""
    if len(aws) == 1:
        await aws[0]
    else:
        await gather_all(*aws)


async def _read_wave(store: Store, path: str, wave: FileWork, keys: frozenset[str]) -> None:
    try:
        await store.read_into(path, wave.reads)
    except (FileNotFoundError, EOFError) as e:
        raise _read_failed(path, keys, e) from None


async def _read_stream(store: Store, path: str, waves: list[FileWork],
                       keys: frozenset[str]) -> None:
    """Read ``waves`` one after the other; each wave's checks and copies run while the next
    waves are read."""
    afters: list[asyncio.Future[None]] = []
    try:
        for wave in waves:
            await _read_wave(store, path, wave, keys)
            if wave.after:
                afters.append(asyncio.ensure_future(_run_after(wave.after)))
    except BaseException:
        for a in afters:
            a.cancel()
        if afters:
            await asyncio.wait(afters)  # nothing copies out of the lease once it is back
        raise
    await gather_all(*afters)


def _waves(batch: Batch, buf: memoryview, wave: int, pending: list[Completion]) -> list[FileWork]:
    """``batch``'s pieces placed one after the other in ``buf``, cut into waves of about
    ``wave`` bytes of reads."""
    waves = [FileWork([], [], pending)]
    pos = size = 0
    for piece in batch.pieces:
        if size >= wave:
            waves.append(FileWork([], [], pending))
            size = 0
        n = len(waves[-1].reads)
        piece.place(waves[-1], buf[pos : pos + piece.scratch])
        size += sum(r.dest.nbytes for r in waves[-1].reads[n:])
        pos += piece.scratch
    return waves


async def _read_batch(store: Store, path: str, batch: Batch, buf: memoryview, wave: int,
                      pending: list[Completion], keys: frozenset[str]) -> None:
    """``batch`` read into ``buf`` as the store's read streams, checked and placed."""
    waves = _waves(batch, buf, wave, pending)
    await _together(*(_read_stream(store, path, s, keys)
                      for s in _streams(waves, store.read_streams(path))))


async def _read_file(store: Store, f: FileReads, pool: BufferPool, keys: frozenset[str],
                     wave: int) -> None:
    """``f``'s batches one after the other, each in scratch leased from ``pool``."""
    for batch in f.batches:
        lease = await pool.lease(batch.scratch)
        try:
            await _read_batch(store, f.path, batch, lease.view, wave, [], keys)
        finally:
            await pool.release(lease)


async def _read_ring_batch(store: Store, path: str, batch: Batch, lease: Lease, ring: Ring,
                           keys: frozenset[str], wave: int) -> None:
    pending: list[Completion] = []  # copies started out of the slot
    try:
        await _read_batch(store, path, batch, lease.view, wave, pending, keys)
    finally:  # reused once the copies out of it complete
        await ring.release(lease, pending)


async def _read_ring_file(store: Store, f: FileReads, ring: Ring, keys: frozenset[str],
                          wave: int) -> None:
    """The file's batches in file order, each in a slot of its own as soon as one is free:
    the reads into one slot overlap the checks and device copies out of the others."""
    started: list[asyncio.Future[None]] = []
    try:
        for batch in f.batches:
            if any(t.done() and not t.cancelled() and t.exception() for t in started):
                break  # a batch failed: lease no more (gather_all below raises it)
            started.append(asyncio.ensure_future(
                _read_ring_batch(store, f.path, batch, await ring.lease(batch.scratch), ring,
                                 keys, wave)))
    except BaseException:
        for t in started:
            t.cancel()
        if started:
            await asyncio.wait(started)
        raise
    await gather_all(*started)


async def _read_small(store: Store, files: tuple[FileReads, ...],
                      keys: Mapping[str, frozenset[str]]) -> None:
    """Small files read straight into their targets (no scratch), as one group: one store
    call (a local store reads them in one worker thread) and one run of their checks."""
    works = []
    for f in files:
        work = FileWork([], [], [])
        for batch in f.batches:
            for piece in batch.pieces:
                piece.place(work, NO_SCRATCH)
        works.append((f.path, work))
    errors = await store.read_files([(path, w.reads) for path, w in works])
    for (path, _), e in zip(works, errors):
        if e is not None:  # returned, not raised here: no context to suppress
            raise _read_failed(path, keys[path], e)
    after = [fn for _, w in works for fn in w.after]
    if after:
        await _run_after(after)


async def _read_encoded(store: Store, pool: BufferPool, e: EncodedRead, verify: bool) -> None:
    cost = 2 * nbytes_of(e.piece.chunk.shape, from_name(e.job.entry.dtype).itemsize)
    async with pool.budget.hold(cost):  # the fetched bytes and the decoded ones
        await _run_encoded(store, e.job, e.piece, e.source, verify)


def _damaged(file: str, keys: Collection[str], what: str) -> IntegrityError:
    """A data file the index lists is gone or short: the checkpoint is damaged."""
    return IntegrityError(f"key(s) {', '.join(map(repr, sorted(keys)))}: {file}: {what}")


def _read_failed(file: str, keys: Collection[str], e: BaseException) -> BaseException:
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


def _streams(waves: list[FileWork], streams: int | None) -> list[list[FileWork]]:
    """``waves`` (in file order) as ``streams`` runs of consecutive waves, each read in order;
    one wave per run when the store has no preference."""
    if streams is None or len(waves) <= streams:
        return [[w] for w in waves]
    waves = sorted(waves, key=lambda w: min((r.start for r in w.reads), default=0))
    n = len(waves)
    return [waves[i * n // streams : (i + 1) * n // streams] for i in range(streams)]


async def _run_encoded(store: Store, job: TensorRead, piece: ReadPiece, src: EncodedChunk,
                       verify: bool) -> None:
    try:
        if src.start is None or src.end is None:
            data = await store.get(src.file)
        else:
            data = await store.get_range(src.file, src.start, src.end)
    except FileNotFoundError as e:
        raise _damaged(src.file, [job.entry.key], f"the data file is missing ({e})") from None
    chunk = piece.chunk
    dt = from_name(job.entry.dtype, job.entry.key)
    check = checker(job.entry.key, chunk, src.file, verify, True)

    def place() -> None:
        raw = src.decode(data)
        want = nbytes_of(chunk.shape, dt.itemsize)
        if memoryview(raw).nbytes != want:
            raise IntegrityError(
                f"key {job.entry.key!r}: chunk at {list(chunk.offsets)} in {src.file} decodes "
                f"to {memoryview(raw).nbytes} bytes, expected {want}"
            )
        buf = memoryview(raw if isinstance(raw, bytearray) else bytearray(raw))
        if check is not None:
            check(buf)
        full = typed(buf, dt.torch, chunk.shape)
        job.target[piece.dst.slices()].copy_(full[piece.src.slices()])

    await asyncio.to_thread(place)
