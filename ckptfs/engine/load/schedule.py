"""The read schedule: turn read pieces into byte reads and say where the bytes go, without I/O.

A load's reads are scheduled first (``schedule_reads``: a ``ReadSchedule`` saying what is read,
in which order, into which buffer, and what runs on the bytes once read), then run
(load/run.py: ``run_schedule``).

Bytes land directly in the target tensor when its region is contiguous CPU memory; otherwise
they land in scratch leased from the engine's buffer pool (engine/memory/buffers.py) and are copied
once into the target. The pool bounds scratch held at once (``LoadOptions.scratch_bytes``): each
file's pieces are read in batches whose scratch fits the budget, so a load of any size needs
at most that much extra memory.

Regions of CUDA targets go through a ring of pinned buffers instead (engine/memory/ring.py,
``LoadOptions.ring_bytes``): pieces are cut to fit a ring slot, read compact into it, and copied
to the device asynchronously, the copy started before the slot's check so that the two overlap
(a mismatch fails the load); a chunk cut into several pieces is still checked whole (the CRCs
of its pieces, combined). With ``LoadOptions.gds`` chunks may go straight to the device
(engine/load/gds.py). The CUDA paths run in tests/test_gpu.py on a GPU machine (docs/guide/gpu.md).

A batch's reads go to the store in waves of about ``LoadOptions.read_wave`` bytes that run
concurrently; each
wave's checksums and copies start as soon as its own reads are done, so they overlap the later
reads instead of following the last one (a chunk larger than a wave is read in parts whose
CRCs are combined).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.engine.load.gds import DirectReads
from ckptfs.engine.memory.ring import Completion, Ring
from ckptfs.engine.options import LoadOptions
from ckptfs.engine.small_files import group_small
from ckptfs.errors import IntegrityError
from ckptfs.io.ranges import ReadInto
from ckptfs.layout.backend import ChunkSource, EncodedChunk, RawChunk
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum, combine, crc_of, render
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.geometry import c_order_cuts, c_strides, region_runs
from ckptfs.layout.index import ChunkEntry, TensorEntry
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.planning.load_plan import ReadPiece


@dataclass(frozen=True, slots=True)
class TensorRead:
    """Fill ``target`` (one rank's local tensor) from ``pieces`` of ``entry``."""

    entry: TensorEntry
    target: torch.Tensor
    pieces: tuple[ReadPiece, ...]


@dataclass
class FileWork:
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
    place: Callable[[FileWork, memoryview], None]


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
    ring_wave: int  #: bytes of reads per wave of a ring slot (RING_PIECE)


#: a file whose pieces all go straight into their targets and need at most this many bytes is
#: small; at least ``_SMALL_GROUP`` of them are read in groups of that many (``Store.read_files``,
#: engine/small_files.py): one read call per file costs far more than the reads themselves
_SMALL_FILE = 1 << 20
_SMALL_GROUP = 64
NO_SCRATCH = memoryview(b"")
#: bytes of each part of a region read through the ring (at most a slot), and of its waves:
#: each part is read, checked and copied to the device on its own. Large parts are faster (each
#: device copy has a start-up cost: bench/gpu.py), so a slot of the default ring holds one part
RING_PIECE = 64 << 20


def typed(buf: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape)


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
    # the test decided here, the grouping asked with a set's lookup: no call back into here
    small = {f for f, w in scratch.items()
             if file_bytes[f] <= _SMALL_FILE and all(p.scratch == 0 for p in w)}
    groups, rest = group_small(list(scratch), small.__contains__, _SMALL_GROUP)
    slot = ring.slot_bytes if ring is not None else None
    return ReadSchedule(needed, tuple(FileReads(p, _batches(scratch[p], budget)) for p in rest),
                        tuple(tuple(FileReads(p, (Batch(0, tuple(scratch[p])),)) for p in g)
                              for g in groups),
                        tuple(FileReads(p, _batches(w, slot)) for p, w in ringed_files.items()),
                        tuple(encoded), {f: frozenset(k) for f, k in keys.items()}, wave,
                        RING_PIECE)


def nbytes_of(shape: tuple[int, ...], itemsize: int) -> int:
    for n in shape:
        itemsize *= n
    return itemsize


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


def checker(key: str, chunk: ChunkEntry, file: str, verify: bool,
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
    e = IntegrityError(f"key {key!r}: chunk at {list(chunk.offsets)} in {file} fails its "
                       f"checksum (index says {chunk.checksum}, data gives {got})")
    e.mismatch = True  # type: ignore[attr-defined]  # read_tensors reads it once more
    return e


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
        checks = [checker(job.entry.key, piece.chunk, src.file, verify, piece.whole_chunk)]
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
        dst, starts, run = job.target, (0,), nbytes_of(chunk.shape, itemsize)
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
        check = checker(job.entry.key, chunk, src.file, True, piece.whole_chunk)
    return [_plan_copied(job, piece, dtype, itemsize, max_gap, check or None, copier, layout, dst,
                         starts, run, src.offset)]


def _direct(read: ReadInto, check: Callable[[memoryview], None] | None,
            ) -> Callable[[FileWork, memoryview], None]:
    def direct(work: FileWork, _: memoryview) -> None:
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

    def place(work: FileWork, buf: memoryview) -> None:
        """Check ``buf`` and copy it into ``dst``; a ring part's device copy is started first
        and runs while the CPU checks the slot (a failed check still fails the load)."""
        region = typed(buf, dtype, piece.src.shape)
        if copier is not None:
            work.pending.append(copier(dst, region))
        if check is not None:
            check(buf)
        if copier is None:
            dst.copy_(region)

    if len(starts) == 1:
        def compact(work: FileWork, buf: memoryview) -> None:
            work.reads.append(ReadInto(offset + int(starts[0]), buf))
            work.after.append(lambda: place(work, buf))

        return Piece(run, compact)
    span = int(starts[-1]) + run - int(starts[0])
    gaps = span - run * len(starts)
    if copier is None and gaps <= max_gap * (len(starts) - 1):
        def spanned(work: FileWork, buf: memoryview) -> None:
            # one read of the whole span, then one strided copy out of it
            work.reads.append(ReadInto(offset + int(starts[0]), buf))

            def place() -> None:
                flat = typed(buf, dtype, (span // itemsize,))
                region = flat.as_strided(piece.src.shape, c_strides(layout))
                if check is not None:  # a padded chunk read whole: check its compact bytes
                    region = region.contiguous()
                    check(region)
                dst.copy_(region)

            work.after.append(place)

        return Piece(span, spanned)

    def runs(work: FileWork, buf: memoryview) -> None:
        # far-apart runs: read each into its slot of a compact buffer
        for i, s in enumerate(starts.tolist()):
            work.reads.append(ReadInto(offset + s, buf[i * run : (i + 1) * run]))
        work.after.append(lambda: place(work, buf))

    return Piece(run * len(starts), runs)


