"""Save, phase 3 of 3: commit. The coordinator builds the index, writes the backend's final
files, and creates the index create-if-absent (as the save's hooks make it,
engine/save/hooks.py): from then on the checkpoint exists.

Before the write phase, ``claim_target`` (or a step that opens the store in the same trip to
the I/O loop: ``take_claim``) takes the save lock (engine/save/lock.py: one save at a time
per root) and refuses a committed (or foreign) checkpoint at the URL unless ``overwrite``; when
overwriting it un-commits the old index first (``keep_index``: the save does it itself,
``uncommit``, once what must come before is done: the hooks' ``before_write``), and
``commit`` removes every leftover of the replaced checkpoint once the new one is committed. The
index records the size and crc32c of every file and its own checksum. A failed commit removes
the data files this save wrote; nothing of a previous checkpoint is lost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import platform
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ckptfs._version import __version__
from ckptfs.dist import Comm
from ckptfs.engine.index_io import read_index
from ckptfs.engine.save.hooks import SaveHook
from ckptfs.engine.save.lock import HELD, LockInfo, Renewal, acquire, release
from ckptfs.engine.save.segments import SegmentPlan, check_replicas
from ckptfs.engine.save.stage import StagedSave
from ckptfs.engine.save.write import Written, file_sums, write_files
from ckptfs.errors import CheckpointExistsError, CheckpointNotFoundError, CkptfsError
from ckptfs.io import run_sync
from ckptfs.io.store import Store
from ckptfs.layout.backend import Backend, FinalFiles
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry, packs
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.plan import TensorPlan
from ckptfs.layout.segment_rows import root_of
from ckptfs.layout.segments import SegmentPart


@dataclass(frozen=True, slots=True)
class Claim:
    """The target, claimed by the coordinator for this save (every rank gets a copy)."""

    replacing: bool  #: a checkpoint (ckptfs's or a foreign one) is being replaced (overwrite)
    save_id: str  #: 12 hex digits, unique per save (data file names)
    lock: LockInfo  #: the save lock the coordinator holds (formats/README.md §8 step 2)
    #: the replaced checkpoint's index is still there (``keep_index``): ``uncommit``
    #: un-commits it before any byte is written
    committed: bool = False
    #: the index is written as segments, by these owners (engine/save/segments.py); None: whole
    segments: SegmentPlan | None = None


def claim_target(store: Store, comm: Comm, overwrite: bool, backend: Backend, *,
                 keep_index: bool = False, renewals: list[Renewal] | None = None,
                 segments: Callable[[], SegmentPlan | None] | None = None) -> Claim:
    """Collective: take the save lock and check the target (``take_claim``); with
    ``renewals``, the coordinator starts the lock's renewal in the same step (one trip to the
    I/O loop) and appends it there. ``segments`` (coordinator, before the lock is taken)
    decides how the index is written, and every rank learns it with the claim."""

    def claim() -> Claim:
        plan = segments() if segments is not None else None
        return run_sync(take_claim(store, overwrite, backend, keep_index=keep_index,
                                   renewals=renewals, segments=plan))

    return comm.run_on_coordinator("save: checking the target", claim)


async def take_claim(store: Store, overwrite: bool, backend: Backend, *,
                     keep_index: bool = False, renewals: list[Renewal] | None = None,
                     segments: SegmentPlan | None = None) -> Claim:
    """The coordinator's claim on the I/O loop (``_claim``), the index's ``segments``
    recorded in it: what ``claim_target``'s step runs, and what a step that does more in the
    same trip awaits (the save pipeline opens the store first)."""
    claim = await _claim(store, overwrite, backend, keep_index, renewals)
    return dataclasses.replace(claim, segments=segments)


async def _claim(store: Store, overwrite: bool, backend: Backend, keep_index: bool = False,
                 renewals: list[Renewal] | None = None) -> Claim:
    save_id = uuid.uuid4().hex[:12]
    lock = LockInfo.new(save_id, f"{backend.name}-{backend.version}")
    await acquire(store, lock)  # from here no other save writes to this root
    try:
        replacing, committed = await _check_target(store, overwrite)
        if committed and not keep_index:
            await store.delete([INDEX_FILE])  # un-commit first: a crash now leaves no stale index
            committed = False
        if renewals is not None:
            renewals.append(await Renewal.begin(store, lock))
        return Claim(replacing, save_id, lock, committed)
    except BaseException:
        await release(store)
        raise


async def _check_target(store: Store, overwrite: bool) -> tuple[bool, bool]:
    """Whether a checkpoint is being replaced, and whether it is a committed ckptfs one;
    refuses one unless ``overwrite``."""
    if not await store.exists(INDEX_FILE):
        try:  # a foreign checkpoint (DCP, Megatron, ...) a backend would write over
            await read_index(store)
        except CheckpointNotFoundError:
            return False, False
        except CkptfsError:
            pass  # unreadable, but something is there
        if overwrite:
            return True, False
        raise CheckpointExistsError(
            f"{store.url} holds a checkpoint without {INDEX_FILE} (written by another tool); "
            f"pass overwrite=True to write over it"
        )
    if not overwrite:
        raise CheckpointExistsError(
            f"{store.full_path(INDEX_FILE)} exists: a checkpoint is already committed at "
            f"{store.url}; pass overwrite=True to replace it"
        )
    return True, True


async def abandon(store: Store) -> None:
    """After a failed save (coordinator): give the lock back, best effort."""
    with contextlib.suppress(Exception):
        await release(store)


def uncommit(store: Store, comm: Comm, claim: Claim) -> None:
    """Collective, in the body of ``claimed(keep_index=True)`` once what must come before is
    done (the hooks' ``before_write``: a refusal leaves the replaced checkpoint as it was): the
    replaced index is un-committed (a crash from then on leaves no stale index)."""
    if claim.committed:
        comm.run_on_coordinator("save: un-committing the replaced checkpoint",
                                lambda: run_sync(store.delete([INDEX_FILE])))


@contextlib.contextmanager
def claimed(store: Store, comm: Comm, overwrite: bool, backend: Backend, *,
            keep_index: bool = False,
            segments: Callable[[], SegmentPlan | None] | None = None) -> Iterator[Claim]:
    """Collective: ``claim_target``, then the body (write and commit) with the lock held
    (``holding``). ``keep_index``: a replaced index is left for the body to un-commit
    (``uncommit``)."""
    renewals: list[Renewal] = []
    try:
        claim = claim_target(store, comm, overwrite, backend, keep_index=keep_index,
                             renewals=renewals, segments=segments)
    except BaseException:  # the claim's collective failed after the coordinator's claim
        abandon_claim(store, renewals)
        raise
    with holding(store, renewals):
        yield claim


def abandon_claim(store: Store, renewals: Sequence[Renewal]) -> None:
    """After a claim's collective step failed on some rank (coordinator): the claim it took
    anyway, if any (its renewal in ``renewals``), is given back, its renewal stopped first.
    Nothing was written under it; best effort."""
    for r in renewals:
        r.stop()
    if renewals:
        run_sync(abandon(store))


@contextlib.contextmanager
def holding(store: Store, renewals: Sequence[Renewal]) -> Iterator[None]:
    """The body of a claimed save (write and commit) with the lock held: the coordinator (the
    one renewal in ``renewals``) renews it while the body runs and, if the body fails on it,
    stops renewing and gives it back (``abandon``); a committed save has released it
    (``commit_index``)."""
    renewal = renewals[0] if renewals else None
    failed = False
    held = HELD.set(renewal)
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        HELD.reset(held)
        if renewal is not None:
            renewal.stop()  # first: a stopped renewal never rewrites the released lock
            if failed:
                run_sync(abandon(store))


def commit(staged: StagedSave, written: Written, backend: Backend, store: Store, comm: Comm, *,
           replacing: bool, hooks: Sequence[SaveHook] = (),
           segments: SegmentPlan | None = None) -> int:
    """Collective: the coordinator commits the index (as the ``before_commit`` of ``hooks``
    make it; with ``segments``, the root of the segments the owners wrote); returns the
    checkpoint's data bytes."""

    def build_and_commit() -> int:
        with paused_gc():  # many small acyclic objects (layout/nogc.py)
            if segments is None:
                index = build_index(backend, staged, written)
            else:
                index = root_of(build_index(backend, staged, written, rows=False),
                                segment_parts(segments, written), packed=segments.packed)
            index = hooked_index(index, written, hooks)
        commit_index(store, backend, index, staged.plans, written.paths() if replacing else None)
        return index.total_bytes

    try:
        return comm.run_on_coordinator("save: committing the index", build_and_commit)
    except BaseException:
        if comm.is_coordinator:  # nothing committed: the data files are garbage, unless...
            paths = sorted(written.paths())
            # a path the committed root names verbatim (a packed index's data files are not)
            probe = (written.segments() or paths)[:1]
            with contextlib.suppress(Exception):  # unsure: keep them (`ckptfs clean` removes)
                if paths and not run_sync(_index_lists(store, probe[0])):
                    run_sync(store.delete(paths))
        raise


def segment_parts(plan: SegmentPlan, written: Written) -> list[SegmentPart]:
    """The owners' reports, in segment order (coordinator)."""
    assert written.ranks is not None, "the root is made on the coordinator"
    taken = [iter(r.segments) for r in written.ranks]
    return [next(taken[rank]) for rank in plan.ranks]


def hooked_index(index: Index, written: Written, hooks: Sequence[SaveHook]) -> Index:
    """``index`` as each hook's ``before_commit`` makes it, in order (coordinator)."""
    if not hooks:
        return index
    assert written.ranks is not None, "the hooks' commit runs on the coordinator"
    notes = written.mine.notes or (None,) * len(hooks)
    for i, (hook, note) in enumerate(zip(hooks, notes, strict=True)):
        parts = [r.parts[i] if r.parts else None for r in written.ranks]
        index = hook.before_commit(index, parts, note)
    return index


async def _index_lists(store: Store, path: str) -> bool:
    """Whether the index at the root names ``path``: the commit's index PUT landed and the save
    failed after it (its answer lost and the check of our own bytes failed, the lock's release
    refused). Its data files are then a committed checkpoint's and must stay."""
    try:
        raw = bytes(await store.get(INDEX_FILE))
    except FileNotFoundError:
        return False
    return json.dumps(path).encode() in raw


def build_index(backend: Backend, staged: StagedSave, written: Written, *,
                rows: bool = True) -> Index:
    """The index of the checkpoint: every rank's entries under the agreed plan (coordinator).
    Raises ShardingError when a plain tensor's replicas differ (their checksums). Without
    ``rows`` (a segmented save: the owners hold them) its tensors have no chunks."""
    by_key: dict[str, list[ChunkEntry]] = defaultdict(list)
    files: dict[str, int] = {}
    assert written.ranks is not None, "build_index runs on the coordinator"
    content = staged.content
    assert content is not None, "the coordinator staged the index's content"
    sums: dict[str, str] = {p: crc for p, (_, crc) in written.prepared_sums.items()}
    for rank in written.ranks:
        for key, e in rank.entries:
            by_key[key].append(e)
        files.update(rank.files)
        sums.update(rank.sums)
    check_replicas(written.ranks)
    tensors = {}
    # a packed index (§2.3) leaves out the extra members the backend's spec derives
    implied = backend.implied_extra if packs(sum(map(len, by_key.values()))) else frozenset()
    for key, (dtype, shape) in content.tensors.items():
        if not rows:
            tensors[key] = TensorEntry(key, dtype, shape, ())
            continue
        chunks = tuple(sorted(by_key.get(key, ()), key=lambda e: e.offsets))
        if implied:
            chunks = tuple(e.but(e.checksum, {k: v for k, v in e.extra.items()
                                              if k not in implied})
                           if implied & e.extra.keys() else e for e in chunks)
        # the planned chunks tile the tensor; a backend may store one planned chunk as several
        # entries (zarr v3 inner chunks), never fewer elements
        stored = sum(math.prod(e.shape) for e in chunks)
        if stored != math.prod(shape):
            raise CkptfsError(f"key {key!r}: {math.prod(shape)} elements planned, {len(chunks)} "
                              f"chunks of {stored} elements written")
        tensors[key] = TensorEntry(key, dtype, shape, chunks)
    writer = {"library": "ckptfs", "library_version": __version__,
              "torch_version": torch.__version__, "python_version": platform.python_version(),
              "world_size": staged.world_size,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    return Index(backend=backend.name, backend_version=backend.version, tensors=tensors,
                 values=content.values, containers=content.containers,
                 files=dict(sorted(files.items())), backend_options=backend.index_options(),
                 writer=writer, order=content.order or None, per_rank=content.per_rank,
                 backend_files={p: n for p, (n, _) in written.prepared_sums.items()},
                 file_checksums=sums)


def commit_index(store: Store, backend: Backend, index: Index, plans: Mapping[str, TensorPlan],
                 written: set[str] | None) -> None:
    """Backend final files, then the index (create-if-absent). When a checkpoint was replaced
    (``written`` = every file this save wrote), everything else under the root goes after.
    The files' bytes and the index's JSON are made in the calling thread, at its priority (a
    background save's ``background_nice``), and only the I/O runs on the I/O loop: for tens
    of thousands of tensors that is a large share of a save's CPU, which at the loop's
    priority would compete with the caller's training loop."""
    with paused_gc():  # a backend's own metadata per tensor (DCP's .metadata: layout/nogc.py)
        final = backend.finalize(index, plans)
        finals = file_sums(final.all())
        index = dataclasses.replace(
            index, backend_files={**index.backend_files, **{p: n for p, (n, _) in finals.items()}},
            file_checksums={**index.file_checksums, **{p: crc for p, (_, crc) in finals.items()}})
        body = index.dumps()
    run_sync(_commit_files(store, final, index, body, written, HELD.get()))


async def _commit_files(store: Store, final: FinalFiles, index: Index, body: bytes,
                        written: set[str] | None, renewal: Renewal | None = None) -> None:
    """``commit_index``'s I/O: the final files, the index ``body``, then what was replaced."""
    try:
        await write_files(store, final.files, False)
        if final.marker is not None:  # last, after the others (another tool's marker)
            await write_files(store, [final.marker], False)
        await store.put_if_absent(INDEX_FILE, body)
    except FileExistsError:  # another save committed at this root after claim_target
        raise CheckpointExistsError(
            f"{store.full_path(INDEX_FILE)} appeared while this save was writing: another save "
            f"committed a checkpoint at {store.url} first; it is left as it is") from None
    except BaseException:  # not committed: the final files must not pose as a checkpoint
        with contextlib.suppress(Exception):  # (a DCP .metadata would read as a foreign one)
            await store.delete([f.path for f in final.all()])
        raise
    if renewal is not None:  # first: a rewrite in flight must not bring the lock back
        await renewal.halt()
    await release(store)  # committed: the next save may come
    if written is not None:
        keep = written | {f.path for f in final.all()} | set(index.files) | {INDEX_FILE}
        stale = [p for p in await store.list() if p not in keep]
        if stale:
            await store.delete(stale)
