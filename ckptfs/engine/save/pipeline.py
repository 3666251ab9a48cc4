"""The save pipeline: one composition of a save's phases that every composer runs.

A save is a ``SaveRequest`` (where and how: the URL, the backend, the options, the hooks) and a
state dict (what: it never leaves the caller's process). Its named phases, in order, each
followed by the hooks' ``phase_done`` (engine/save/hooks.py gives every hook point and its order):

1. **stage** (``stage_phase``; engine/save/stage.py): describe, agree on a plan, take this rank's
   chunk bytes; the hooks' ``before_stage`` and ``after_stage`` around it.
2. **claim** (``finish_staged``; engine/save/commit.py): open the store on every rank and, in the
   same collective step and trip to the I/O loop, take the save lock and check the target on the
   coordinator (``open_claimed``), remove a killed save's files (``clear_dead``), the hooks'
   ``before_write`` (early where a checkpoint is replaced or the store cannot test bytes while
   writing), then un-commit a replaced index.
3. **write** (engine/save/write.py): the layout files, then every rank's data files, with the hooks'
   block tests and ``during_write`` / ``after_write``; through a node-local folder first and
   copied to the URL where ``local_root`` says so.
   A segmented index (engine/save/segments.py) adds its exchange step at the end: the ranks
   send their index entries to the segments' owners, which write the segments.
4. **commit** (engine/save/commit.py): the coordinator builds the index (a segmented one's
   root from the owners' reports), the hooks' ``before_commit``, final files, the index
   create-if-absent.

``run_save`` runs them all in the caller's thread (``ckptfs.save``); an asynchronous save stages
in the caller's process (engine/background/saver.py) and runs ``finish_staged`` (phases 2 to 4), the
writer process's named entry point, in a thread or in the writer process
(engine/background/writer_process.py): both share this code as DCP's ``save`` and ``async_save`` share
``_save_state_dict``. Composers whose ranks write apart from a ckptfs plan (the DCP plug-in,
``convert``) run the write and commit phases through ``write_chunks`` and ``commit_written``.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from ckptfs.dist import Comm, CommStats, ProcessGroup
from ckptfs.engine.errors import public_errors
from ckptfs.engine.memory.buffers import BufferPool, HostAllocator
from ckptfs.engine.memory.device_parts import DeviceParts, cuda_device_parts
from ckptfs.engine.memory.overflow import bounded
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.commit import (
    Claim,
    abandon_claim,
    build_index,
    commit,
    commit_index,
    holding,
    take_claim,
    uncommit,
)
from ckptfs.engine.save.hash_memo import chunk_id
from ckptfs.engine.save.hooks import SaveHook, overrides, phase
from ckptfs.engine.save.lock import Renewal
from ckptfs.engine.save.segments import SegmentPlan, plan_segments
from ckptfs.engine.save.stage import (
    ChunkId,
    IndexContent,
    Refer,
    StagedSave,
    has_cuda,
    release,
    stage,
    staging_allocator,
)
from ckptfs.engine.save.write import (
    Written,
    WrittenRank,
    checked_reference,
    file_sums,
    write,
    write_files,
    write_rank,
)
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.io.copy import copy_files
from ckptfs.io.local_store import LocalStore
from ckptfs.io.prefixed import PrefixedStore
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.index import LOCK_FILE, ChunkEntry, Index
from ckptfs.layout.plan import TensorPlan


@dataclass(frozen=True)
class SaveResult:
    """What one rank did during a save."""

    url: str
    backend: str
    backend_version: int
    bytes_written: int  #: by this rank (data files)
    total_bytes: int  #: data bytes of the whole checkpoint
    files: tuple[str, ...]  #: data files this rank wrote
    seconds: float
    plan_cached: bool = False  #: the plan of an earlier save of the same structure was reused
    #: what this rank moved through collectives (planning, outcomes, and index entries sent to
    #: the coordinator, counted apart in ``entry_bytes``)
    comm: CommStats = field(default_factory=CommStats)
    #: bytes this rank copied into host staging buffers (an asynchronous save's copies; a
    #: synchronous save's of data it cannot write in place): a delta save's chunks referenced
    #: to its base are not copied, nor chunks streamed while written (``host_memory_limit``)
    staged_bytes: int = 0


@dataclass(frozen=True)
class SaveRequest:
    """Where and how to save: the pipeline's input besides the state dict. A value: a writer
    process receives it pickled (``opener`` stays behind)."""

    url: str  #: the store's URL
    backend: Backend  #: the backend instance that lays the chunks out
    storage_options: Mapping[str, Any] | None = None  #: the store client's options
    store_options: StoreOptions | None = None  #: the store's options (``StoreOptions``)
    options: SaveOptions = field(default_factory=SaveOptions)  #: the save's options
    overwrite: bool = False  #: replace a committed checkpoint at the target
    progress: bool = False  #: rank 0 shows the bytes written
    hooks: tuple[SaveHook, ...] = ()  #: the features plugged in (engine/save/hooks.py), in order
    folder: str | None = None  #: the save's folder under the URL (a manager's step)
    clear_dead: bool = False  #: under the claim, a killed save's files in the target go first
    #: written to this node-local folder first (fsync off), copied to the URL before the commit
    local_root: str | None = None
    #: False: the URL is a node-local folder this save alone writes (a manager's local step):
    #: no lock, nothing replaced, its former content removed by the caller
    claim: bool = True
    nice: int = 0  #: the priority of the store's threads (a background save's)
    started: float = field(default_factory=time.perf_counter)  #: when the save was called
    #: the open store to write to, kept open (the manager's; a writer process opens its own)
    opener: Callable[[], Store] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "opener": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def target_url(self) -> str:
        """The URL of the checkpoint (the folder's, if any)."""
        return self.url if self.folder is None else f"{self.url}/{self.folder}"


def run_save(state_dict: Mapping[str, Any], request: SaveRequest,
             process_group: ProcessGroup | None) -> SaveResult:
    """A synchronous save, all four phases in the caller's thread (collective over
    ``process_group``): chunks staged as zero-copy views where they are CPU-contiguous, CUDA
    chunks streamed through a pinned ring while written, copies beyond
    ``host_memory_limit`` streamed through a ring within it."""
    opts, be = request.options, request.backend
    with public_errors(request.url):
        comm = Comm(process_group, timeout=opts.collective_timeout)
        overflow = bounded(opts, be, in_place=True)
        device = (cast(DeviceParts, overflow) if overflow is not None  # the same hooks
                  else device_parts(state_dict, be, opts))
        pool = BufferPool(HostAllocator() if device is not None and overflow is None
                          else staging_allocator(state_dict))
        try:
            staged = stage_phase(state_dict, request, comm, pool, copy=False, device=device)
            try:
                return finish_staged(request, staged, comm, lambda: None)
            finally:
                release(staged, pool)
        finally:
            if device is not None:
                device.close()


def device_parts(state_dict: Mapping[str, Any], be: Backend,
                 options: SaveOptions) -> DeviceParts | None:
    """The pinned ring through which a synchronous save streams its CUDA chunks while writing
    them (``SaveOptions.ring_bytes`` in ``ring_slots``); None for a state without CUDA tensors
    or a backend that needs the chunk bytes themselves (it gets a staged host copy)."""
    if not be.streams_device_chunks:
        return None
    return cuda_device_parts(has_cuda(state_dict), ring_bytes=options.ring_bytes,
                             slots=options.ring_slots)


def stage_phase(state_dict: Mapping[str, Any], request: SaveRequest, comm: Comm,
                pool: BufferPool, **how: Any) -> StagedSave:
    """Phase 1 (collective): the hooks' ``before_stage``, ``stage`` (``how``: its keywords),
    the hooks' ``after_stage``; on a failure after staging the buffers go back to ``pool``."""
    hooks, opts = request.hooks, request.options
    with phase(hooks, "stage"):
        memos = [h.before_stage(state_dict, comm.rank) for h in hooks]
        refer = _refer(hooks, memos) if how.get("copy") else None
        staged = stage(state_dict, comm, request.backend, pool, threads=opts.copy_threads,
                       copy_piece=opts.copy_piece, refer=refer, **how)
        del state_dict  # the caller's tensors are not held once staged (an asynchronous save)
        if not hooks:
            return staged
        try:
            tensors = staged.content.tensors if staged.content is not None else None
            notes = tuple(h.after_stage(staged.chunks, comm, m, tensors=tensors)
                          for h, m in zip(hooks, memos, strict=True))
        except BaseException:
            release(staged, pool)
            raise
    return dataclasses.replace(staged, notes=notes)


def _refer(hooks: Sequence[SaveHook], notes: list[Any]) -> Refer | None:
    """The stage's ``refer`` (engine/save/stage.py) of the hooks' ``before_copy``, each hook's
    note replaced in ``notes`` by what it returns (the first hook naming a chunk wins); None
    when no hook has one or a hook reads every chunk (``SaveHook.reads_every_chunk``)."""
    if (not any(overrides(h, "before_copy") for h in hooks)
            or any(h.reads_every_chunk() for h in hooks)):
        return None

    def refer(chunks: Sequence[ChunkData]) -> dict[ChunkId, ChunkEntry]:
        by_id = {chunk_id(c): c for c in chunks}
        out: dict[ChunkId, ChunkEntry] = {}
        for i, h in enumerate(hooks):
            if overrides(h, "before_copy"):
                left = [c for cid, c in by_id.items() if cid not in out]
                notes[i], refs = h.before_copy(left, notes[i])
                for cid, e in refs.items():
                    if cid in by_id and cid not in out:
                        out[cid] = checked_reference(h, by_id[cid], e)
        return out

    return refer


def finish_staged(request: SaveRequest, staged: StagedSave, comm: Comm,
                  give_back: Callable[[], None]) -> SaveResult:
    """Phases 2 to 4 (collective over ``comm``): claim, write, commit. The named entry point an
    asynchronous save runs once staged, in its thread or in the writer process;
    ``give_back()`` returns the staging buffers early (after a local tier's write)."""
    t0 = time.perf_counter()
    renewals: list[Renewal] = []
    store, claim = open_claimed(comm, request, functools.partial(
        segments_of, request, staged, comm.size), renewals)
    try:
        if isinstance(claim, str):  # a node-local step (``claim=False``), named ``claim``:
            # its index whole, since a node's recovery plans from the index it holds and
            # another node's segments may be gone with it
            staged = before_write(request.hooks, staged, comm, early=not store.streams_in_place)
            _done(request.hooks, "claim", t0)
            return _write_and_commit(request, staged, store, comm, (claim, False, None),
                                     give_back)
        target = target_of(request, store)
        with holding(target, renewals):
            if request.clear_dead:
                comm.run_on_coordinator(f"save: clearing a dead save's files at "
                                        f"{request.target_url}",
                                        lambda: run_sync(clear_dead(target, claim)))
            early = claim.replacing or (request.local_root is None
                                        and not target.streams_in_place)
            staged = before_write(request.hooks, staged, comm, early=early)
            uncommit(target, comm, claim)
            _done(request.hooks, "claim", t0)
            return _write_and_commit(request, staged, target, comm,
                                     (claim.save_id, claim.replacing, claim.segments), give_back)
    finally:
        if request.opener is None:
            run_sync(store.close())


def segments_of(request: SaveRequest, staged: StagedSave, world: int) -> SegmentPlan | None:
    """How the index is written (coordinator): None whole, else its segments' owners."""
    content = staged.content
    assert content is not None, "the coordinator decides"
    return plan_segments(request.options, request.backend, staged.plans, list(content.tensors),
                         world)


def target_of(request: SaveRequest, store: Store) -> Store:
    """The checkpoint's store: ``store`` (the URL's), or its folder where the request names one."""
    return PrefixedStore(store, request.folder) if request.folder else store


def open_claimed(comm: Comm, request: SaveRequest, segments: Callable[[], SegmentPlan | None],
                 renewals: list[Renewal]) -> tuple[Store, Claim | str]:
    """Collective, one step: the request's store opened on every rank (``opener``'s where
    given) and, in the same trip to the I/O loop, the coordinator's claim of the target
    (``take_claim``: ``segments()`` decided first, the lock taken and its renewal appended to
    ``renewals``, the target checked, a replaced index kept for ``uncommit``), which every rank
    gets; for a local step (``claim=False``: no lock, nothing replaced) the save's id instead.
    Returns (the store, the claim or the id). A rank that fails fails the save everywhere: the
    stores opened elsewhere are closed and a lock the coordinator took is given back."""
    opener = request.opener
    opened: list[Store] = []

    def step() -> Claim | str | None:
        if opener is not None:
            opened.append(opener())
        claims = comm.is_coordinator and request.claim
        plan = segments() if claims else None
        claim = None
        if opener is None or claims:  # no trip for a rank that holds the store and claims nothing
            claim = run_sync(_open_claiming(request, opened, renewals if claims else None, plan))
        return secrets.token_hex(6) if comm.is_coordinator and not request.claim else claim

    try:
        _, shared = comm.run_everywhere("save: opening the store and checking the target",
                                        step, lambda claim: claim, to="all")
    except BaseException:
        if opened:
            abandon_claim(target_of(request, opened[0]), renewals)
        if opener is None:
            for s in opened:
                run_sync(s.close())
        raise
    claim = shared[0]
    assert claim is not None, "the coordinator claimed the target or named the save"
    return opened[0], claim


async def _open_claiming(request: SaveRequest, opened: list[Store],
                         renewals: list[Renewal] | None, plan: SegmentPlan | None) -> Claim | None:
    """The request's store opened into ``opened`` (unless it holds it already) and, with
    ``renewals`` (the coordinator of a save that claims), its target claimed."""
    if not opened:
        opened.append(await open_store(request.url, request.storage_options,
                                       request.store_options, nice=request.nice))
    if renewals is None:
        return None
    return await take_claim(target_of(request, opened[0]), request.overwrite, request.backend,
                            keep_index=True, renewals=renewals, segments=plan)


async def clear_dead(store: Store, claim: Claim) -> None:
    """Under this save's lock (coordinator): files in a target without an index are a killed
    save's (whose stale lock ``claimed`` took over): remove them, never the lock. A committed
    checkpoint being replaced, or one another tool wrote there, is not touched: ``commit``
    removes what the replaced one leaves once the new one is committed."""
    if claim.replacing:
        return
    leftovers = [f for f in await store.list() if f != LOCK_FILE]
    if leftovers:
        await store.delete(leftovers)


def before_write(hooks: Sequence[SaveHook], staged: StagedSave, comm: Comm, *,
                 early: bool) -> StagedSave:
    """Collective: the hooks' ``before_write`` (``early``: decide before any byte is written)."""
    if not hooks:
        return staged
    notes = tuple(h.before_write(staged.chunks, comm, n, early=early)
                  for h, n in zip(hooks, staged.notes, strict=True))
    return dataclasses.replace(staged, notes=notes)


def _write_and_commit(request: SaveRequest, staged: StagedSave, target: Store, comm: Comm,
                      claim: tuple[str, bool, SegmentPlan | None],
                      give_back: Callable[[], None]) -> SaveResult:
    """Phases 3 and 4 into ``target`` (open on every rank, claimed: ``claim`` is (the save's
    id, whether a checkpoint is replaced, the index's segments or None)), through the local
    tier where the request names one."""
    save_id, replacing, segments = claim
    be, hooks, opts = request.backend, request.hooks, request.options
    t0 = time.perf_counter()
    if request.local_root is None:
        written = write(staged, be, target, comm, save_id, progress=request.progress,
                        throttle_uploads=opts.throttle_uploads, hooks=hooks, segments=segments)
    else:
        written = _write_tiered(request, staged, target, comm, save_id, give_back, segments)
    _done(hooks, "write", t0)
    t0 = time.perf_counter()
    total = commit(staged, written, be, target, comm, replacing=replacing, hooks=hooks,
                   segments=segments)
    _done(hooks, "commit", t0)
    files = written.mine.files
    return SaveResult(request.target_url, be.name, be.version, sum(files.values()), total,
                      tuple(files), time.perf_counter() - request.started, staged.cached,
                      comm.stats.snapshot(), staged.staged_bytes)


def local_options(store_options: StoreOptions | None) -> StoreOptions:
    """A node-local tier's store options: the caller's, without fsync (a restore checks every
    chunk it reads there against the committed index anyway)."""
    return dataclasses.replace(store_options or StoreOptions(), fsync=False)


def _write_tiered(request: SaveRequest, staged: StagedSave, remote: Store, comm: Comm,
                  save_id: str, give_back: Callable[[], None],
                  segments: SegmentPlan | None = None) -> Written:
    """Phase 3 through the local tier: the folder emptied (a killed attempt's files, on every
    rank before any rank writes), the files written there, the staging buffers given back,
    then every rank's files copied to ``remote`` (mapped, no heap copy)."""
    root = cast(str, request.local_root)
    local = LocalStore(root, local_options(request.store_options))
    comm.run_everywhere(f"save: clearing {root}", lambda: shutil.rmtree(root, ignore_errors=True))
    written = write(staged, request.backend, local, comm, save_id, hooks=request.hooks,
                    segments=segments)
    give_back()
    mine = sorted({*written.mine.files, *(s.file.path for s in written.mine.segments)})
    if comm.is_coordinator:
        mine = sorted({*mine, *written.prepared})
    comm.run_everywhere(f"save: persisting the local tier to {request.target_url}",
                        lambda: run_sync(copy_files(local, remote, mine)))
    return written


def _done(hooks: Sequence[SaveHook], name: str, since: float) -> None:
    took = time.perf_counter() - since
    for h in hooks:
        h.phase_done(name, took)


def write_chunks(chunks: Sequence[ChunkData], plans: Mapping[str, TensorPlan], be: Backend,
                 store: Store, save_id: str, *, rank: int, world_size: int) -> WrittenRank:
    """Phase 3 for one rank whose chunks were planned outside ckptfs's stage (a DCP write
    item's, a batch of ``convert``): its files and entries, without collectives."""
    staged = StagedSave(rank, world_size, plans, tuple(chunks), leases=(), copied=False)
    return write_rank(staged, be, store, save_id, False)


def prepare_layout(plans: Mapping[str, TensorPlan], be: Backend, store: Store
                   ) -> tuple[tuple[str, ...], dict[str, tuple[int, str]]]:
    """The backend's layout files of ``plans`` written (coordinator): (paths, size and crc32c)."""
    prep = be.prepare(plans)
    run_sync(write_files(store, prep, False))
    return tuple(f.path for f in prep), file_sums(prep)


def index_of(be: Backend, plans: Mapping[str, TensorPlan], content: IndexContent,
             written: Written, hooks: Sequence[SaveHook] = ()) -> Index:
    """The index of a save whose ranks' outcomes were gathered outside ckptfs (the coordinator
    of the DCP plug-in, ``convert``): built from ``written`` and ``content``, as the hooks'
    ``before_commit`` make it."""
    ranks = written.ranks or ()
    staged = StagedSave(0, len(ranks), plans, (), leases=(), copied=True, content=content)
    index = build_index(be, staged, written)
    for h in hooks:
        index = h.before_commit(index, [None] * len(ranks), None)
    return index


def commit_written(be: Backend, store: Store, plans: Mapping[str, TensorPlan],
                   content: IndexContent, written: Written, *, replacing: bool,
                   hooks: Sequence[SaveHook] = (),
                   before: Callable[[], None] | None = None) -> Index:
    """Phase 4 of such a save (``index_of``): the index committed; returns it. ``before`` runs
    once the index is built, right before it is created (the DCP plug-in removes a replaced
    checkpoint's index there, which it keeps loadable until then)."""
    index = index_of(be, plans, content, written, hooks)
    if before is not None:
        before()
    commit_index(store, be, index, plans, written.paths() if replacing else None)
    return index
