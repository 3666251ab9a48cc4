"""A counting semaphore over bytes: bounds the bytes of requests in flight in one store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class ByteBudget:
    """At most ``limit`` bytes held at once; a request larger than the whole budget waits until
    nothing else is held and then runs alone (so it cannot deadlock). Create inside a loop."""

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"byte budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0  #: most bytes ever held at once (for tests and stats)
        self._cond = asyncio.Condition()

    @asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        n = max(0, min(int(nbytes), self.limit))
        async with self._cond:
            await self._cond.wait_for(lambda: self.used + n <= self.limit)
            self.used += n
            self.peak = max(self.peak, self.used)
        try:
            yield
        finally:
            async with self._cond:
                self.used -= n
                self._cond.notify_all()
