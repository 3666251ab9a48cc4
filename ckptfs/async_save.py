"""``ckptfs.async_save``: the same save, run in the background. The call returns at once with
two futures: ``staged`` (this rank's bytes are copied: the caller may change its tensors) and
``done`` (the index is committed; its result is the ``SaveResult``).

The save is ``save()``'s composition (stage -> write -> commit) with two differences: staging
copies every chunk this rank writes into the reusable staging buffers of a ``BackgroundSaver``
(engine/background.py), and every phase runs over a gloo group of its own (dist/groups.py),
never over the caller's group, so the training loop can run its collectives meanwhile. At most
one save is in flight per saver: a new ``async_save`` on it (and ``save``, for the default
saver) first waits for the previous one's ``done``.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.engine.background import BackgroundSaver
from ckptfs.engine.defaults import DEFAULTS
from ckptfs.engine.errors import public_errors
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.stage import StagedSave
from ckptfs.engine.writer_process import ProcessSaver
from ckptfs.errors import ConfigError
from ckptfs.io import StoreOptions
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.save import SaveResult, make_backend, open_agreed, save_staged


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

    def wait_staged(self, timeout: float | None = None, *, stream: Any = None) -> None:
        """Block until the caller may change its tensors; raises a staging failure.

        ``stream`` (a ``torch.cuda.Stream``, e.g. ``torch.cuda.current_stream()``): where the
        state is on CUDA, block only until the device-to-host copies are queued (they run on a
        side stream), then make ``stream`` wait on a CUDA event recorded after them: work
        queued on ``stream`` from now on (the optimizer step) runs once they are done, and the
        host goes on at once. A failure found after the copies were queued is raised by
        ``done``. Where nothing is copied from CUDA (CPU state), or chunks beyond a
        ``host_memory_limit`` are copied while written, it blocks until ``staged`` as without
        ``stream``."""
        queued = getattr(self.staged, "queued", None)
        if stream is None or queued is None:
            self.staged.result(timeout)
            return
        events = queued.result(timeout)
        if not events:
            self.staged.result(timeout)
            return
        for event in events:
            stream.wait_event(event)

    def result(self, timeout: float | None = None) -> SaveResult:
        """Block until the checkpoint is committed; raises the save's failure."""
        return self.done.result(timeout)


@moved_keywords("async_save", REMOVED["save"])
def async_save(state_dict: Mapping[str, Any], url: str | os.PathLike, *,
               backend: str = "safetensors_chunks", backend_version: int | None = None,
               backend_options: Mapping[str, Any] | None = None,
               process_group: ProcessGroup | None = None,
               storage_options: Mapping[str, Any] | None = None,
               store_options: StoreOptions | None = None, overwrite: bool = False,
               progress: bool = False, options: SaveOptions | None = None,
               saver: BackgroundSaver | None = None, check_finite: bool | None = None,
               stats: bool | None = None, writer: str | None = None,
               host_memory_limit: int | None = None) -> AsyncSave:
    """Start saving ``state_dict`` to ``url`` in the background; every rank of
    ``process_group`` calls this. Options as for ``save``; ``options.dist.collective_timeout``
    bounds every wait of the background save for the other ranks (a dead rank fails ``done``
    with CollectiveError). ``saver``: the ``BackgroundSaver`` to run on (default: the
    per-process one of ``writer``'s kind, ``ckptfs.close()`` frees it). ``writer`` (a shortcut
    of ``options.asynchronous.writer``): where the files are written, checksummed and
    committed once staged: ``"thread"`` (a thread of this process) or ``"process"`` (a
    persistent writer process per rank, fed through shared memory: the training loop's Python
    keeps the GIL to itself). ``host_memory_limit`` (bytes; a shortcut of
    ``options.asynchronous.host_memory_limit``): the most host memory staging holds; what does
    not fit is copied while the files are written (with ``writer="process"`` through a ring of shared
    memory, at the writer's request), and ``staged`` resolves after the last byte; with CUDA
    state, ``handle.wait_staged(stream=...)`` lets the host go on before the copies end.
    ``check_finite`` and ``stats`` as for ``save``
    (a refused save resolves ``done`` with NonFiniteError).

    Returns at once, unless the saver has a save still in flight: then it first waits for that
    one's ``done``. Do not change the tensors until ``handle.staged`` resolves. Staging memory:
    one copy of the bytes this rank writes (replicas are written by one rank only), allocated by
    the first save and reused by later saves of the same structure until the saver is closed.
    """
    started = time.perf_counter()
    url = os.fspath(url)
    with public_errors(url):
        opts = (options or SaveOptions()).with_shortcuts(
            check_finite=check_finite, stats=stats, writer=writer,
            host_memory_limit=host_memory_limit)
    with public_errors(url):
        be = make_backend(backend, backend_version, backend_options)

    finish = functools.partial(_finish, url, be, storage_options, store_options, overwrite,
                               progress, opts, started)
    saver = _saver(saver, opts.writer)
    staged, done = saver.start(state_dict, url, be, finish, process_group=process_group,
                               options=opts, check_finite=opts.check_finite, stats=opts.stats)
    return AsyncSave(url, staged, done)


def _finish(url: str, be: Any, storage_options: Mapping[str, Any] | None,
            store_options: StoreOptions | None, overwrite: bool, progress: bool, opts: SaveOptions,
            started: float, staged: StagedSave, comm: Comm,
            give_back: Callable[[], None]) -> SaveResult:
    """Phases 2 and 3 of an asynchronous save (a function of values: it may run in a writer
    process)."""
    store = open_agreed(comm, url, storage_options, store_options, nice=opts.background_nice)
    return save_staged(staged, be, store, url, comm, overwrite=overwrite, progress=progress,
                       options=opts, started=started)


def _saver(saver: BackgroundSaver | None, writer: str) -> BackgroundSaver:
    if writer not in ("thread", "process"):
        raise ConfigError(f"async_save: writer must be 'thread' or 'process', got {writer!r}")
    if saver is None:
        return DEFAULTS.get(writer)
    if writer == "process" and not isinstance(saver, ProcessSaver):
        raise ConfigError("async_save: writer='process' needs a ProcessSaver as saver=")
    return saver


def close() -> None:
    """Wait for the asynchronous saves in flight on the default savers (if any), then stop the
    writer process (``writer="process"``), free the staging buffers (shared-memory files
    included) and the background process groups. Call it on every rank before
    ``destroy_process_group()``; a later ``async_save`` starts afresh."""
    DEFAULTS.close()
