"""Where the engines' bytes land: one allocator, leased under a byte budget.

The read engine leases scratch buffers for regions it cannot read in place; the write engine
leases staging buffers for chunks it must copy (non-contiguous or non-CPU data, or every chunk
for an asynchronous save). Both go through a ``BufferPool`` over a ``BufferAllocator``: the
allocator decides what memory is (pageable host memory, or pinned host memory where CUDA
tensors take part: ``allocator_for``), the pool bounds how much of it is held at once. Loads
into CUDA targets lease a fixed ring of pinned buffers from a pool (engine/ring.py).

Call order: ``lease = await pool.lease(nbytes)`` (waits while the budget is held by others) ->
fill or drain ``lease.tensor`` / ``lease.view`` -> ``await pool.release(lease)`` once the last
copy into or out of it has completed. A lease larger than the whole budget waits until nothing
else is held, then runs alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ckptfs.io.budget import ByteBudget


class BufferAllocator(ABC):
    """Makes byte buffers: 1-D ``torch.uint8`` tensors of the requested size (never zeroed)."""

    @abstractmethod
    def allocate(self, nbytes: int) -> torch.Tensor:
        """A new buffer of ``nbytes`` bytes."""

    def free(self, buffer: torch.Tensor) -> None:  # noqa: B027 - optional hook
        """Called when a pool drops ``buffer`` (a caching allocator may keep it)."""


class HostAllocator(BufferAllocator):
    """Pageable host memory (``torch.empty``)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)


class PinnedAllocator(BufferAllocator):
    """Page-locked host memory (``torch.empty(..., pin_memory=True)``): the only host memory a
    CUDA copy can use asynchronously. torch's caching host allocator keeps freed blocks for
    the next pinned allocation and rounds sizes up to a power of two. Selected only where a
    CUDA tensor takes part (``allocator_for``), since CPU-only torch cannot pin. UNTESTED: no
    GPU machine was available (README, GPU)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def allocator_for(tensors: Iterable[torch.Tensor]) -> BufferAllocator:
    """``PinnedAllocator`` when one of ``tensors`` is on a CUDA device, else ``HostAllocator``
    (CPU-only data, or a torch without CUDA, never pins)."""
    if any(t.device.type == "cuda" for t in tensors) and torch.cuda.is_available():
        return PinnedAllocator()
    return HostAllocator()


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
        return memoryview(self.tensor.numpy()).cast("B")


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
