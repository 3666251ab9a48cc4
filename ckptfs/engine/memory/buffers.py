"""Where the engines' bytes land: one allocator, leased under a byte budget.

The read engine leases scratch buffers for regions it cannot read in place; the write engine
leases staging buffers for chunks it must copy (non-contiguous or non-CPU data, or every chunk
for an asynchronous save). Both go through a ``BufferPool`` over a ``BufferAllocator``: the
allocator decides what memory is (pageable host memory, or pinned host memory where CUDA
tensors take part: ``allocator_for``), the pool bounds how much of it is held at once. Loads
into CUDA targets lease a fixed ring of pinned buffers from a pool (engine/memory/ring.py).

Call order: ``pool.expect(sizes)`` (optional: the sizes of the leases about to be made, so a
caching allocator drops what they will not reuse) -> ``lease = await pool.lease(nbytes)`` (waits
while the budget is held by others) -> fill or drain ``lease.tensor`` / ``lease.view`` ->
``await pool.release(lease)`` once the last copy into or out of it has completed
(``lease_all`` / ``release_all``: many at once, one budget step). A lease larger
than the whole budget waits until nothing else is held, then runs alone.

Asynchronous saves stage through one long-lived pool over a ``CachingAllocator``: the first
save allocates its staging buffers, every later save of the same structure gets the same
buffers back (no allocation, no page faults), and ``clear()`` frees them (``ckptfs.close()``).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch

from ckptfs.io.budget import ByteBudget


class BufferAllocator(ABC):
    """Makes byte buffers: 1-D ``torch.uint8`` tensors of the requested size (never zeroed)."""

    @abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new buffer of ``nbytes`` bytes."""

    def allocate_all(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """A new buffer of each of ``sizes``, in order; a failure frees those made."""
        out: list[torch.Tensor] = []
        try:
            for n in sizes:
                out.append(self.allocate(n))
        except BaseException:
            self.free_all(out)
            raise
        return out

    def free(self, buffer: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Called when a pool drops ``buffer`` (a caching allocator may keep it)."""

    def free_all(self, buffers: Iterable[torch.Tensor]) -> None:
        """``free`` of each of ``buffers``, in order."""
        for b in buffers:
            self.free(b)

    def expect(self, sizes: Iterable[int]) -> None:  # noqa: B027 - optional hook
        """The sizes of the allocations about to be made (a caching allocator drops the cached
        buffers they will not reuse)."""

    def clear(self) -> None:  # noqa: B027 - optional hook
        """Free whatever the allocator keeps."""

    def typed(self, buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """``buffer`` (one this allocator made) seen as a C-contiguous tensor of ``dtype`` and
        ``shape`` (a view: shares its memory)."""
        return buffer.view(dtype).view(shape)


class HostAllocator(BufferAllocator):
    """Pageable host memory (``torch.empty``)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class PinnedAllocator(BufferAllocator):
    """Page-locked host memory (``torch.empty(..., pin_memory=True)``): the only host memory a
    CUDA copy can use asynchronously. torch's caching host allocator keeps freed blocks for
    the next pinned allocation and rounds sizes up to a power of two. Selected only where a
    CUDA tensor takes part (``allocator_for``), since CPU-only torch cannot pin. Pinning is
    slow (it locks every page): allocate once and reuse."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def allocator_for(tensors: Iterable[torch.Tensor]) -> BufferAllocator:
    """``PinnedAllocator`` when one of ``tensors`` is on a CUDA device, else ``HostAllocator``
    (CPU-only data, or a torch without CUDA, never pins)."""
    if any(t.is_cuda for t in tensors) and torch.cuda.is_available():  # not .device: slower
        return PinnedAllocator()
    return HostAllocator()


class CachingAllocator(BufferAllocator):
    """Keeps the buffers given back to it and hands them out again for allocations of the same
    size: the staging buffers of one save are reused by the next save of the same structure.

    Host memory is bounded by one save's worth: ``expect(sizes)`` (called before a save leases
    its buffers) drops every cached buffer that the coming allocations will not reuse, so a save
    whose structure changed never holds the old buffers beside the new ones. ``clear()`` frees
    everything (thread-safe; the pool calls ``allocate``/``free`` on the I/O loop).
    """

    def __init__(self, inner: BufferAllocator | None = None) -> None:
        self.inner = inner or HostAllocator()
        #: first in, first out: a save gets its buffers in the order the last save of the same
        #: structure released them, so each chunk lands where it did then (a writer process
        #: reuses what it built for that save: engine/background/writer_process.py)
        self._cached: dict[int, deque[torch.Tensor]] = defaultdict(deque)
        self._lock = threading.Lock()
        self.allocations = 0  #: buffers obtained from ``inner`` (reuse keeps this flat)
        #: id of a buffer -> (the buffer, dtype, shape, its view as those): ``typed``'s views,
        #: kept while the buffer is, so a save of the same structure makes none
        self._typed: dict[int, tuple[torch.Tensor, torch.dtype, torch.Size, torch.Tensor]] = {}

    @property
    def cached_bytes(self) -> int:
        """Bytes held in the cache (not leased out)."""
        with self._lock:
            return sum(n * len(bufs) for n, bufs in self._cached.items())

    def expect(self, sizes: Iterable[int]) -> None:
        want = Counter(sizes)
        with self._lock:
            for n in list(self._cached):
                bufs = self._cached[n]
                while len(bufs) > want[n]:
                    dropped = bufs.pop()
                    self._typed.pop(id(dropped), None)
                    self.inner.free(dropped)
                if not bufs:
                    del self._cached[n]

    def allocate(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            bufs = self._cached.get(nbytes)
            if bufs:
                return bufs.popleft()
            self.allocations += 1
        return self.inner.allocate(nbytes)

    def allocate_all(self, sizes: Sequence[int]) -> list[torch.Tensor]:
        """As ``allocate`` for each of ``sizes``, under one hold of the lock (a save leases
        thousands); a failure gives those taken back to the cache."""
        out: list[torch.Tensor | None] = []
        missing: list[int] = []
        with self._lock:
            cached = self._cached
            for i, n in enumerate(sizes):
                bufs = cached.get(n)
                if bufs:
                    out.append(bufs.popleft())
                else:
                    out.append(None)
                    missing.append(i)
        try:
            for i in missing:
                out[i] = self.inner.allocate(sizes[i])
                with self._lock:
                    self.allocations += 1
        except BaseException:
            self.free_all([b for b in out if b is not None])
            raise
        return cast("list[torch.Tensor]", out)

    def free(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._cached[buffer.numel()].append(buffer)

    def free_all(self, buffers: Iterable[torch.Tensor]) -> None:
        with self._lock:  # one lock for a save's thousands of buffers
            cached = self._cached
            for b in buffers:
                cached[b.numel()].append(b)

    def typed(self, buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """As ``BufferAllocator.typed``, but the view made for ``buffer`` the last time is
        handed out again where its dtype and shape are the same (two torch views cost a few
        microseconds, thousands of them a large share of staging a state of small tensors).
        Called on leased buffers only: ``expect`` and ``clear``, which drop cached ones, never
        race with it for the same buffer."""
        got = self._typed.get(id(buffer))
        if got is not None and got[0] is buffer and got[1] is dtype and got[2] == shape:
            return got[3]
        view = buffer.view(dtype).view(shape)
        self._typed[id(buffer)] = (buffer, dtype, shape, view)
        return view

    def clear(self) -> None:
        with self._lock:
            bufs = [b for bs in self._cached.values() for b in bs]
            self._cached.clear()
            self._typed.clear()
        for b in bufs:
            self.inner.free(b)
        self.inner.clear()


@dataclass(frozen=True, slots=True, eq=False)
class Lease:
    """A buffer held from a pool; give it back with ``pool.release``."""

    tensor: torch.Tensor  #: 1-D uint8, exactly ``nbytes`` long
    held: int  #: bytes counted against the pool's budget

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    @property
    def view(self) -> memoryview:
        """A writable byte view of the buffer (shares memory)."""
        if not self.nbytes:
            return memoryview(bytearray())
        return self.tensor.numpy().data.cast("B")


class BufferPool:
    """Leases buffers from ``allocator`` with at most ``limit`` bytes out at once (None: no
    bound, only counted). Create and use inside one event loop (the ckptfs I/O loop)."""

    def __init__(self, allocator: BufferAllocator | None = None, limit: int | None = None) -> None:
        self.allocator = allocator or HostAllocator()
        self.budget = ByteBudget(limit)

    @property
    def peak(self) -> int:
        """Most bytes leased at once so far."""
        return self.budget.peak

    @property
    def waits(self) -> int:
        """Leases that had to wait for others to be released."""
        return self.budget.waits

    def expect(self, sizes: Iterable[int]) -> None:
        """Announce the sizes of the leases about to be made (see ``BufferAllocator.expect``)."""
        self.allocator.expect(sizes)

    async def lease(self, nbytes: int) -> Lease:
        held = await self.budget.acquire(nbytes)
        try:
            return Lease(self.allocator.allocate(nbytes), held)
        except BaseException:
            await self.budget.release(held)
            raise

    async def release(self, lease: Lease) -> None:
        self.allocator.free(lease.tensor)
        await self.budget.release(lease.held)

    async def lease_all(self, sizes: list[int]) -> list[Lease]:
        """A lease of each of ``sizes``, in order (``expect`` first). Without a bound, one
        budget step for all (a save of many small chunks leases thousands at once); with one,
        each in turn. A failure releases those taken."""
        self.expect(sizes)
        if self.budget.limit is not None:
            out: list[Lease] = []
            try:
                for n in sizes:
                    out.append(await self.lease(n))
            except BaseException:
                await self.release_all(out)
                raise
            return out
        total = await self.budget.acquire(sum(sizes))
        try:
            buffers = self.allocator.allocate_all(sizes)  # gives back what it took if it fails
        except BaseException:
            await self.budget.release(total)
            raise
        return list(map(Lease, buffers, sizes))

    async def release_all(self, leases: Sequence[Lease]) -> None:
        """``release`` of each of ``leases``, in order, as one step."""
        self.allocator.free_all([lease.tensor for lease in leases])
        await self.budget.release(sum(lease.held for lease in leases))
