"""A stand-in for a device copy engine, for testing the rings on CPU (test_ring.py, loads;
test_device_parts.py, saves): it copies in a worker thread a little later, as a DMA engine
would, so a buffer reused or read before its copy completed holds the wrong bytes."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch


class LateCopier:
    """Copies in a worker thread a little later; records what it was given and on which
    threads it was called (it is called from several at once)."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.given: list[torch.Tensor] = []
        self.threads: set[str] = set()  # names of the threads that started copies
        self.fail_on = fail_on  # refuse the copy after this many
        self.seen = lambda: None  # called at each copy (the ring's buffers are known then)
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        """Bytes given to copy so far."""
        return sum(s.numel() * s.element_size() for s in self.given)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor):
        with self._lock:
            if self.fail_on is not None and len(self.given) == self.fail_on:
                raise RuntimeError("stand-in copy refused")
            self.given.append(src)
            self.threads.add(threading.current_thread().name)
        self.seen()

        def work() -> None:
            time.sleep(0.001)
            dst.copy_(src)

        fut = self.pool.submit(work)
        return type("Done", (), {"wait": lambda self: fut.result()})()
