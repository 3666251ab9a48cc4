"""``ckptfs.async_save``: the same save, run in the background. The call returns at once with
two futures: ``staged`` (this rank's bytes are copied: the caller may change its tensors) and
``done`` (the index is committed; its result is the ``SaveResult``).

The save is ``save()``'s pipeline (engine/save/pipeline.py: stage -> claim -> write -> commit, the
same ``SaveRequest``) with two differences: staging
copies every chunk this rank writes into the reusable staging buffers of a ``BackgroundSaver``
(engine/background/saver.py), and every phase runs over a gloo group of its own (dist/groups.py),
never over the caller's group, so the training loop can run its collectives meanwhile. At most
one save is in flight per saver: a new ``async_save`` on it (and ``save``, for the default
saver) first waits for the previous one's ``done``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ckptfs.dist import ProcessGroup
from ckptfs.engine.background.defaults import default_saver
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.engine.background.writer_process import ProcessSaver
from ckptfs.engine.options import SaveOptions
from ckptfs.errors import ConfigError
from ckptfs.io import StoreOptions
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.runtime import RUNTIME
from ckptfs.save import SaveResult, save_request


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
    url = os.fspath(url)
    request = save_request(url, backend, backend_version, backend_options, storage_options,
                           store_options, overwrite, progress, options,
                           check_finite=check_finite, stats=stats, writer=writer,
                           host_memory_limit=host_memory_limit, caller="async_save")
    saver = _saver(saver, request.options.writer)
    staged, done = saver.start(state_dict, request, process_group=process_group)
    return AsyncSave(url, staged, done)


def _saver(saver: BackgroundSaver | None, writer: str) -> BackgroundSaver:
    if writer not in ("thread", "process"):
        raise ConfigError(f"async_save: writer must be 'thread' or 'process', got {writer!r}")
    if saver is None:
        return default_saver(writer)
    if writer == "process" and not isinstance(saver, ProcessSaver):
        raise ConfigError("async_save: writer='process' needs a ProcessSaver as saver=")
    return saver


def close() -> None:
    """Close this process's runtime (ckptfs/runtime.py): wait for the asynchronous saves in
    flight on the default savers (if any), then stop the writer process (``writer="process"``),
    free the staging buffers (shared-memory files included) and the background process groups,
    end the copy and niced write threads, and drop the plan cache and the S3 session. Call it
    on every rank before ``destroy_process_group()``; a later save or ``async_save`` starts
    afresh. The I/O loop, the registries and the foreground groups are kept."""
    RUNTIME.close()
