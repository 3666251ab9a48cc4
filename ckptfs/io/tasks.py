"""``gather_all``: asyncio.gather that leaves nothing running behind a failure."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any


async def gather_all(*aws: Awaitable[Any]) -> list[Any]:
    """Await all; on the first failure cancel the others and wait for them before raising it.

    Plain ``asyncio.gather`` lets the siblings of a failed task keep running: after a failed
    save or load they would go on writing objects, filling targets or using a closed client.
    Unlike ``TaskGroup`` the first exception is raised as is (no ExceptionGroup).
    """
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
