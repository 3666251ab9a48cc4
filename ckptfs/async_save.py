"""``ckptfs.async_save``: the same save, run in the background. The call returns at once with
two futures: ``staged`` (this rank's bytes are copied: the caller may change its tensors) and
``done`` (the index is committed; its result is the ``SaveResult``).

The save is ``save()``'s composition (stage -> write -> commit) with two differences: staging
copies every chunk this rank writes into reusable staging buffers (engine/background.py's pool),
and every phase runs over a gloo group of its own (dist/groups.py), never over the caller's
group, so the training loop can run its collectives meanwhile. At most one save is in flight
per process: a new ``async_save`` (and ``save``) first waits for the previous one's ``done``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.engine import background
from ckptfs.engine.errors import public_errors
from ckptfs.engine.health import check_on_device, checked
from ckptfs.engine.stage import stage, staging_allocator
from ckptfs.io import IOConfig
from ckptfs.io.local_store import lower_priority
from ckptfs.save import SaveResult, make_backend, write_commit_release


@dataclass(frozen=True, eq=False)
class AsyncSave:
    """A save running in the background (what ``async_save`` returns).

    ``staged`` resolves once this rank's chunks are copied: from then on the caller may change
    its tensors, the checkpoint holds the values at the call. ``done`` resolves once the index is
    committed, with the ``SaveResult``. A failure on any rank resolves ``done`` with an
    exception on every rank (nothing is committed); a failure while staging resolves
    ``staged`` too.
    """

    url: str
    staged: Future[None]
    done: Future[SaveResult]

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the caller may change its tensors; raises a staging failure."""
        self.staged.result(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block until the checkpoint is committed; raises the save's failure."""
        return self.done.result(timeout)


def async_save(state_dict: Mapping[str, Any], url: str | os.PathLike, *,
               backend: str = "safetensors_chunks", backend_version: int | None = None,
               backend_options: Mapping[str, Any] | None = None,
               process_group: ProcessGroup | None = None,
               storage_options: Mapping[str, Any] | None = None, overwrite: bool = False,
               io_config: IOConfig | None = None, progress: bool = False,
               throttle_uploads: int | None = None,
               collective_timeout: float | None = None, check_finite: bool = False,
               stats: bool = False) -> AsyncSave:
    """Start saving ``state_dict`` to ``url`` in the background; every rank of
    ``process_group`` calls this. Options as for ``save``; ``collective_timeout`` bounds every
    wait of the background save for the other ranks (a dead rank fails ``done`` with
    CollectiveError).

    Returns at once, unless a save is still in flight: then it first waits for that one's
    ``done``. Do not change the tensors until ``handle.staged`` resolves. Staging memory: one
    copy of the bytes this rank writes (replicas are written by one rank only), allocated by
    the first save and reused by later saves of the same structure until ``ckptfs.close()``.
    """
    started = time.perf_counter()
    url = os.fspath(url)
    with public_errors(url):
        be = make_backend(backend, backend_version, backend_options)
    with background.next_slot():
        with public_errors(url):  # creates the background group on the first call
            comm = Comm(process_group, timeout=collective_timeout, background=True)
        pool = background.staging_pool(staging_allocator(state_dict))
        held = [state_dict]  # let go of the caller's tensors once staged

        cfg = io_config or IOConfig()

        def job(on_copied: Callable[[], None]) -> SaveResult:
            with public_errors(url):
                on_device = check_on_device(held[0], comm.rank, check_finite)
                staged = stage(held.pop(), comm, be, pool, copy=True, on_copied=on_copied,
                               threads=cfg.copy_threads)
                staged = checked(staged, pool, comm, check_finite=check_finite, stats=stats,
                                 device=on_device)
                lower_priority(cfg.background_nice)  # the caller goes on
                return write_commit_release(staged, pool, be, url, comm,
                                            storage_options=storage_options, io_config=io_config,
                                            overwrite=overwrite, progress=progress,
                                            throttle_uploads=throttle_uploads, started=started)

        staged, done = background.launch(job)
    return AsyncSave(url, staged, done)


def close() -> None:
    """Wait for the asynchronous save in flight (if any), then free the staging buffers and the
    background process groups. Call it on every rank before ``destroy_process_group()``; a
    later ``async_save`` starts afresh."""
    background.close()
