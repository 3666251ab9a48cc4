"""The local tier: a save's files go to node-local storage first, then to the persistent URL;
a restore reads each file from its local copy when that holds what the committed index says,
from the URL otherwise.

Save (collective over the background group, after ``stage``; the URL's store is open on every
rank and the step is claimed there, ``engine.commit.claimed``): the step's local folder is
emptied (a killed attempt's files) -> ``write`` into the local tier (fsync off: a restore checks
every chunk it reads there against the committed index anyway) -> the staging buffers go back
to the pool -> every rank copies its files to the URL (``io/copy.py``: mapped, no heap copy) ->
``commit`` the index at the URL. Only then does the step exist.

Restore (collective over the caller's group): the coordinator reads the committed index from
the URL; each rank routes to the local tier the files its reads touch whose local copy has the
index's size and a checksum on every chunk read (``engine/intact.py``: a stat, no data read),
and reads once through a ``RoutedStore``: those files locally, the rest from the URL. The read
engine checks every chunk it reads whole against its crc32c as it lands; a chunk read only in
part (another layout) is checked whole first. If the read fails anywhere, the local copies are
checked chunk by chunk, and those at fault are read again from the URL in a second fill (the
failure is raised when no local copy is at fault).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.commit import Claim, commit
from ckptfs.engine.index_io import read_index
from ckptfs.engine.intact import intact_files, usable_files
from ckptfs.engine.options import LoadOptions
from ckptfs.engine.read import TensorRead
from ckptfs.engine.stage import StagedSave
from ckptfs.engine.targets import plan_targets
from ckptfs.engine.write import write
from ckptfs.errors import CollectiveError, MissingKeysError
from ckptfs.io import Store, StoreOptions, run_sync
from ckptfs.io.copy import copy_files
from ckptfs.io.local_store import LocalStore
from ckptfs.io.progress import ByteProgress
from ckptfs.io.progress_store import ProgressStore
from ckptfs.io.routed import RoutedStore
from ckptfs.layout.backend import Backend
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.load import LoadResult, fill
from ckptfs.save import SaveResult


@dataclass(frozen=True)
class RestoreResult:
    """What one rank's ``CheckpointManager.restore`` read, and from where."""

    step: int
    load: LoadResult  #: as ``ckptfs.load`` reports it (bytes_read: both tiers)
    local_files: tuple[str, ...] = ()  #: data files read from the local tier (chunks matched)
    remote_files: tuple[str, ...] = ()  #: data files read from the URL
    local_bytes: int = 0  #: data bytes read from the local tier
    remote_bytes: int = 0  #: data bytes read from the URL (the index not counted)
    checked_bytes: int = 0  #: local bytes read only to check them (chunks read in part; a failed read)
    seconds: float = 0.0
    rejected: tuple[str, ...] = field(default=())  #: local copies present but not used (size, crc32c)
    #: a local step: data files read from copies fetched from other nodes
    peer_files: tuple[str, ...] = ()
    peer_bytes: int = 0  #: data bytes read from copies fetched from other nodes
    fetched_bytes: int = 0  #: bytes this rank's node received from other nodes (its leader)
    source: str = "persistent"  #: "local" (a local step) or "persistent" (a step at the URL)
    reason: str = ""  #: why this step was chosen, and why newer local steps were passed


def local_options(store_options: StoreOptions | None) -> StoreOptions:
    """The local tier's store options: the caller's, without fsync (see the module doc)."""
    return replace(store_options or StoreOptions(), fsync=False)


def save_tiered(staged: StagedSave, be: Backend, remote: Store, url: str, local_root: str,
                comm: Comm, claim: Claim, *, store_options: StoreOptions | None, started: float,
                release: Callable[[], None]) -> SaveResult:
    """Phases 2 and 3 of a save through the local tier into ``remote`` (open on every rank,
    claimed: the caller holds the lock, ``claimed``; collective over ``comm``); ``release()``
    gives the staging buffers back once the local files are written."""
    local = LocalStore(local_root, local_options(store_options))
    # the step is ours to write: a killed attempt's local files (other names) go first, on
    # every rank before any rank writes (a refused save never gets here)
    comm.run_everywhere(f"save: clearing {local_root}",
               lambda: shutil.rmtree(local_root, ignore_errors=True))
    written = write(staged, be, local, comm, claim.save_id)
    release()
    mine = sorted(written.mine.files)
    if comm.is_coordinator:
        mine = sorted({*mine, *written.prepared})
    comm.run_everywhere(f"save: persisting the local tier to {url}",
               lambda: run_sync(copy_files(local, remote, mine)))
    total = commit(staged, written, be, remote, comm, replacing=claim.replacing)
    files = written.mine.files
    return SaveResult(url, be.name, be.version, sum(files.values()), total, tuple(files),
                      time.perf_counter() - started, staged.cached, comm.stats.snapshot())


def restore_tiered(state_dict: dict[str, Any], step: int, remote: Store, url: str,
                   local_root: str | None, comm: Comm, *, options: LoadOptions,
                   store_options: StoreOptions | None, strict: bool,
                   progress: bool = False) -> RestoreResult:
    """Collective: fill ``state_dict`` from the committed checkpoint in ``remote`` (open on
    every rank), reading the local tier's copies under ``local_root`` (None: none) where they
    hold what the index says (see the module doc). ``progress``: rank 0 shows the bytes read."""
    t0 = time.perf_counter()
    index = comm.run_on_coordinator(f"restore: reading the index of {url}",
                                    lambda: run_sync(read_index(remote)))
    local = LocalStore(local_root or os.curdir, local_options(store_options))
    tiered = local_root is not None and os.path.isdir(local_root)
    read, good, routed = _route(state_dict, index, comm, url, local, tiered=tiered,
                                strict=strict, scratch_bytes=options.scratch_bytes)
    checked = local.stats.bytes_read
    far_before = remote.stats.bytes_read
    bar = ByteProgress(0, f"ckptfs restore {url}") if progress and comm.is_coordinator else None

    def fill_from(good: set[str]) -> LoadResult:
        tiers: Store = RoutedStore(local, remote, good)
        return fill(state_dict, tiers if bar is None else ProgressStore(tiers, bar), index, comm,
                    url, strict=strict, options=replace(options, verify=True),  # always checked
                    started=t0)

    ok = False
    try:
        result = fill_from(good)
        ok = True
    except CollectiveError:
        raise
    except Exception:
        if not any(routed):
            raise  # nothing was read locally: the failure is not the local tier's
        # which local copies failed: their chunks read whole once more; the rest is not ours
        before = local.stats.bytes_read
        bad, found = comm.run_everywhere(
            "restore: checking the local copies after a failed read",
            lambda: good - run_sync(intact_files(local, index, good, chunks=read,
                                                 scratch_bytes=options.scratch_bytes)),
            bool, to="all")
        checked += local.stats.bytes_read - before
        if not any(found):
            raise
        good -= bad
        result = fill_from(good)
        ok = True
    finally:
        if bar is not None:
            bar.close(done=ok)
    needed = set(read)
    rejected = ({f for f in needed - good if os.path.exists(local.local_path(f))}
                if local_root is not None else set())
    return RestoreResult(step, result, tuple(sorted(good)), tuple(sorted(needed - good)),
                         local.stats.bytes_read - checked, remote.stats.bytes_read - far_before,
                         checked, time.perf_counter() - t0, tuple(sorted(rejected)))


def _route(state_dict: dict[str, Any], index: Index, comm: Comm, url: str, local: LocalStore, *,
           tiered: bool, strict: bool, scratch_bytes: int
           ) -> tuple[dict[str, list[Chunk]], set[str], list[bool]]:
    """Collective: (file -> the chunks this rank's reads touch, the local copies it reads,
    whether each rank reads local copies). A copy is used when it has the size the index
    records; the chunks of it read only in part are checked whole first."""

    def route() -> tuple[dict[str, list[Chunk]], set[str]]:
        plan = plan_targets(state_dict, index, comm.rank)
        if strict and plan.missing:  # as fill would, before anything is read
            raise MissingKeysError(url, list(plan.missing))
        read, partial = chunks_read(plan.reads)
        if not tiered:
            return read, set()
        good = run_sync(usable_files(local, index, read))
        cut = {f: partial[f] for f in good & partial.keys()}  # not checked in flight: now
        return read, good - (cut.keys() - run_sync(intact_files(
            local, index, cut, chunks=cut, scratch_bytes=scratch_bytes)))

    # every rank learns only whether any rank reads local copies (the chunk lists stay here)
    (read, good), routed = comm.run_everywhere("restore: routing reads to the local tier", route,
                                               lambda r: bool(r[1]), to="all")
    return read, good, routed


#: a chunk some read of a restore touches, with its tensor
Chunk = tuple[TensorEntry, ChunkEntry]


def chunks_read(reads: Iterable[TensorRead]) -> tuple[dict[str, list[Chunk]], dict[str, list[Chunk]]]:
    """(file -> the chunks ``reads`` touch in it, file -> those of them some piece reads only
    part of): the read engine checks a chunk's crc32c only when it reads it whole."""
    whole: dict[tuple[str, tuple[int, ...]], bool] = {}  # (key, chunk offsets) -> read whole
    read: dict[str, list[Chunk]] = defaultdict(list)
    for r in reads:
        for p in r.pieces:
            if p.chunk.file is None:
                continue
            at = (r.entry.key, p.chunk.offsets)
            if at not in whole:
                read[p.chunk.file].append((r.entry, p.chunk))
            whole[at] = whole.get(at, True) and p.whole_chunk
    partial = {f: [(e, c) for e, c in held if not whole[(e.key, c.offsets)]]
               for f, held in read.items()}
    return dict(read), {f: held for f, held in partial.items() if held}
