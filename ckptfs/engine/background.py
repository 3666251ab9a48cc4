"""Where asynchronous saves run: one background thread per save, at most one save in flight
per process, and the staging pool that keeps its buffers from one save to the next.

Call order: ``with next_slot():`` (waits until the save in flight, if any, is done) ->
``staged, done = launch(job)`` (starts ``job(on_copied)`` in a new thread; ``on_copied`` resolves
``staged``, the job's return value resolves ``done``, an exception resolves both that are still
pending) -> later ``wait_idle()`` (what a synchronous save does first) or ``close()``.

An interpreter that exits with a save in flight waits for it, so the save commits or fails,
never half-commits: the wait is a ``threading`` exit hook, which runs before the thread pools
behind the I/O layer's ``asyncio.to_thread`` stop taking work (a plain ``atexit`` handler or a
non-daemon thread alone would run after them, and the save would fail writing).

Why a thread and not a writer process: the background work is copies and file I/O (the GIL is
released) and a crc32c computed without the GIL; once staged, the save's threads run at
``IOConfig.background_nice`` so a busy CPU serves the training loop first (async_save.py,
io/local_store.py). Measured by ``bench/async_save.py`` (docs/performance.md).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - imported before our exit hook is registered
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TypeVar

from ckptfs.dist import destroy_background_groups
from ckptfs.engine.buffers import BufferAllocator, BufferPool, CachingAllocator
from ckptfs.io import run_sync
from ckptfs.io.local_store import background_writes

T = TypeVar("T")

_lock = threading.RLock()  # held while a save is being started, and by close()
_current: Future | None = None  # ``done`` of the latest save started
_pool: BufferPool | None = None


def staging_pool(inner: BufferAllocator | None = None) -> BufferPool:
    """The pool asynchronous saves stage into: unbounded (a save leases exactly the bytes its
    rank writes), over a caching allocator so later saves of the same structure reuse the
    buffers of the first. ``inner`` makes the buffers (``staging_allocator``: pinned for CUDA
    sources); when a save needs another kind than the cached one, the cached buffers are freed
    and the pool is made anew (None: the pool as it is, over host memory if there is none yet).
    Call inside ``next_slot()`` (no save is using the pool)."""
    global _pool
    with _lock:
        if (_pool is not None and inner is not None
                and type(_pool.allocator.inner) is not type(inner)):
            _pool.allocator.clear()
            _pool = None
        if _pool is None:
            async def make() -> BufferPool:  # created on the I/O loop, where it is used
                return BufferPool(CachingAllocator(inner))

            _pool = run_sync(make())
        return _pool


def _wait_current() -> None:
    if _current is not None:
        _current.exception()  # waits; the outcome belongs to that save's handle


def wait_idle() -> None:
    """Wait until no save runs in the background (its outcome is not raised here)."""
    with _lock:
        _wait_current()


@contextmanager
def next_slot() -> Iterator[None]:
    """The right to start the next background save: waits for the one in flight first."""
    with _lock:
        _wait_current()
        yield


def launch(job: Callable[[Callable[[], None]], T]) -> tuple[Future[None], Future[T]]:
    """Run ``job(on_copied)`` in a background thread (call inside ``next_slot()``)."""
    global _current
    staged: Future[None] = Future()
    done: Future[T] = Future()
    staged.set_running_or_notify_cancel()  # running futures cannot be cancelled
    done.set_running_or_notify_cancel()

    def on_copied() -> None:
        if not staged.done():
            staged.set_result(None)

    def run() -> None:
        try:
            with background_writes():  # local data files: IOConfig.background_nice
                result = job(on_copied)
        except BaseException as e:  # handed to the caller through the futures
            if not staged.done():
                staged.set_exception(e)
            done.set_exception(e)
        else:
            on_copied()
            done.set_result(result)

    with _lock:
        _current = done
        threading.Thread(target=run, name="ckptfsSave", daemon=False).start()
    return staged, done


def close() -> None:
    """Wait for the save in flight, then free the staging buffers and the background groups."""
    with _lock:
        _wait_current()
        if _pool is not None:
            _pool.allocator.clear()
        destroy_background_groups()


def _wait_at_exit() -> None:
    if _current is not None:
        _current.exception()


# threading's exit hooks run in reverse order of registration: ours before the thread pools'
getattr(threading, "_register_atexit", atexit.register)(_wait_at_exit)


@atexit.register
def _at_exit() -> None:
    # the save in flight was waited for above; leave torch.distributed alone
    if _pool is not None:
        _pool.allocator.clear()
