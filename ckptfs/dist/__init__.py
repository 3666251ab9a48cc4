"""The distributed runtime: collectives that never hang (``Comm``), node topology, throttled
rounds, the background groups asynchronous saves run on, sync points agreed through the
group's store (no collective). Nothing else in ckptfs calls
``torch.distributed`` (except DTensor placement in state/)."""

from ckptfs.dist.comm import Comm, CommStats, ProcessGroup
from ckptfs.dist.groups import BACKGROUND, destroy_background_groups
from ckptfs.dist.launcher import launcher_world, launcher_world_size
from ckptfs.dist.nodes import NodeLayout, node_id
from ckptfs.dist.sync_point import SyncPoint
from ckptfs.dist.throttle import run_throttled

__all__ = ["BACKGROUND", "Comm", "CommStats", "NodeLayout", "ProcessGroup", "SyncPoint",
           "destroy_background_groups", "launcher_world", "launcher_world_size",
           "node_id", "run_throttled"]
