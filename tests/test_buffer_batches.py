"""``BufferPool.lease_all`` / ``release_all``: a save's thousands of staging buffers leased and
given back in one step each, in order, so the caching allocator hands the next save of the
same structure the same buffer for each chunk; a failure part-way gives back what was taken."""

from __future__ import annotations

import pytest
import torch

from ckptfs.engine.buffers import BufferAllocator, BufferPool, CachingAllocator


class FailsAt(BufferAllocator):
    """Host memory, refused at the ``n``-th allocation."""

    def __init__(self, n: int) -> None:
        self.n, self.made = n, 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.made += 1
        if self.made == self.n:
            raise MemoryError("no more staging memory")
        return torch.empty(nbytes, dtype=torch.uint8)


async def test_leased_together_given_back_together_reused_in_order():
    cache = CachingAllocator()
    pool = BufferPool(cache)
    sizes = [64, 8, 64, 8, 64]
    first = await pool.lease_all(sizes)
    assert [lease.nbytes for lease in first] == sizes
    assert pool.budget.used == sum(sizes) and cache.allocations == 5
    await pool.release_all(first)
    assert pool.budget.used == 0 and cache.cached_bytes == sum(sizes)
    again = await pool.lease_all(sizes)
    assert cache.allocations == 5  # nothing new
    assert all(a.tensor is b.tensor for a, b in zip(first, again, strict=True))
    await pool.release_all(again)


@pytest.mark.parametrize("limit", [None, 1 << 20])
async def test_a_failed_lease_gives_back_the_others(limit):
    pool = BufferPool(CachingAllocator(FailsAt(3)), limit=limit)
    with pytest.raises(MemoryError, match="staging memory"):
        await pool.lease_all([16, 16, 16, 16])
    assert pool.budget.used == 0
    assert pool.allocator.cached_bytes == 32  # the two made before the failure
