"""A ring of host buffers through which a load fills device tensors.

Bytes read from storage land in one of ``slots`` host buffers of ``slot_bytes`` each (pinned
memory for CUDA, leased once from the engine's ``BufferPool``); a ``Copier`` starts the copy
from the buffer into the target and returns a ``Completion``. A buffer goes back into the ring
only when every copy out of it has completed, so storage reads into the next buffer overlap the
copies out of earlier ones, and the host memory held is the ring: ``slots * slot_bytes``, never
a copy of the state. The read schedule splits pieces larger than a slot (engine/load/schedule.py).

Call order (one event loop, the ckptfs I/O loop): ``lease = await ring.lease(nbytes)`` (waits
for a free buffer; ``nbytes <= slot_bytes``) -> fill ``lease.view`` -> ``ring.copier(dst, src)``
for each region, collecting the completions -> ``await ring.release(lease, completions)``
(returns at once; the buffer is reused once they complete) -> ``await ring.close()`` (waits for
every copy, gives the buffers back to the pool, raises the first copy error).

``CudaCopier`` is the CUDA copy: a ``non_blocking`` copy on a dedicated stream per device. A
copier may offer ``fence()``: a completion of every copy it started so far; the ring then waits
for one fence per released buffer instead of one completion per copy (on CUDA, one event per
buffer: creating and recording an event per copy costs more than a small copy).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from ckptfs.engine.memory.buffers import BufferPool, Lease


class Completion(Protocol):
    """The end of one asynchronous copy."""

    def wait(self) -> None:
        """Block until the copy completed; raise its error if it failed."""


#: Starts copying the host tensor ``src`` (a contiguous view of a ring buffer) into ``dst``
#: (same dtype and shape) and returns its completion; a copy that fails at once raises.
Copier = Callable[[torch.Tensor, torch.Tensor], Completion]


class Ring:
    """``slots`` reusable host buffers of ``slot_bytes`` each, leased from ``pool``, for targets
    on ``device_type`` (e.g. "cuda"), whose copies ``copier`` makes."""

    def __init__(self, pool: BufferPool, copier: Copier, *, slots: int, slot_bytes: int,
                 device_type: str, on_close: Callable[[], None] | None = None) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs at least one slot of at least one byte, got "
                             f"{slots} x {slot_bytes}")
        self.pool = pool
        self.copier = copier
        self.slots = slots
        self.slot_bytes = slot_bytes
        self.device_type = device_type
        self._on_close = on_close
        self._buffers: list[Lease] = []  # every buffer leased so far (at most ``slots``)
        self._made = 0  # slots leased or being leased
        self._free: list[Lease] = []
        self._out: dict[int, Lease] = {}  # id(handed-out lease) -> its buffer
        self._waiters: set[asyncio.Task] = set()
        self._error: BaseException | None = None
        self._cond: asyncio.Condition | None = None
        self.reuses = 0  #: leases served by a buffer that had been used before

    @property
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The slots' buffers leased so far (until ``close``)."""
        return tuple(b.tensor for b in self._buffers)

    def accepts(self, target: torch.Tensor) -> bool:
        """Whether regions of ``target`` go through the ring."""
        return target.device.type == self.device_type

    @property
    def cond(self) -> asyncio.Condition:
        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def lease(self, nbytes: int) -> Lease:
        """A buffer of ``nbytes`` (a view of a free slot); waits until one is free."""
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a ring slot of {self.slot_bytes}")
        buf: Lease | None = None
        async with self.cond:
            while True:
                self._raise()
                if self._free:
                    buf = self._free.pop()
                    self.reuses += 1
                    break
                if self._made < self.slots:
                    self._made += 1  # a new slot, leased below (not holding the condition)
                    break
                await self.cond.wait()
        if buf is None:
            try:
                buf = await self.pool.lease(self.slot_bytes)
            except BaseException:
                self._made -= 1
                raise
            self._buffers.append(buf)
        out = Lease(buf.tensor[:nbytes], 0)
        self._out[id(out)] = buf
        return out

    async def release(self, lease: Lease, pending: Sequence[Completion] = ()) -> None:
        """The buffer of ``lease`` returns to the ring once every copy in ``pending`` completed
        (returns at once; a copy error is kept for ``close`` and the next ``lease``)."""
        buf = self._out.pop(id(lease))
        if not pending:
            await self._put_back(buf)
            return
        fence = getattr(self.copier, "fence", None)
        if fence is not None:  # the copies out of the buffer were started before now
            pending = [fence()]
        task = asyncio.create_task(self._wait_then_put_back(buf, list(pending)))
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)

    async def _wait_then_put_back(self, buf: Lease, pending: list[Completion]) -> None:
        try:
            await asyncio.to_thread(_wait_all, pending)
        except BaseException as e:
            if self._error is None:
                self._error = e
        await self._put_back(buf)

    async def _put_back(self, buf: Lease) -> None:
        async with self.cond:
            self._free.append(buf)
            self.cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    async def close(self, *, quiet: bool = False) -> None:
        """Wait for every copy, give the buffers back to the pool, raise the first copy error
        (not with ``quiet``: the caller is already raising another)."""
        try:
            while self._waiters:
                await asyncio.gather(*self._waiters, return_exceptions=True)
            if self._on_close is not None:  # also after an error: nothing may be in flight
                try:
                    await asyncio.to_thread(self._on_close)
                except BaseException as e:
                    self._error = self._error or e
        finally:
            for buf in self._buffers:
                await self.pool.release(buf)
            self._buffers.clear()
            self._free.clear()
            self._made = 0
        if not quiet:
            self._raise()


def _wait_all(pending: Iterable[Completion]) -> None:
    first: BaseException | None = None
    for c in pending:  # wait for all, even after a failure: the buffer must be idle
        try:
            c.wait()
        except BaseException as e:
            first = first or e
    if first is not None:
        raise first


class SideStreams:
    """One CUDA side stream per device, made at its first use: it first waits for the work
    queued on the device's current stream of the thread that made it, so the copies queued on
    it run after what the caller had queued (which may still be writing the data). Shared by
    the copies of loads (``CudaCopier``), streamed saves (``device_parts.CudaD2H``) and staging
    (``stage.DeviceToHost``); safe to use from several threads at once."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._lock = threading.Lock()

    def get(self, device: torch.device) -> torch.cuda.Stream:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
            return stream

    def items(self) -> list[tuple[torch.device, torch.cuda.Stream]]:
        """(device, side stream) of every stream made so far."""
        with self._lock:
            return list(self._streams.items())

    def record(self) -> list[torch.cuda.Event]:
        """A CUDA event recorded after the work queued so far, on each side stream."""
        events = []
        for _, stream in self.items():
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events


class CudaCopier:
    """Host-to-device copies on a dedicated CUDA stream per target device.

    A side stream, made at the first copy to its device, first waits for the work already
    queued on the device's current stream of the engine's worker threads (the default stream;
    a target written on a stream of the caller's own must be synchronized before the load).
    Each copy is ``dst.copy_(src, non_blocking=True)`` on it; ``src`` is a view of a pinned
    ring buffer, so the copy is asynchronous. A ``dst`` that is not contiguous gets a
    device-side temporary of the region's size from torch (a slot at most), never a host copy.
    ``fence`` records one event per side stream (the ring asks once per buffer). ``finish``
    makes each current stream wait for its side stream and synchronizes the side streams, so
    the targets are ready when the load returns.
    """

    def __init__(self) -> None:
        self.streams = SideStreams()  # called from several worker threads at once

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        with torch.cuda.stream(self.streams.get(dst.device)):
            dst.copy_(src, non_blocking=True)
        return _FENCED

    def fence(self) -> Completion:
        """Completes once every copy started so far completed."""
        return CudaEvents(self.streams.record())

    def finish(self) -> None:
        for device, stream in self.streams.items():
            torch.cuda.current_stream(device).wait_stream(stream)
            stream.synchronize()


class CudaEvents:
    """The completion of the work recorded by ``events`` (CUDA events)."""

    __slots__ = ("events",)

    def __init__(self, events: list[torch.cuda.Event]) -> None:
        self.events = events

    def wait(self) -> None:
        for e in self.events:
            e.synchronize()


class _Fenced:
    """The completion of a copy whose copier offers ``fence`` (waited for through it)."""

    __slots__ = ()

    def wait(self) -> None:
        raise RuntimeError("wait for a fenced copy through its copier's fence()")


_FENCED = _Fenced()


class Done:
    """The completion of a copy that already finished (synchronous copiers)."""

    __slots__ = ()

    def wait(self) -> None:
        return None


def pinned_slot_bytes(ring_bytes: int, slots: int) -> int:
    """The bytes of each of ``slots`` pinned buffers sharing ``ring_bytes``: the share rounded
    down to a power of two (the sizes torch's caching host allocator pins)."""
    return 1 << max(0, (ring_bytes // slots).bit_length() - 1)


def cuda_ring(targets: Iterable[torch.Tensor], *, ring_bytes: int, slots: int) -> Ring | None:
    """A pinned ring for the CUDA targets among ``targets``; None when there are none, so a
    load into CPU tensors never touches CUDA (and never pins memory)."""
    if not any(t.device.type == "cuda" for t in targets):
        return None
    from ckptfs.engine.memory.buffers import PinnedAllocator

    copier = CudaCopier()
    slot = pinned_slot_bytes(ring_bytes, slots)
    return Ring(BufferPool(PinnedAllocator(), limit=slot * slots), copier, slots=slots,
                slot_bytes=slot, device_type="cuda", on_close=copier.finish)
