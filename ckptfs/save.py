"""``ckptfs.save``: stage, write, commit (ckptfs/engine/): every rank writes the chunks assigned
to it, then rank 0 commits the index."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from ckptfs.dist import Comm, CommStats, ProcessGroup
from ckptfs.engine.background import bounded
from ckptfs.engine.buffers import BufferPool, HostAllocator
from ckptfs.engine.commit import Claim, claimed, commit, replace_target
from ckptfs.engine.defaults import wait_default_idle
from ckptfs.engine.device_parts import DeviceParts, cuda_device_parts
from ckptfs.engine.errors import public_errors
from ckptfs.engine.health import check_on_device, checked
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.stage import StagedSave, has_cuda, release, stage, staging_allocator
from ckptfs.engine.write import write
from ckptfs.errors import ConfigError
from ckptfs.io import Store, StoreOptions, open_store, run_sync
from ckptfs.layout.backend import Backend
from ckptfs.layout.registry import get_backend
from ckptfs.options import REMOVED, moved_keywords


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


def make_backend(name: str, version: int | None, options: Mapping[str, Any] | None) -> Backend:
    """An instance of the registered backend, refusing read-only ones."""
    be = get_backend(name, version)(options)
    if not be.writable:
        raise ConfigError(f"backend {be.name}-{be.version} is read-only (it reads checkpoints "
                          f"written by another tool); save with another backend, or export "
                          f"tensors in that layout with ckptfs.unshard (e.g. format='hf')")
    return be


def device_parts(state_dict: Mapping[str, Any], be: Backend,
                 options: SaveOptions) -> DeviceParts | None:
    """The pinned ring through which a synchronous save streams its CUDA chunks while writing
    them (``SaveOptions.ring_bytes`` in ``ring_slots``); None for a state without CUDA tensors
    or a backend that needs the chunk bytes themselves (it gets a staged host copy)."""
    if not be.streams_device_chunks:
        return None
    return cuda_device_parts(has_cuda(state_dict), ring_bytes=options.ring_bytes,
                             slots=options.ring_slots)


@moved_keywords("save", REMOVED["save"])
def save(state_dict: Mapping[str, Any], url: str | os.PathLike, *,
         backend: str = "safetensors_chunks", backend_version: int | None = None,
         backend_options: Mapping[str, Any] | None = None,
         process_group: ProcessGroup | None = None,
         storage_options: Mapping[str, Any] | None = None,
         store_options: StoreOptions | None = None, overwrite: bool = False,
         progress: bool = False, options: SaveOptions | None = None,
         check_finite: bool | None = None, stats: bool | None = None,
         host_memory_limit: int | None = None) -> SaveResult:
    """Save a (sharded) state dict to ``url``; every rank of ``process_group`` calls this.

    Each stored chunk is written by exactly one rank (replicas once). The index is written last,
    create-if-absent: its presence marks the checkpoint complete. Without ``overwrite`` an
    existing checkpoint is refused and left intact. ``options`` (``SaveOptions``) tune the save:
    ``dist.collective_timeout`` (seconds; default ``$CKPTFS_COLLECTIVE_TIMEOUT`` or 600) bounds every
    wait for the other ranks (a rank that dies, hangs or never calls save makes the others
    raise CollectiveError naming the step, and nothing is committed); ``throttle_uploads=K``
    lets at most K ranks of a node write at once. ``store_options`` (``StoreOptions``) tune the
    store. An asynchronous save of ``ckptfs.async_save`` still in flight is waited for first.
    ``check_finite`` (a shortcut of ``options.health.check_finite``): a NaN or infinity in any
    floating tensor fails the save on every rank with NonFiniteError, nothing committed and a
    checkpoint at the URL untouched (searched while the files are written where the target is
    fresh, before otherwise); ``stats`` (a shortcut of ``options.health.stats``): the index
    records every tensor's fingerprint (docs/health.md). ``host_memory_limit`` (bytes; a
    shortcut of ``options.asynchronous.host_memory_limit``): the most host memory the save's
    copies hold (the chunks it cannot write in place: not CPU, or not C-contiguous); the copies
    beyond it stream through a ring within it while the files are written.
    """
    t0 = time.perf_counter()
    url = os.fspath(url)
    opts = (options or SaveOptions()).with_shortcuts(
        check_finite=check_finite, stats=stats, host_memory_limit=host_memory_limit)
    wait_default_idle()
    with public_errors(url):
        comm = Comm(process_group, timeout=opts.collective_timeout)
        be = make_backend(backend, backend_version, backend_options)
        # CUDA chunks stream off the device through a pinned ring while they are written
        # (backends that pass chunk bytes through); staging copies only what is not
        # CPU-contiguous and not streamed (unbounded; pinned for CUDA sources staged whole)
        # under host_memory_limit: the copies beyond the bound stream through a ring within it
        overflow = bounded(opts, be, in_place=True)
        device = (cast(DeviceParts, overflow) if overflow is not None  # the same hooks
                  else device_parts(state_dict, be, opts))
        pool = BufferPool(HostAllocator() if device is not None and overflow is None
                          else staging_allocator(state_dict))
        try:
            on_device = check_on_device(state_dict, comm.rank, opts.check_finite)
            staged = stage(state_dict, comm, be, pool, copy=False, threads=opts.copy_threads,
                           copy_piece=opts.copy_piece, device=device)
            staged = checked(staged, pool, comm, check_finite=opts.check_finite, stats=opts.stats,
                             device=on_device)
            try:
                store = open_agreed(comm, url, storage_options, store_options)
                return save_staged(staged, be, store, url, comm, overwrite=overwrite,
                                   progress=progress, options=opts, started=t0)
            finally:
                release(staged, pool)
        finally:
            if device is not None:
                device.close()


def open_agreed(comm: Comm, url: str, storage_options: Mapping[str, Any] | None,
                store_options: StoreOptions | None, *, nice: int = 0) -> Store:
    """The store at ``url``, opened on every rank of ``comm``: a rank that cannot open it fails
    the save everywhere (the stores opened elsewhere are closed)."""
    opened: list[Store] = []
    try:
        comm.run_everywhere("save: opening the store", lambda: opened.append(
            run_sync(open_store(url, storage_options, store_options, nice=nice))))
    except BaseException:
        for s in opened:
            run_sync(s.close())
        raise
    return opened[0]


def save_staged(staged: StagedSave, be: Backend, store: Store, url: str, comm: Comm, *,
                overwrite: bool, progress: bool, options: SaveOptions,
                started: float) -> SaveResult:
    """Phases 2 and 3 of a save (collective over ``comm``) into ``store`` (open on every rank;
    closed here): claim the target, write, commit."""
    try:
        with claimed(store, comm, overwrite, be, keep_index=True) as claim:
            staged = replace_target(staged, store, comm, claim)
            return write_and_commit(staged, be, store, url, comm, claim, progress=progress,
                                    throttle_uploads=options.throttle_uploads, started=started)
    finally:
        run_sync(store.close())


def write_and_commit(staged: StagedSave, be: Backend, store: Store, url: str, comm: Comm,
                     claim: Claim, *, progress: bool, throttle_uploads: int | None,
                     started: float) -> SaveResult:
    """Write and commit into a store every rank has open, under ``claim`` (``claimed``: the
    caller holds the lock and closes the store; the manager clears a dead attempt first)."""
    written = write(staged, be, store, comm, claim.save_id, progress=progress,
                    throttle_uploads=throttle_uploads)
    total = commit(staged, written, be, store, comm, replacing=claim.replacing)
    mine = written.mine.files
    return SaveResult(url, be.name, be.version, sum(mine.values()), total, tuple(mine),
                      time.perf_counter() - started, staged.cached, comm.stats.snapshot())
