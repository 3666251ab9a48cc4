"""``gather_all``: asyncio.gather that leaves nothing running behind a failure; ``settled``:
an await that, when cancelled, still waits for the work it awaited."""

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


async def settled(fut: asyncio.Future[Any]) -> Any:
    """``fut``'s result; if the caller is cancelled, wait for ``fut`` (threads writing into or
    copying out of buffers) before passing the cancellation on, so that nothing touches a
    buffer after its owner gave it back (scratch is reused as soon as the caller returns)."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        raise
