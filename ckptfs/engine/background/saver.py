"""``BackgroundSaver``: where asynchronous saves run. It owns the staging pool (buffers kept from
one save to the next), the save in flight (at most one per saver) and the exit hook that lets
a save in flight finish when the interpreter exits.

Call order: ``saver.start(state_dict, request, ...)`` (waits until the saver's save in flight,
if any, is done; makes the Comm on the saver's own background lane; stages in a new thread; returns the
``staged`` and ``done`` futures) -> later ``saver.wait_idle()`` (what a synchronous save does
first) or ``saver.close()`` (every rank: waits, frees the buffers and the lane's groups).

``ckptfs.async_save`` uses the per-process default saver (engine/background/defaults.py); each
``CheckpointManager`` has its own unless one is passed. Two savers run their saves at once, each
on a gloo group of its own (``lane``), so their collectives never interleave.

An interpreter that exits with a save in flight waits for it, so the save commits or fails,
never half-commits: the wait is a ``threading`` exit hook, which runs before the thread pools
behind the I/O layer's ``asyncio.to_thread`` stop taking work (a plain ``atexit`` handler or a
non-daemon thread alone would run after them, and the save would fail writing).

Why a thread: the background work is copies and file I/O (the GIL is released) and a crc32c
computed without the GIL; once staged, the save's thread and its store's write threads run at
``SaveOptions.background_nice`` so a busy CPU serves the training loop first.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - imported before our exit hooks are registered
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, TypeVar

from ckptfs.dist import BACKGROUND, Comm, ProcessGroup, destroy_background_groups
from ckptfs.engine.errors import public_errors
from ckptfs.engine.memory.buffers import BufferAllocator, BufferPool, CachingAllocator
from ckptfs.engine.memory.overflow import Overflow, bounded
from ckptfs.engine.options import SaveOptions
from ckptfs.engine.save.pipeline import SaveRequest, SaveResult, finish_staged, stage_phase
from ckptfs.engine.save.stage import StagedSave, release, staging_allocator
from ckptfs.io import run_sync
from ckptfs.io.local_store import lower_priority
from ckptfs.layout.backend import Backend

T = TypeVar("T")

#: the longest a save's thread waits, once ``staged`` resolves, for the threads blocked in
#: ``staged.result()`` to return (``Staged.hand_over``)
HAND_OVER = 0.02



class Staged(Future[None]):
    """``staged`` of a background save. ``queued`` resolves earlier where the state is on
    CUDA: with the CUDA events recorded after its device-to-host copies, once the CPU copies
    are done and the CUDA copies queued on their side streams (with ``()`` when ``staged``
    resolves first: nothing was copied from CUDA, or a ``host_memory_limit`` streams chunks
    later). A stream that waits on those events runs its later work after the copies."""

    def __init__(self) -> None:
        super().__init__()
        self.queued: Future[tuple[Any, ...]] = Future()
        self._waiting = 0  #: threads inside ``result()``
        self._count = threading.Lock()

    def result(self, timeout: float | None = None) -> None:
        with self._count:
            self._waiting += 1
        try:
            return super().result(timeout)
        finally:
            with self._count:
                self._waiting -= 1

    def hand_over(self, most: float = HAND_OVER) -> bool:
        """Once resolved: wait, without the GIL, until every thread blocked in ``result()`` has
        returned (at most ``most`` seconds); whether none is left. Woken, such a thread (the
        training loop) still needs the GIL, and the save's thread going on at once with Python
        or C-level work would hold it (until the interpreter's switch interval asks it back, or
        longer inside one C call): the caller's wait would end milliseconds late."""
        deadline = time.monotonic() + most
        while self._waiting:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0002)
        return True

    def resolve_queued(self, events: tuple[Any, ...] = (), error: BaseException | None = None
                       ) -> None:
        if self.queued.done():
            return
        if error is not None:
            self.queued.set_exception(error)
        else:
            self.queued.set_result(events)


class BackgroundSaver:
    """Runs asynchronous saves one at a time, on a background gloo lane of its own.

    ``lane``: the name of its process groups; every rank creates its savers with the same
    lanes (the default saver's is ``"background"``, a manager's names its URL)."""

    def __init__(self, lane: str = BACKGROUND) -> None:
        self.lane = lane
        self._lock = threading.RLock()  # held while a save is being started, and by close()
        self._current: Future | None = None  # ``done`` of the latest save started
        self._pool: BufferPool | None = None
        self._hooked = False

    # -- the staging pool ------------------------------------------------------------------
    def staging_pool(self, inner: BufferAllocator | None = None) -> BufferPool:
        """The pool saves stage into: unbounded (a save leases exactly the bytes its rank
        writes), over a caching allocator so later saves of the same structure reuse the
        buffers of the first. ``inner`` makes the buffers (``staging_allocator``: pinned for
        CUDA sources); when a save needs another kind than the cached one, the cached buffers
        are freed and the pool is made anew (None: the pool as it is, over host memory if there
        is none yet)."""
        with self._lock:
            pool = self._pool
            cached = pool.allocator if pool is not None else None
            if (isinstance(cached, CachingAllocator) and inner is not None
                    and type(cached.inner) is not type(inner)):
                cached.clear()
                pool = None
            if pool is None:
                async def make() -> BufferPool:  # created on the I/O loop, where it is used
                    return BufferPool(CachingAllocator(inner))

                pool = run_sync(make())
            self._pool = pool
            return pool

    # -- saves -----------------------------------------------------------------------------
    def wait_idle(self) -> None:
        """Wait until this saver runs no save (its outcome is not raised here)."""
        with self._lock:
            self._wait_current()

    def _wait_current(self) -> None:
        if self._current is not None:
            self._current.exception()  # waits; the outcome belongs to that save's handle

    def start(self, state_dict: Mapping[str, Any], request: SaveRequest, *,
              process_group: ProcessGroup | None,
              before: Callable[[Comm], None] | None = None,
              after: Callable[[SaveResult, Comm], SaveResult] | None = None
              ) -> tuple[Future[None], Future[SaveResult]]:
        """Start one background save of ``state_dict`` as ``request`` says (every rank calls
        this in the same order): waits for the save in flight, connects the lane's group, then
        in a thread runs the pipeline's stage phase (engine/save/pipeline.py) into copies
        (``staged`` resolves), lowers the thread's priority, runs ``before(comm)``, the
        pipeline's ``finish_staged`` (``finish``: here or in a writer process) and
        ``after(result, comm)`` (``done`` resolves with its result). ``before`` and ``after``
        run in this process, on the save's thread (a manager's steps around the save)."""
        opts, url = request.options, request.url
        with self._lock:
            self._wait_current()
            with public_errors(url):  # creates the lane's group on the first call
                comm = Comm(process_group, timeout=opts.collective_timeout, background=self.lane)
            pool = self.staging_pool(staging_allocator(state_dict))  # pinned for CUDA sources
            held = [state_dict]  # let go of the caller's tensors once staged
            overflow = self.bounded(opts, request.backend)

            def job(on_copied: Callable[[], None], marker: Staged) -> SaveResult:
                with public_errors(url):
                    staged = stage_phase(held.pop(), request, comm, pool, copy=True,
                                         on_copied=on_copied, overflow=overflow,
                                         on_queued=None if overflow is not None
                                         else lambda events: marker.resolve_queued(tuple(events)))
                    self.lower_priority(opts.background_nice)  # the caller goes on
                    given: list[StagedSave] = [staged]

                    def give_back() -> None:
                        if given:
                            release(given.pop(), pool)

                    try:
                        if before is not None:
                            before(comm)
                        result = self.finish(request, staged, comm, give_back)
                    finally:
                        give_back()
                    return result if after is None else after(result, comm)

            return self.launch(job)

    def bounded(self, options: SaveOptions, be: Backend) -> Overflow | None:
        """The overflow of a save under ``options.host_memory_limit`` (None: no bound; a saver
        of another kind streams it otherwise: engine/memory/shared_ring.py)."""
        return bounded(options, be)

    def lower_priority(self, nice: int) -> None:
        """Once staged: the save's work runs at nice ``nice`` (here: this thread's)."""
        lower_priority(nice)

    def finish(self, request: SaveRequest, staged: StagedSave, comm: Comm,
               give_back: Callable[[], None]) -> SaveResult:
        """Run the pipeline's ``finish_staged`` once staged: here, in the save's thread (a
        saver of another kind runs it elsewhere: engine/background/writer_process.py)."""
        return finish_staged(request, staged, comm, give_back)

    def launch(self, job: Callable[[Callable[[], None], Staged], T]
               ) -> tuple[Future[None], Future[T]]:
        """Run ``job(on_copied, staged)`` in a new thread once the save in flight is done:
        ``on_copied()`` resolves ``staged`` (a ``Staged``: the job may resolve its ``queued``
        first) and lets the threads waiting for it return before the job goes on
        (``Staged.hand_over``), the job's result ``done``, an exception both that are pending
        (what ``start`` runs; a writer of another kind may launch its own job)."""
        staged = Staged()
        done: Future[T] = Future()
        for f in (staged, staged.queued, done):
            f.set_running_or_notify_cancel()  # running futures cannot be cancelled

        def on_copied() -> None:
            staged.resolve_queued()
            if not staged.done():
                staged.set_result(None)
                staged.hand_over()

        def run() -> None:
            try:
                result = job(on_copied, staged)
            except BaseException as e:  # handed to the caller through the futures
                staged.resolve_queued(error=e)
                if not staged.done():
                    staged.set_exception(e)
                done.set_exception(e)
            else:
                on_copied()
                done.set_result(result)

        with self._lock:
            self._wait_current()
            self._hook_exit()
            self._current = done
            threading.Thread(target=run, name="ckptfsSave", daemon=False).start()
        return staged, done

    def _hook_exit(self) -> None:
        """Once per saver: at exit, wait for its save in flight, then free its buffers."""
        if not self._hooked:
            # threading's exit hooks run in reverse order of registration: before the pools'
            getattr(threading, "_register_atexit", atexit.register)(self._wait_at_exit)
            atexit.register(self._free_at_exit)
            self._hooked = True

    # -- lifecycle -------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the save in flight, then free the staging buffers and the lane's process
        groups (every rank calls it; a later save starts afresh)."""
        with self._lock:
            self._wait_current()
            if self._pool is not None:
                self._pool.allocator.clear()
            destroy_background_groups(self.lane)

    def _wait_at_exit(self) -> None:
        self._wait_current()

    def _free_at_exit(self) -> None:
        # the save in flight was waited for above; leave torch.distributed alone
        if self._pool is not None:
            self._pool.allocator.clear()

