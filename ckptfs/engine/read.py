"""The read engine: turn read pieces into byte reads, run them, and place the bytes.

A load's reads are scheduled first, without I/O (``schedule_reads``: a ``ReadSchedule`` saying
what is read, in which order, into which buffer), then run (``run_schedule``).

Bytes land directly in the target tensor when its region is contiguous CPU memory; otherwise
they land in scratch leased from the engine's buffer pool (engine/buffers.py) and are copied
once into the target. The pool bounds scratch held at once (``LoadOptions.scratch_bytes``): each
file's pieces are read in batches whose scratch fits the budget, so a load of any size needs
at most that much extra memory.

Regions of CUDA targets go through a ring of pinned buffers instead (engine/ring.py,
``LoadOptions.ring_bytes``): pieces are cut to fit a ring slot, read compact into it, and copied
to the device asynchronously, the copy started before the slot's check so that the two overlap
(a mismatch fails the load); a chunk cut into several pieces is still checked whole (the CRCs
of its pieces, combined). With ``LoadOptions.gds`` chunks may go straight to the device
(engine/gds.py). The CUDA paths run in tests/test_gpu.py on a GPU machine (docs/guide/gpu.md).

A batch's reads go to the store in waves of about ``LoadOptions.read_wave`` bytes that run
concurrently; each
wave's checksums and copies start as soon as its own reads are done, so they overlap the later
reads instead of following the last one (a chunk larger than a wave is read in parts whose
CRCs are combined).
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.engine.bases import with_bases
from ckptfs.engine.buffers import BufferPool, Lease
from ckptfs.engine.gds import DirectReads, gds_reader
from ckptfs.engine.options import LoadOptions
from ckptfs.engine.ring import Completion, Ring, cuda_ring
from ckptfs.engine.small_files import group_small
from ckptfs.errors import IntegrityError
from ckptfs.io.ranges import ReadInto
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all, settled
from ckptfs.layout.backend import Backend, ChunkSource, EncodedChunk, RawChunk
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
    """The reads of one wave and what runs after them (checks, copies into targets)."""

    reads: list[ReadInto]
    after: list[Callable[[], None]]
    pending: list[Completion]  #: copies started out of the batch's buffer (ring batches)


@dataclass(frozen=True, slots=True)
class Piece:
    """One planned read: ``scratch`` bytes of its batch's buffer (0: read straight into the
    target), and ``place``, which adds the reads and the work after them (checks, copies) to
    a wave, given a view of exactly ``scratch`` bytes."""

    scratch: int
    place: Callable[[_FileWork, memoryview], None]


@dataclass(frozen=True, slots=True)
class Batch:
    """Consecutive pieces of one file read into one buffer of ``scratch`` bytes (a lease from
    the scratch pool or a ring slot), placed in it one after the other."""

    scratch: int
    pieces: tuple[Piece, ...]


@dataclass(frozen=True, slots=True)
class FileReads:
    """The batches of one file, in file order."""

    path: str
    batches: tuple[Batch, ...]


@dataclass(frozen=True, slots=True)
class EncodedRead:
    """A chunk fetched whole and decoded (``EncodedChunk``) into region ``piece`` of a target."""

    job: TensorRead
    piece: ReadPiece
    source: EncodedChunk


@dataclass(frozen=True, slots=True)
class ReadSchedule:
    """What a load reads, in which order, into which buffer (``schedule_reads``: no I/O)."""

    needed: int  #: bytes the targets need
    scratch: tuple[FileReads, ...]  #: files read through the scratch pool, batches within budget
    #: groups of small files read straight into their targets, one store call per group
    small: tuple[tuple[FileReads, ...], ...]
    ring: tuple[FileReads, ...]  #: files read through the pinned ring, a batch per slot
    encoded: tuple[EncodedRead, ...]
    keys: Mapping[str, frozenset[str]]  #: file -> keys read from it (for errors)
    wave: int  #: bytes of reads per wave of a scratch batch


#: a file whose pieces all go straight into their targets and need at most this many bytes is
#: small; at least ``_SMALL_GROUP`` of them are read in groups of that many (``Store.read_files``,
#: engine/small_files.py): one read call per file costs far more than the reads themselves
_SMALL_FILE = 1 << 20
_SMALL_GROUP = 64
_NO_SCRATCH = memoryview(b"")
#: bytes of each part of a region read through the ring (at most a slot), and of its waves:
#: each part is read, checked and copied to the device on its own. Large parts are faster (each
#: device copy has a start-up cost: bench/gpu.py), so a slot of the default ring holds one part
RING_PIECE = 64 << 20


def _typed(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


async def read_tensors(store: Store, index: Index, jobs: Sequence[TensorRead],
                       options: LoadOptions) -> tuple[int, int]:
    """Fill the jobs' targets from the checkpoint ``index`` describes, with the index's backend
    and a scratch pool bounded by ``options.scratch_bytes`` (and, for CUDA targets, a pinned
    ring of ``options.ring_bytes``); returns (bytes the targets needed, peak scratch and ring
    bytes held at once)."""
    backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    pool = BufferPool(limit=options.scratch_bytes)
    verify = options.verify
    ring = cuda_ring((j.target for j in jobs), ring_bytes=options.ring_bytes,
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
    IntegrityError naming the file and the keys read from it. Chunks stored in a base
    checkpoint (references, engine/bases.py) are read from it by the same reads and checks.
    """
    bases = await with_bases(store, [job.pieces for job in jobs])
    if bases is not None:  # GPUDirect reads go to the checkpoint's own store: not used here
        store, pieces = bases
        direct = None
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


def schedule_reads(jobs: Sequence[TensorRead], sources: Sequence[ChunkSource], *, max_gap: int,
                   verify: bool, budget: int | None, ring: Ring | None = None,
                   direct: DirectReads | None = None,
                   wave: int = LoadOptions.read_wave) -> ReadSchedule:
    """The reads of ``jobs`` (``sources``: where each piece's chunk is, in the jobs' order):
    pieces into targets that ``ring`` accepts go through it (or to ``direct``, which takes the
    ones it can read in place), the other raw pieces through scratch in batches of at most
    ``budget`` bytes (None: one batch a file), many small files read straight into their
    targets in groups; ``max_gap``: bytes of gap read through rather than cut a read;
    ``wave``: bytes of reads whose checks and copies start together (a region read in place is
    cut into pieces of this size)."""
    scratch: dict[str, list[Piece]] = defaultdict(list)
    ringed_files: dict[str, list[Piece]] = defaultdict(list)
    encoded: list[EncodedRead] = []
    keys: dict[str, set[str]] = defaultdict(set)
    file_bytes: dict[str, int] = defaultdict(int)  # file -> bytes its pieces need
    needed = 0
    it = iter(sources)
    for job in jobs:
        dt = from_name(job.entry.dtype, job.entry.key)
        via = ring if ring is not None and ring.accepts(job.target) else None
        for piece in job.pieces:
            src = next(it)
            nbytes = piece.src.volume * dt.itemsize
            needed += nbytes
            if not isinstance(src, RawChunk):
                encoded.append(EncodedRead(job, piece, src))
                continue
            keys[src.file].add(job.entry.key)
            file_bytes[src.file] += nbytes
            if via is not None and direct is not None and direct.add(job, piece, src, dt.itemsize):
                continue
            if via is not None:
                ringed_files[src.file].extend(_plan_ring(job, piece, src, dt.torch, dt.itemsize,
                                                         verify, via))
                continue
            scratch[src.file].extend(_plan_raw(job, piece, src, dt.torch, dt.itemsize, max_gap,
                                               verify, wave=wave))
    groups, rest = group_small(list(scratch.items()), lambda f: file_bytes[f[0]] <= _SMALL_FILE
                               and all(p.scratch == 0 for p in f[1]), _SMALL_GROUP)
    slot = ring.slot_bytes if ring is not None else None
    return ReadSchedule(needed, tuple(FileReads(p, _batches(w, budget)) for p, w in rest),
                        tuple(tuple(FileReads(p, (Batch(0, tuple(w)),)) for p, w in g)
                              for g in groups),
                        tuple(FileReads(p, _batches(w, slot)) for p, w in ringed_files.items()),
                        tuple(encoded), {f: frozenset(k) for f, k in keys.items()}, wave)


async def run_schedule(store: Store, schedule: ReadSchedule, *, pool: BufferPool, verify: bool,
                       ring: Ring | None = None, direct: DirectReads | None = None) -> None:
    """Run every read of ``schedule`` concurrently (a failure cancels the rest): scratch from
    ``pool``, ring slots from ``ring``, and ``direct``'s reads beside them."""
    keys = schedule.keys
    await gather_all(*(_read_file(store, f, pool, keys[f.path], schedule.wave)
                       for f in schedule.scratch),
                     *(_read_small(store, group, keys) for group in schedule.small),
                     *((_read_ring_file(store, f, ring, keys[f.path]) for f in schedule.ring)
                       if ring is not None else ()),
                     *(_read_encoded(store, pool, e, verify) for e in schedule.encoded),
                     *((direct.run(store, _damaged, keys),) if direct is not None else ()))


async def _read_wave(store: Store, path: str, wave: _FileWork, keys: frozenset[str]) -> None:
    try:
        await store.read_into(path, wave.reads)
    except (FileNotFoundError, EOFError) as e:
        raise _read_failed(path, keys, e) from None


async def _read_stream(store: Store, path: str, waves: list[_FileWork],
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


def _waves(batch: Batch, buf: memoryview, wave: int, pending: list[Completion]) -> list[_FileWork]:
    """``batch``'s pieces placed one after the other in ``buf``, cut into waves of about
    ``wave`` bytes of reads."""
    waves = [_FileWork([], [], pending)]
    pos = size = 0
    for piece in batch.pieces:
        if size >= wave:
            waves.append(_FileWork([], [], pending))
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
    await gather_all(*(_read_stream(store, path, s, keys)
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
                           keys: frozenset[str]) -> None:
    pending: list[Completion] = []  # copies started out of the slot
    try:
        await _read_batch(store, path, batch, lease.view, RING_PIECE, pending, keys)
    finally:  # reused once the copies out of it complete
        await ring.release(lease, pending)


async def _read_ring_file(store: Store, f: FileReads, ring: Ring, keys: frozenset[str]) -> None:
    """The file's batches in file order, each in a slot of its own as soon as one is free:
    the reads into one slot overlap the checks and device copies out of the others."""
    started: list[asyncio.Future[None]] = []
    try:
        for batch in f.batches:
            if any(t.done() and not t.cancelled() and t.exception() for t in started):
                break  # a batch failed: lease no more (gather_all below raises it)
            started.append(asyncio.ensure_future(
                _read_ring_batch(store, f.path, batch, await ring.lease(batch.scratch), ring,
                                 keys)))
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
        work = _FileWork([], [], [])
        for batch in f.batches:
            for piece in batch.pieces:
                piece.place(work, _NO_SCRATCH)
        works.append((f.path, work))
    errors = await store.read_files([(path, w.reads) for path, w in works])
    for (path, _), e in zip(works, errors):
        if e is not None:  # returned, not raised here: no context to suppress
            raise _read_failed(path, keys[path], e)
    after = [fn for _, w in works for fn in w.after]
    if after:
        await _run_after(after)


async def _read_encoded(store: Store, pool: BufferPool, e: EncodedRead, verify: bool) -> None:
    cost = 2 * _nbytes(e.piece.chunk.shape, from_name(e.job.entry.dtype).itemsize)
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


def _batches(pieces: list[Piece], budget: int | None) -> tuple[Batch, ...]:
    """Consecutive pieces whose scratch fits the budget (a lone oversized piece is a batch)."""
    out: list[Batch] = []
    batch: list[Piece] = []
    cost = 0
    for p in pieces:
        if batch and budget is not None and cost + p.scratch > budget:
            out.append(Batch(cost, tuple(batch)))
            batch, cost = [], 0
        batch.append(p)
        cost += p.scratch
    if batch:
        out.append(Batch(cost, tuple(batch)))
    return tuple(out)


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
               itemsize: int, verify: bool, ring: Ring) -> list[Piece]:
    """``piece`` cut to fit ``ring``'s slots, each part read compact into a slot and copied out
    by ``ring.copier``; a chunk read whole is checked across its parts (their CRCs computed in
    any order, on any thread, and combined by the last), after its device copy was started."""
    parts = split_piece(piece, itemsize, min(ring.slot_bytes, RING_PIECE))
    checks: list[Any]  # checkers of memoryviews (the parts' compact bytes in their slots)
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
              copier: Callable[[torch.Tensor, torch.Tensor], Completion] | None = None, *,
              wave: int = LoadOptions.read_wave) -> list[Piece]:
    """The pieces reading ``piece``: one, or for a region read in place, one per ``wave``
    bytes of it. ``check``: the checker
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
        cuts = range(0, mv.nbytes, wave)
        checks = _combined_checkers(job.entry.key, chunk, src.file,
                                    [min(wave, mv.nbytes - o) for o in cuts],
                                    check is True and piece.whole_chunk)
        return [Piece(0, _direct(ReadInto(at + o, mv[o : o + wave]), c))
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
                 offset: int) -> Piece:
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

        return Piece(run, compact)
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

        return Piece(span, spanned)

    def runs(work: _FileWork, buf: memoryview) -> None:
        # far-apart runs: read each into its slot of a compact buffer
        for i, s in enumerate(starts.tolist()):
            work.reads.append(ReadInto(offset + s, buf[i * run : (i + 1) * run]))
        work.after.append(lambda: place(work, buf))

    return Piece(run * len(starts), runs)


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
