"""A private event loop thread that runs ckptfs's coroutines for sync callers.

Running our own loop (like fsspec's "fsspecIO" thread) lets sync ``save``/``load`` work from
inside Jupyter or another running loop, and lets background work continue after they return.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, TypeVarTuple, Unpack

from ckptfs.runtime import RUNTIME, Resource

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

#: how long interpreter exit waits for a thread still handing a result to the loop
EXIT_GRACE = 5.0


class IOLoop(asyncio.SelectorEventLoop):
    """The I/O loop, counting the threads inside ``call_soon_threadsafe``.

    A native client's worker thread (obstore's tokio threads, through pyo3) hands each result to
    the loop with ``call_soon_threadsafe``; the loop can run the callback, and the program reach
    its end, while that thread still waits for the GIL after writing the loop's wake-up byte.
    Before Python 3.14 a thread that takes the GIL during interpreter finalization is ended with
    ``pthread_exit``, which aborts the process when Rust frames are on its stack. At exit the
    main thread therefore waits (GIL released) until no thread is inside that call.
    """

    def __init__(self) -> None:
        super().__init__()
        self._handing = 0
        self._handed = threading.Condition()

    def call_soon_threadsafe(self, callback: Callable[[Unpack[Ts]], object], *args: *Ts,
                             context: contextvars.Context | None = None) -> asyncio.Handle:
        with self._handed:
            self._handing += 1
        try:
            return super().call_soon_threadsafe(callback, *args, context=context)
        finally:
            with self._handed:
                self._handing -= 1
                self._handed.notify_all()

    def wait_handed(self, timeout: float) -> bool:
        """Wait until no thread is inside ``call_soon_threadsafe``; False on ``timeout``."""
        with self._handed:
            return self._handed.wait_for(lambda: self._handing == 0, timeout)


def _start_loop() -> IOLoop:
    loop = IOLoop()
    threading.Thread(target=loop.run_forever, name="ckptfsIO", daemon=True).start()
    atexit.register(loop.wait_handed, EXIT_GRACE)
    return loop


#: the one event loop every store's requests run on (a thread of its own). ``ckptfs.close()``
#: leaves it running: stores the caller opened (a manager's) are bound to it. A forked child
#: starts its own.
LOOP: Resource[asyncio.AbstractEventLoop] = Resource(
    "the I/O loop", _start_loop, closed="is_closed")


def get_loop() -> asyncio.AbstractEventLoop:
    """The ckptfs I/O loop, started on first use."""
    return RUNTIME.get(LOOP)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the I/O loop and wait for its result."""
    loop = get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        raise RuntimeError("run_sync called from the ckptfs I/O loop itself")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Start ``coro`` on the I/O loop and return at once; the caller can work meanwhile."""
    return asyncio.run_coroutine_threadsafe(coro, get_loop())
