"""ckptfs in a simulated world: torch's "fake" backend (one real process whose collectives do
nothing) is how ``bench.scale`` plans a save for thousands of ranks. ckptfs's own groups are fake
groups there too, so connecting the ranks succeeds instead of trying to reach peers."""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ckptfs.dist import Comm
from ckptfs.dist.groups import destroy_background_groups


def test_comm_connects_in_a_fake_world():
    dist.init_process_group("fake", rank=3, world_size=8, store=FakeStore())
    try:
        comm = Comm()
        assert (comm.rank, comm.size, comm.members) == (3, 8, tuple(range(8)))
        assert comm.group is not dist.group.WORLD and dist.get_backend(comm.group) == "fake"
        background = Comm(background=True)
        assert background.group is not comm.group
        assert dist.get_backend(background.group) == "fake"
        assert Comm().group is comm.group  # created once, kept
    finally:
        destroy_background_groups()
        dist.destroy_process_group()
    assert not dist.is_initialized()
