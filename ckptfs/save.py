"""``ckptfs.save``: the engine's save pipeline (engine/save/pipeline.py: stage, claim, write,
commit) run in the caller's thread: every rank writes the chunks assigned to it, then rank 0
commits the index. ``SaveResult`` is the pipeline's."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import Any

from ckptfs.dist import ProcessGroup
from ckptfs.engine.background.defaults import wait_default_idle
from ckptfs.engine.errors import public_errors
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.delta import DeltaHook
from ckptfs.engine.save.hash_memo import HashMemo, default_memo
from ckptfs.engine.save.health import HealthHook
from ckptfs.engine.save.hooks import SaveHook
from ckptfs.engine.save.pipeline import SaveRequest, SaveResult, run_save
from ckptfs.errors import ConfigError
from ckptfs.io import StoreOptions
from ckptfs.layout.backend import Backend
from ckptfs.layout.registry import get_backend
from ckptfs.options import REMOVED, moved_keywords


def make_backend(name: str, version: int | None, options: Mapping[str, Any] | None) -> Backend:
    """An instance of the registered backend, refusing read-only ones."""
    be = get_backend(name, version)(options)
    if not be.writable:
        raise ConfigError(f"backend {be.name}-{be.version} is read-only (it reads checkpoints "
                          f"written by another tool); save with another backend, or export "
                          f"tensors in that layout with ckptfs.unshard (e.g. format='hf')")
    return be


@moved_keywords("save", REMOVED["save"])
def save(state_dict: Mapping[str, Any], url: str | os.PathLike, *,
         backend: str = "safetensors_chunks", backend_version: int | None = None,
         backend_options: Mapping[str, Any] | None = None,
         process_group: ProcessGroup | None = None,
         storage_options: Mapping[str, Any] | None = None,
         store_options: StoreOptions | None = None, overwrite: bool = False,
         progress: bool = False, options: SaveOptions | None = None,
         check_finite: bool | None = None, stats: bool | None = None,
         host_memory_limit: int | None = None, base: str | os.PathLike | None = None
         ) -> SaveResult:
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
    beyond it stream through a ring within it while the files are written. ``base`` (a
    shortcut of ``options.base``): a delta save: the chunks whose content equals the base
    checkpoint's are recorded as references to it, not written (docs/guide/delta.md).
    """
    url = os.fspath(url)
    if base is not None:
        options = dataclasses.replace(options or SaveOptions(), base=os.fspath(base))
    request = save_request(url, backend, backend_version, backend_options, storage_options,
                           store_options, overwrite, progress, options,
                           check_finite=check_finite, stats=stats,
                           host_memory_limit=host_memory_limit)
    wait_default_idle()
    return run_save(state_dict, request, process_group)


def health_hooks(opts: SaveOptions) -> tuple[SaveHook, ...]:
    """The pipeline's hooks of ``opts.health`` (engine/save/health.py)."""
    return (HealthHook(opts.check_finite, opts.stats),) if opts.check_finite or opts.stats else ()


def delta_hooks(opts: SaveOptions, url: str, backend: Backend,
                storage_options: Mapping[str, Any] | None,
                memo: HashMemo | None = None) -> tuple[SaveHook, ...]:
    """The pipeline's hook of ``opts.base`` and ``opts.hashes`` (engine/save/delta.py) for a save
    to ``url``. ``opts.delta`` is a manager's (it picks each step's base): refused here."""
    if opts.delta:
        raise ConfigError(f"{url}: SaveOptions(delta=True) makes each step of a "
                          f"CheckpointManager a delta on the step before it; a single save "
                          f"names its base (base=URL)")
    if opts.base is None and not opts.hashes:
        return ()
    if opts.reuse_hashes and memo is None:
        memo = default_memo()
    return (DeltaHook(url, opts.base, (backend.name, backend.version), storage_options,
                      memo if opts.reuse_hashes else None, opts.copy_threads),)


def save_request(url: str, backend: str, backend_version: int | None,
                 backend_options: Mapping[str, Any] | None,
                 storage_options: Mapping[str, Any] | None, store_options: StoreOptions | None,
                 overwrite: bool, progress: bool, options: SaveOptions | None, *,
                 check_finite: bool | None, stats: bool | None, host_memory_limit: int | None,
                 writer: str | None = None, caller: str = "save") -> SaveRequest:
    """The pipeline's ``SaveRequest`` of ``save``'s (and ``async_save``'s) arguments: the
    keyword shortcuts set their fields of ``options``."""
    started = time.perf_counter()
    with public_errors(url):
        opts = (options or SaveOptions()).with_shortcuts(
            check_finite=check_finite, stats=stats, writer=writer,
            host_memory_limit=host_memory_limit)
    with public_errors(url):
        be = make_backend(backend, backend_version, backend_options)
    nice = opts.background_nice if caller == "async_save" else 0
    return SaveRequest(url, be, storage_options, store_options, opts, overwrite, progress,
                       health_hooks(opts) + delta_hooks(opts, url, be, storage_options),
                       nice=nice, started=started)
