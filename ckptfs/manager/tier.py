"""The local tier: a save's files go to node-local storage first, then to the persistent URL;
a restore reads each file from the local copy when it is intact, from the URL otherwise.

Save (collective over the background group, after ``stage``; the URL's store is open on every
rank and the step is claimed there, ``engine.commit.claimed``): the step's local folder is
emptied (a killed attempt's files) -> ``write`` into the local tier (fsync off: restore checks
every local file against the committed index anyway) -> the staging buffers go back to the pool ->
every rank copies its files to the URL (``io/copy.py``: mapped, no heap copy) -> ``commit`` the
index at the URL. Only then does the step exist.

Restore (collective over the caller's group): the coordinator reads the committed index from
the URL; each rank checks the local copies of the files its reads touch (``engine/intact.py``:
size and every chunk's crc32c against the index) and reads through a ``RoutedStore``: intact
files locally, the rest from the URL.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.commit import Claim, commit
from ckptfs.engine.index_io import read_index
from ckptfs.engine.intact import intact_files
from ckptfs.engine.stage import StagedSave
from ckptfs.engine.targets import files_of, plan_targets
from ckptfs.engine.write import write
from ckptfs.io import IOConfig, Store, run_sync
from ckptfs.io.copy import copy_files
from ckptfs.io.local_store import LocalStore
from ckptfs.io.routed import RoutedStore
from ckptfs.layout.backend import Backend
from ckptfs.load import LoadResult, fill
from ckptfs.save import SaveResult


@dataclass(frozen=True)
class RestoreResult:
    """What one rank's ``CheckpointManager.restore`` read, and from where."""

    step: int
    load: LoadResult  #: as ``ckptfs.load`` reports it (bytes_read: both tiers)
    local_files: tuple[str, ...] = ()  #: data files read from the local tier (found intact)
    remote_files: tuple[str, ...] = ()  #: data files read from the URL
    local_bytes: int = 0  #: data bytes read from the local tier
    remote_bytes: int = 0  #: data bytes read from the URL (the index not counted)
    checked_bytes: int = 0  #: local bytes read to check local copies against the index
    seconds: float = 0.0
    rejected: tuple[str, ...] = field(default=())  #: local copies present but not intact


def local_config(io_config: IOConfig | None) -> IOConfig:
    """The local tier's I/O settings: the caller's, without fsync (see the module doc)."""
    return replace(io_config or IOConfig(), fsync=False)


def save_tiered(staged: StagedSave, be: Backend, remote: Store, url: str, local_root: str,
                comm: Comm, claim: Claim, *, io_config: IOConfig | None, started: float,
                release: Callable[[], None]) -> SaveResult:
    """Phases 2 and 3 of a save through the local tier into ``remote`` (open on every rank,
    claimed: the caller holds the lock, ``claimed``; collective over ``comm``); ``release()``
    gives the staging buffers back once the local files are written."""
    local = LocalStore(local_root, local_config(io_config))
    # the step is ours to write: a killed attempt's local files (other names) go first, on
    # every rank before any rank writes (a refused save never gets here)
    comm.agree(f"save: clearing {local_root}",
               lambda: shutil.rmtree(local_root, ignore_errors=True))
    written = write(staged, be, local, comm, claim.save_id)
    release()
    mine = sorted(written.mine.files)
    if comm.is_coordinator:
        mine = sorted({*mine, *written.prepared})
    comm.agree(f"save: persisting the local tier to {url}",
               lambda: run_sync(copy_files(local, remote, mine)))
    total = commit(staged, written, be, remote, comm, replacing=claim.replacing)
    files = written.mine.files
    return SaveResult(url, be.name, be.version, sum(files.values()), total, tuple(files),
                      time.perf_counter() - started, staged.cached, comm.stats.snapshot())


def restore_tiered(state_dict: dict[str, Any], step: int, remote: Store, url: str,
                   local_root: str | None, comm: Comm, *, io_config: IOConfig | None,
                   strict: bool) -> RestoreResult:
    """Collective: fill ``state_dict`` from the committed checkpoint in ``remote`` (open on
    every rank), reading the local tier's intact copies under ``local_root`` (None: none)."""
    t0 = time.perf_counter()
    index = comm.decide(f"restore: reading the index of {url}", lambda: run_sync(read_index(remote)))
    local = LocalStore(local_root or os.curdir, local_config(io_config))

    def check() -> tuple[set[str], set[str]]:
        needed = {f for f in files_of(plan_targets(state_dict, index, comm.rank).reads) if f}
        if local_root is None or not os.path.isdir(local_root):
            return needed, set()
        return needed, run_sync(intact_files(local, index, needed))

    needed, good = comm.agree("restore: checking the local tier", check)[comm.rank]
    checked = local.stats.bytes_read
    far_before = remote.stats.bytes_read
    result = fill(state_dict, RoutedStore(local, remote, good), index, comm, url, strict=strict,
                  verify=True, started=t0)
    rejected = ({f for f in needed - good if os.path.exists(local.local_path(f))}
                if local_root is not None else set())
    return RestoreResult(step, result, tuple(sorted(good)), tuple(sorted(needed - good)),
                         local.stats.bytes_read - checked, remote.stats.bytes_read - far_before,
                         checked, time.perf_counter() - t0, tuple(sorted(rejected)))
