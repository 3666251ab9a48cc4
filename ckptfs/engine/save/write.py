"""Save, phase 2 of 3: write. The data files reach storage; nothing is committed yet.

The coordinator first makes the backend's layout files (``Backend.prepare``: a failure raises on
every rank before anything is written) and writes them beside its own data files, so no rank
waits for them (zarr: a document per array and group, each fsynced); every rank
lays out its staged chunks (``Backend.write_rank``) and writes the files through the store,
computing each chunk's crc32c and each file's (formats/README.md §6), and the checksums of the
replica slices a synchronous save left to this phase (stage.py), while the I/O threads write
(a local store's writer threads checksum each large chunk as they write it: checked_parts.py);
a file's CRC reuses its chunks' CRCs (``checksum.combine``) instead of reading them again. With
``throttle_uploads=K`` at most K ranks of a node write at once. A failure anywhere raises on
every rank (one small ``all_min`` when none failed); the outcomes (index entries, file sizes and
checksums, replica checksums) are gathered on the coordinator only, which alone needs them for
the index. A hook of the save (engine/save/hooks.py) may test each block of a chunk before its
crc32c (``block_tests``), search the chunks no test covers while the files are written
(``during_write``) and refuse what it found (``after_write``): a refusal anywhere removes the
files on every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ckptfs.dist import Comm, run_throttled
from ckptfs.engine.save.checked_parts import CheckedPart, address, checked_files
from ckptfs.engine.save.hash_memo import chunk_id
from ckptfs.engine.save.hooks import BlockTest, SaveHook, WriteOutcome, overrides
from ckptfs.engine.save.segments import SegmentPlan, write_segments
from ckptfs.engine.save.stage import StagedSave, replica_sums
from ckptfs.engine.small_files import group_small
from ckptfs.errors import ConfigError
from ckptfs.io import run_sync
from ckptfs.io.loop import submit
from ckptfs.io.parts import materialized
from ckptfs.io.progress import ByteProgress
from ckptfs.io.store import Store
from ckptfs.io.streamed import StreamedPart
from ckptfs.io.tasks import gather_all
from ckptfs.layout.backend import Backend, ChunkData, FileWrite, RankWriteJob
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import crc_of_parts, crcs_of, memo, render, rendered
from ckptfs.layout.index import ChunkEntry
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.segments import SegmentPart
from ckptfs.layout.tensor_bytes import tensor_bytes

#: a file of at most this many bytes is small; at least ``_SMALL_GROUP`` of them are written in
#: groups of at most that many, dealt over the store's request slots (``Store.put_files``;
#: engine/small_files.py): a local store writes a group in one worker thread
#: (zarr's 20,000 files of 10,000 small tensors: a thread hop and a task each cost about 270 us
#: of CPU a file, the writes themselves about 30 us)
_SMALL_FILE = 1 << 20
_SMALL_GROUP = 64


@dataclass(frozen=True, slots=True)
class WrittenRank:
    """What one rank wrote: its index entries (with checksums) and its data files."""

    entries: tuple[tuple[str, ChunkEntry], ...]  #: (key, entry)
    files: Mapping[str, int]  #: path -> bytes
    sums: Mapping[str, str] = field(default_factory=dict)  #: path -> crc32c of the whole file
    #: (key, slice, checksum) of plain-tensor slices the rank holds and another rank wrote
    replica_sums: tuple[tuple[str, Box, str], ...] = ()
    #: what each hook of the save refused in this rank's chunks (``SaveHook.after_write``)
    found: tuple[tuple[Any, ...], ...] = ()
    #: each hook's part of the index (``WriteOutcome.part``), for its ``before_commit``
    parts: tuple[Any, ...] = ()
    notes: tuple[Any, ...] = ()  #: each hook's note after the write (``WriteOutcome.note``)
    #: the index segments this rank wrote (a segmented save's owners: engine/save/segments.py)
    segments: tuple[SegmentPart, ...] = ()

    @property
    def refused(self) -> bool:
        """Whether a hook refused something this rank wrote."""
        return any(self.found)


@dataclass(frozen=True, slots=True)
class Written:
    """The write phase's outcome: the coordinator's layout files, this rank's files, and (on
    the coordinator) every rank's."""

    prepared: tuple[str, ...]  #: files ``Backend.prepare`` wrote (known to the coordinator)
    mine: WrittenRank  #: what this rank wrote
    ranks: tuple[WrittenRank, ...] | None  #: coordinator: every rank's, indexed by rank
    #: size and crc32c of each file ``Backend.prepare`` wrote (coordinator)
    prepared_sums: Mapping[str, tuple[int, str]] = field(default_factory=dict)

    def paths(self) -> set[str]:
        ranks = self.ranks if self.ranks is not None else (self.mine,)
        return set(self.prepared) | {p for r in ranks for p in r.files} | set(self.segments())

    def segments(self) -> list[str]:
        """The paths of the index segments written (every rank's on the coordinator)."""
        ranks = self.ranks if self.ranks is not None else (self.mine,)
        return [s.file.path for r in ranks for s in r.segments]


def write(staged: StagedSave, backend: Backend, store: Store, comm: Comm, save_id: str, *,
          progress: bool = False, throttle_uploads: int | None = None,
          hooks: Sequence[SaveHook] = (), segments: SegmentPlan | None = None) -> Written:
    """Write the layout files (coordinator), then every rank's data files (collective), with
    the write-phase calls of ``hooks`` (engine/save/hooks.py: block tests, the search while the
    files are written); a save a hook refuses removes what it wrote and raises the hook's
    ``refusal`` on every rank. With ``segments`` the index entries go to their owners, which
    write the index segments (engine/save/segments.py), and the coordinator gathers no entry."""
    prep: list[FileWrite] = []

    def prepare() -> None:  # on the coordinator: a failure here raises on every rank, never hangs
        with paused_gc():  # zarr: a metadata document per array (layout/nogc.py)
            prep.extend(backend.prepare(staged.plans))

    # one collective: the layout prepared (coordinator), every rank's upload limit shared
    _, limits = comm.run_everywhere(
        "save: preparing the layout", lambda: prepare() if comm.is_coordinator else None,
        lambda _: throttle_uploads, to="all")
    limit = min((k for k in limits if k is not None), default=None)
    what = "save: writing data"
    err: BaseException | None = None
    mine: WrittenRank | None = None
    try:
        mine = run_throttled(limit, comm, lambda: write_rank(
            staged, backend, store, save_id, progress and comm.is_coordinator, hooks, prep),
            agreed=True)
    except Exception as e:
        err = e
    clean = not (mine and mine.refused)
    if segments is not None:  # settled first: the rows go to the owners, not to the coordinator
        if not comm.settle(what, err, all_true={"finite": clean})["finite"]:
            assert mine is not None
            refuse(mine, [f.path for f in prep], store, comm, hooks)
        assert mine is not None
        parts = write_segments(segments, mine.entries, mine.replica_sums, comm, store, save_id,
                               staged.plans, backend.implied_extra, sorted(mine.files))
        mine = dataclasses.replace(mine, entries=(), replica_sums=(), segments=parts)
        err = None
    # the hooks' notes stay on the rank (the coordinator's own serve its ``before_commit``)
    sent = None if mine is None else dataclasses.replace(mine, notes=()) if mine.notes else mine
    said, ranks = comm.settle_gather(what, err, sent, all_true={"finite": clean}, entries=True)
    assert mine is not None  # settled: every rank wrote (sent its outcome)
    if not said["finite"]:
        refuse(mine, [f.path for f in prep], store, comm, hooks)
    return Written(tuple(f.path for f in prep), mine,
                   None if ranks is None else tuple(r for r in ranks if r is not None),
                   file_sums(prep))


def refuse(mine: WrittenRank, prepared: Sequence[str], store: Store, comm: Comm,
           hooks: Sequence[SaveHook]) -> NoReturn:
    """Collective, once a hook refused what a rank wrote (NaN or infinity): every rank removes
    the files it wrote (the coordinator the layout files too; best effort: nothing was
    committed), then raises the same error, the first refusing hook's ``refusal``."""
    found = comm.all_gather(mine.found, "save: gathering NaN and infinity counts")
    paths = sorted({*mine.files, *prepared})

    def remove() -> None:
        with contextlib.suppress(Exception):
            run_sync(store.delete(paths))

    comm.run_everywhere("save: removing the files of a save holding NaN or infinity", remove)
    i = next(i for i in range(len(hooks)) if any(rank[i] for rank in found))
    raise hooks[i].refusal([rank[i] for rank in found])


def file_sums(files: Sequence[FileWrite],
              known: dict[tuple[int, int], int] | None = None) -> dict[str, tuple[int, str]]:
    """Size and crc32c of each file (``known``: CRCs of buffers already summed, by address)."""
    return {f.path: (f.nbytes, render(crc_of_parts(f.parts, known))) for f in files}


@paused_gc()  # many small acyclic objects (layout/nogc.py)
def write_rank(staged: StagedSave, backend: Backend, store: Store, save_id: str,
               progress: bool, hooks: Sequence[SaveHook] = (),
               layout: Sequence[FileWrite] = ()) -> WrittenRank:
    """This rank's files, and on the coordinator the backend's ``layout`` files beside them;
    checksums are computed here while the I/O threads write, or, for a
    store that writes streamed parts in place, by its writer threads slice by slice as they
    write each chunk (engine/save/checked_parts.py), with the block tests of ``hooks`` (the search
    for NaN and infinity); the chunks no block test runs on go to the hooks' ``during_write``
    meanwhile."""
    notes = staged.notes or (None,) * len(hooks)
    refs = {**staged.references, **_references(staged.chunks, hooks, notes)}
    chunks = tuple(c for c in staged.chunks if chunk_id(c) not in refs) if refs \
        else staged.chunks
    keys = {c.key for c in chunks}
    job = RankWriteJob(staged.rank, staged.world_size, save_id, chunks, _Some(staged.plans, keys))
    rw = backend.write_rank(job)
    views = [(c, tensor_bytes(c.data)) for c in chunks if c.source is None]
    files = rw.files
    checked: dict[tuple[int, int], CheckedPart] = {}
    if store.streams_in_place:  # not a store that would copy the views (remote uploads)
        tests = {address(data): test for (_, data), test
                 in zip(views, _block_tests(hooks, notes, [c for c, _ in views]), strict=True)
                 if test is not None}
        files, checked = checked_files(rw.files, (data for _, data in views), tests)
    writing = submit(_beside(write_files(store, layout, False), write_files(store, files, progress)))
    # each view's part checksummed as it is written (None: checksummed here)
    parts = [checked.get(address(data)) if checked else None for _, data in views]
    try:  # streamed chunks (engine/memory/device_parts.py) are checksummed as they are written
        fresh = [(c, data) for (c, data), part in zip(views, parts, strict=True) if part is None]
        crcs = [(c, data, crc) for (c, data), crc
                in zip(fresh, crcs_of([data for _, data in fresh], yielding=True), strict=True)]
        replicas = staged.replica_sums + replica_sums(staged.replicas, yielding=True)
        if hooks:
            untested = [c for (c, _), part in zip(views, parts, strict=True)
                        if part is None or not part.tested]
            notes = tuple(h.during_write(untested, n) for h, n in zip(hooks, notes, strict=True))
    finally:
        try:
            writing.result()
        finally:  # the parts' checksum threads end before their bytes may go
            for part in checked.values():
                part.finish()
    crcs += [(c, data, _streamed_crc(part))
             for (c, data), part in zip(views, parts, strict=True) if part is not None]
    suspect = [c for (c, _), part in zip(views, parts, strict=True) if part and part.suspect]
    outcomes = [h.after_write(suspect, n) for h, n in zip(hooks, notes, strict=True)]
    streamed = [c for c in chunks if c.source is not None]
    whole = file_sums(files, memo((data, crc) for _, data, crc in crcs))
    entries = _rank_entries(rw.chunks, crcs, streamed, refs, hooks, outcomes)
    return WrittenRank(entries, {p: n for p, (n, _) in whole.items()},
                       {p: crc for p, (_, crc) in whole.items()}, replicas,
                       *_outcomes(outcomes))


def _rank_entries(written: Sequence[tuple[str, ChunkEntry]], crcs: Sequence[tuple[Any, Any, int]],
                  streamed: Sequence[ChunkData], refs: Mapping[Any, ChunkEntry],
                  hooks: Sequence[SaveHook], outcomes: Sequence[WriteOutcome]
                  ) -> tuple[tuple[str, ChunkEntry], ...]:
    """This rank's index entries: the backend's, each whole planned chunk with its checksum
    (the streamed chunks' after the others: the same corner, theirs wins), the references,
    as the hooks' ``rank_entries`` make them."""
    sums = dict(zip([(c.key, c.box.offsets, c.box.shape) for c, _, _ in crcs]
                    + [(c.key, c.box.offsets, c.box.shape) for c in streamed],
                    rendered([crc for _, _, crc in crcs]
                             + [_streamed_crc(c.source) for c in streamed]), strict=True))
    # only an entry that is a whole planned chunk gets its checksum: a sub-chunk entry sharing
    # the chunk's corner must not get the whole chunk's (the backend sets its own)
    entries = tuple((key, _with_checksum(e, sums.get((key, e.offsets, e.shape))))
                    for key, e in written) + tuple((k[0], e) for k, e in refs.items())
    for h, o in zip(hooks, outcomes, strict=True):
        if overrides(h, "rank_entries"):
            entries = tuple(h.rank_entries(entries, o.note))
    return entries


def _outcomes(outcomes: Sequence[WriteOutcome]
              ) -> tuple[tuple[tuple[Any, ...], ...], tuple[Any, ...], tuple[Any, ...]]:
    """(found, parts, notes) of the hooks' ``after_write`` outcomes, by hook."""
    return (tuple(o.found for o in outcomes), tuple(o.part for o in outcomes),
            tuple(o.note for o in outcomes))


def _block_tests(hooks: Sequence[SaveHook], notes: Sequence[Any], chunks: Sequence[ChunkData]
                 ) -> list[BlockTest | None]:
    """Each chunk's block test: the hooks' tests of it as one (None: no hook tests it)."""
    per_hook = [h.block_tests(chunks, n) for h, n in zip(hooks, notes, strict=True)
                if overrides(h, "block_tests")]
    if not per_hook:
        return [None] * len(chunks)
    if len(per_hook) == 1:
        return list(per_hook[0])
    return [_any_of([t for t in ts if t is not None]) for ts in zip(*per_hook, strict=True)]


def _any_of(tests: list[BlockTest]) -> BlockTest | None:
    if len(tests) < 2:
        return tests[0] if tests else None
    return lambda block: any(t(block) for t in tests)


def _references(chunks: Sequence[ChunkData], hooks: Sequence[SaveHook], notes: Sequence[Any]
                ) -> dict[tuple[str, tuple[int, ...], tuple[int, ...]], ChunkEntry]:
    """The chunks the hooks record as references to a base checkpoint instead of writing them
    (``SaveHook.chunk_reference``; formats/README.md §2.5), by (key, offsets, shape): the first
    hook that names one wins. A reference must be a whole chunk of the same box, naming its
    base, file, byte range, CRC-32C and content hash."""
    out: dict[tuple[str, tuple[int, ...], tuple[int, ...]], ChunkEntry] = {}
    for h, n in zip(hooks, notes, strict=True):
        if not overrides(h, "chunk_reference"):
            continue
        for c in chunks:
            e = h.chunk_reference(c, n) if chunk_id(c) not in out else None
            if e is not None:
                out[chunk_id(c)] = checked_reference(h, c, e)
    return out


def checked_reference(hook: SaveHook, c: ChunkData, e: Any) -> ChunkEntry:
    """``e``, the reference ``hook`` records for chunk ``c``; ConfigError naming the key and the
    chunk unless it is a whole chunk of ``c``'s box naming its base, file, byte range, CRC-32C
    and content hash."""
    if (not isinstance(e, ChunkEntry) or e.base is None or e.file is None
            or e.checksum is None or e.hash is None or e.byte_offset is None
            or (e.offsets, e.shape) != (c.box.offsets, c.box.shape)):
        raise ConfigError(f"key {c.key!r}: {type(hook).__name__} records chunk "
                          f"{c.box.offsets} as a reference that is not a whole chunk "
                          f"naming its base, file, byte range, checksum and hash: {e!r}")
    return e


async def _beside(*writes: Awaitable[None]) -> None:
    """Several ``write_files`` at once, sharing the store's request slots."""
    await gather_all(*writes)


def _streamed_crc(part: StreamedPart | None) -> int:
    """The crc32c a streamed part computed while it was written."""
    if part is None or part.crc is None:
        raise RuntimeError("a streamed part's checksum is asked for before it was written")
    return part.crc


class _Some(Mapping[str, TensorPlan]):
    """The plans of ``keys`` (the keys a rank writes), built only if the backend asks."""

    def __init__(self, plans: Mapping[str, TensorPlan], keys: set[str]) -> None:
        self._plans, self._keys = plans, keys

    def __getitem__(self, key: str) -> TensorPlan:
        if key not in self._keys:
            raise KeyError(key)
        return self._plans[key]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._keys))

    def __len__(self) -> int:
        return len(self._keys)


def _with_checksum(e: ChunkEntry, value: str | None) -> ChunkEntry:
    """``e`` with the engine's checksum, unless the backend set one (sub-chunk entries)."""
    return e if e.checksum is not None or value is None else e.but(value, e.extra)


def _small(f: FileWrite) -> bool:
    """A file written in a group: small and all in host memory."""
    return f.nbytes <= _SMALL_FILE and not any(isinstance(p, StreamedPart) for p in f.parts)


async def write_files(store: Store, files: Sequence[FileWrite], progress: bool) -> None:
    """Write ``files`` concurrently; a failure cancels the other uploads."""
    bar = None
    if progress and files:
        bar = ByteProgress(sum(f.nbytes for f in files), f"ckptfs save {store.url}")

    async def one(f: FileWrite) -> None:
        parts = f.parts
        if not store.streams_parts and any(isinstance(p, StreamedPart) for p in parts):
            parts = await asyncio.to_thread(materialized, parts)  # host bytes, one file at once
        await store.put(f.path, parts)
        if bar is not None:
            bar.update(f.nbytes)

    async def group(fs: Sequence[FileWrite]) -> None:
        await store.put_files([(f.path, f.parts) for f in fs])
        if bar is not None:
            bar.update(sum(f.nbytes for f in fs))

    # the groups dealt over the store's request slots: each worker's fsyncs wait in turn
    groups, single = group_small(files, _small, _SMALL_GROUP, spread=store.options.max_concurrency)
    # smallest first (the slots are taken in this order): a small file's fsync then commits
    # before the large files' write-back is under way, instead of waiting for it
    single = sorted(single, key=lambda f: f.nbytes)
    try:
        await gather_all(*(group(g) for g in groups), *(one(f) for f in single))
    finally:
        if bar is not None:
            bar.close()
