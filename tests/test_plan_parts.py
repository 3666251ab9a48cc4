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
