"""A counting semaphore over bytes: bounds the bytes of requests in flight in one store, and the
scratch and staging memory the engines lease (engine/memory/buffers.py). The one implementation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ByteBudget:
    """At most ``limit`` bytes held at once; a request larger than the whole budget waits until
    nothing else is held and then runs alone (so it cannot deadlock). ``limit=None`` never
    waits (it only counts). Create and use inside one event loop."""

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0  #: most bytes ever held at once (for tests and stats)
        self.waits = 0  #: acquisitions that had to wait for others to release
        self._cond = asyncio.Condition()

    def _clamp(self, nbytes: int) -> int:
        n = max(0, int(nbytes))
        return n if self.limit is None else min(n, self.limit)

    async def acquire(self, nbytes: int) -> int:
        """Wait until ``nbytes`` fit, take them; returns the amount to pass to ``release``."""
        n = self._clamp(nbytes)
        async with self._cond:
            if not self._fits(n):
                self.waits += 1
                await self._cond.wait_for(lambda: self._fits(n))
            self.used += n
            self.peak = max(self.peak, self.used)
        return n

    def _fits(self, n: int) -> bool:
        return self.limit is None or self.used + n <= self.limit

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        n = await self.acquire(nbytes)
        try:
            yield
        finally:
            await self.release(n)
