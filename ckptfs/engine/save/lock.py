"""The save lock (formats/README.md §8 step 2): one save at a time per checkpoint root.

The coordinator creates ``ckptfs.lock`` create-if-absent before any data is written and removes
it once the index is committed (or the save failed). A second save to the same root meanwhile
is refused (``SaveInProgressError``) before it writes anything, so two jobs saving to one URL
never mix files, whatever the backend (zarr's chunk paths and DCP's ``.metadata`` are the same
for every save). A lock whose save died is taken over: while a save runs, its coordinator
rewrites the lock every ``RENEW_SECONDS``; one not renewed for ``LEASE_SECONDS``, or held by a
process of this host that no longer exists, is stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Literal

from ckptfs.errors import SaveInProgressError
from ckptfs.io.loop import run_sync
from ckptfs.io.store import Store
from ckptfs.layout.index import LOCK_FILE

LEASE_SECONDS = 300.0  #: a lock not renewed for this long belongs to a save that died
RENEW_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What ``ckptfs.lock`` says: which save holds the root, and since when."""

    save_id: str
    backend: str  #: "<name>-<version>"
    host: str
    pid: int
    started: float  #: seconds since the epoch (the holder's clock)
    renewed: float

    def dumps(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def loads(cls, data: bytes) -> LockInfo | None:
        """The lock's content, or None when it cannot be read (being rewritten, damaged)."""
        try:
            d = json.loads(bytes(data))
            return cls(str(d["save_id"]), str(d["backend"]), str(d["host"]), int(d["pid"]),
                       float(d["started"]), float(d["renewed"]))
        except (ValueError, KeyError, TypeError):
            return None

    @classmethod
    def new(cls, save_id: str, backend: str) -> LockInfo:
        now = time.time()
        return cls(save_id, backend, socket.gethostname(), os.getpid(), now, now)

    def stale(self, now: float | None = None) -> bool:
        """Its save is gone: not renewed within the lease, or its process on this host is dead."""
        now = time.time() if now is None else now
        if now - self.renewed > LEASE_SECONDS:
            return True
        return self.host == socket.gethostname() and not _alive(self.pid)

    def describe(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        return (f"save {self.save_id} ({self.backend}) by process {self.pid} on {self.host}, "
                f"started {now - self.started:.0f} s ago, last renewed {now - self.renewed:.0f} s ago")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def read_lock(store: Store) -> LockInfo | Literal[False] | None:
    """The lock at the root: its info, None when unreadable, False when there is none."""
    try:
        data = await store.get(LOCK_FILE)
    except FileNotFoundError:
        return False
    return LockInfo.loads(bytes(data))


async def acquire(store: Store, info: LockInfo) -> None:
    """Create the lock, or take over a stale one; raise SaveInProgressError while another save
    holds it."""
    for _ in range(2):
        try:
            await store.put_if_absent(LOCK_FILE, info.dumps())
            return
        except FileExistsError:
            held = await read_lock(store)
            if held is False:
                continue  # released meanwhile: try again
            if held is None or not held.stale():
                who = held.describe() if held else "a save whose lock cannot be read"
                raise SaveInProgressError(
                    f"{store.full_path(LOCK_FILE)}: another save to {store.url} has not finished "
                    f"({who}): a job is saving there now, or one died less than "
                    f"{LEASE_SECONDS:.0f} s ago on another host. Nothing was written; save again "
                    f"later, or remove the lock with `ckptfs clean {store.url} --force` if no job "
                    f"is saving there") from None
            await store.delete([LOCK_FILE])  # stale: its save died; take over
    raise SaveInProgressError(f"{store.full_path(LOCK_FILE)}: another save took the lock first")


async def release(store: Store) -> None:
    await store.delete([LOCK_FILE])


class Renewal:
    """Rewrites the lock every ``RENEW_SECONDS`` while a save runs (coordinator, I/O loop).
    ``stop`` returns once no rewrite is in flight, so a released lock is never rewritten."""

    def __init__(self, store: Store, info: LockInfo) -> None:
        self._stop: asyncio.Event | None = None
        self._task = run_sync(self._start(store, info))

    @classmethod
    async def begin(cls, store: Store, info: LockInfo) -> Renewal:
        """A renewal started from a coroutine on the I/O loop (the claim's own step)."""
        self = cls.__new__(cls)
        self._stop = None
        self._task = await self._start(store, info)
        return self

    async def _start(self, store: Store, info: LockInfo) -> asyncio.Task[None]:
        self._stop = asyncio.Event()
        return asyncio.get_running_loop().create_task(self._run(store, info, self._stop))

    @staticmethod
    async def _run(store: Store, info: LockInfo, stop: asyncio.Event) -> None:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), RENEW_SECONDS)
                return
            except TimeoutError:
                pass
            with contextlib.suppress(Exception):  # a missed renewal only shortens the lease
                info = LockInfo(info.save_id, info.backend, info.host, info.pid, info.started,
                                time.time())
                await store.put(LOCK_FILE, [info.dumps()])

    async def halt(self) -> None:
        """Stop renewing (on the I/O loop); returns once no rewrite is in flight."""
        assert self._stop is not None
        self._stop.set()
        await self._task

    def stop(self) -> None:
        if not self._task.done():  # the commit halts it on the I/O loop itself
            run_sync(self.halt())


#: the renewal of the lock the current ``claimed`` block holds (coordinator): the commit halts
#: it before it releases the lock, so that no rewrite in flight brings a released lock back
#: (the next save would find it held). A context variable, set and reset by that block only.
HELD: ContextVar[Renewal | None] = ContextVar("ckptfs_lock_renewal", default=None)
