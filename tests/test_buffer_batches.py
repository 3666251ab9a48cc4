"""``BufferPool.lease_all`` / ``release_all``: a save's thousands of staging buffers leased and
given back in one step each, in order, so the caching allocator hands the next save of the
same structure the same buffer for each chunk; a failure part-way gives back what was taken."""

from __future__ import annotations

import pytest
import torch

from ckptfs.engine.memory.buffers import BufferAllocator, BufferPool, CachingAllocator


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


async def test_typed_views_reused_with_their_buffers_and_dropped_with_them():
    import gc
    import weakref

    cache = CachingAllocator()
    pool = BufferPool(cache)
    (lease,) = await pool.lease_all([64])
    view = cache.typed(lease.tensor, torch.float32, torch.Size([4, 4]))
    assert view.shape == (4, 4) and view.data_ptr() == lease.tensor.data_ptr()
    await pool.release_all([lease])
    (again,) = await pool.lease_all([64])
    assert again.tensor is lease.tensor
    assert cache.typed(again.tensor, torch.float32, torch.Size([4, 4])) is view  # no new view
    other = cache.typed(again.tensor, torch.int64, torch.Size([8]))
    assert other is not view and other.dtype == torch.int64 and other.shape == (8,)
    await pool.release_all([again])
    gone = weakref.ref(other)
    del lease, again, view, other
    pool.expect([])  # the next save has another structure: the buffer and its view go
    gc.collect()
    assert gone() is None and cache.cached_bytes == 0
