"""``SavePlan.writes`` / ``replicas``: this rank's chunks and the replica slices it checksums
for other ranks, computed once per plan (a cached plan serves every later save of its
structure), and a rank writing its whole shard staging it without indexing."""

from __future__ import annotations

import torch

from ckptfs.dist import Comm
from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.engine.save.stage import stage
from ckptfs.layout.boxes import Box
from ckptfs.planning.layouts import Description, Layout
from ckptfs.planning.plan_cache import PlanCache
from ckptfs.planning.save_plan import SavePlan, agree_layouts
from ckptfs.save import make_backend


def test_replicas_are_the_plain_slices_another_rank_writes_computed_once():
    n = 3 << 20  # big enough to be cut between the two holders
    desc = Description((("c", Layout("uint8", (n,))), ("d", Layout("uint8", (400,)))))
    layouts = agree_layouts([desc, desc], [0, 0], lambda d: 1)
    first, second = Box((0,), (n // 2,)), Box((n // 2,), (n // 2,))
    plan0, plan1 = SavePlan(layouts, 0, 2), SavePlan(layouts, 1, 2)
    assert plan0.writes() == [("c", first), ("d", Box((0,), (400,)))]
    assert plan1.writes() == [("c", second)]
    assert plan0.replicas() == (("c", second),)
    assert plan1.replicas() == (("c", first), ("d", Box((0,), (400,))))
    assert plan1.replicas() is plan1.replicas()  # kept with the plan


def test_a_whole_shard_is_staged_from_the_tensor_itself():
    state = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5)}
    pool = BufferPool()
    staged = stage(state, Comm(None), make_backend("safetensors_chunks", None, None), pool, copy=False,
                   cache=PlanCache())
    got = {c.key: c.data for c in staged.chunks}
    assert got["w"].data_ptr() == state["w"].data_ptr() and got["w"].shape == (3, 4)
    assert torch.equal(got["b"], state["b"])


def test_the_chunk_bound_is_never_below_the_planned_chunks():
    """``SavePlan.chunk_bound`` lets a save decide on a whole index without planning every key:
    it must never count fewer chunks than the plan has (plain keys big enough to be cut among
    4 holders, small ones, empty ones, row shards held by 2 ranks each)."""
    def desc(rank):
        rows = ((f"p{i}", Layout("uint8", (n,))) for i, n in enumerate((3 << 20, 9 << 20, 400, 0)))
        half = Box(((rank % 2) * 512,), (512,))
        shard = (("s", Layout("float32", (1024,), box=half, replica_id=rank // 2)),)
        return Description(tuple(sorted((*rows, *shard))))

    descs = [desc(r) for r in range(4)]
    layouts = agree_layouts(descs, [0, 1, 2, 3], lambda d: 4)
    for min_slice in (1, 1 << 20, 1 << 30):
        plan = SavePlan(layouts, 0, 4, min_slice=min_slice)
        planned = sum(len(plan.plans[k].chunks) for k in layouts)
        bound = plan.chunk_bound()
        assert bound is not None and planned <= bound <= planned + 8, (min_slice, planned, bound)
    assert SavePlan(layouts, 0, 4, split=lambda k, d, s, boxes: boxes).chunk_bound() is None
