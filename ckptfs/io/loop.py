"""A private event loop thread that runs ckptfs's coroutines for sync callers.

Running our own loop (like fsspec's "fsspecIO" thread) lets sync ``save``/``load`` work from
inside Jupyter or another running loop, and lets background work continue after they return.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: per-process: the one event loop every store's requests run on (a thread of its own)
_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def get_loop() -> asyncio.AbstractEventLoop:
    """The ckptfs I/O loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="ckptfsIO", daemon=True).start()
            _loop = loop
        return _loop


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


def _reset_after_fork() -> None:
    global _loop
    _loop = None


os.register_at_fork(after_in_child=_reset_after_fork)
