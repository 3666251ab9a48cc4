"""A process group of this rank alone, made without the other ranks: for a save that one rank
makes on its own while torch.distributed is initialised (Lightning writes its checkpoint from
global rank 0 only). ``new_group`` with local synchronisation involves the members only and
names the group by a hash of its ranks, so the other ranks' group numbering is left alone."""

from __future__ import annotations

import torch.distributed as dist

from ckptfs.dist.comm import ProcessGroup
from ckptfs.runtime import RUNTIME, Resource


def solo_group() -> ProcessGroup | None:
    """This rank's one-member gloo group; None when torch.distributed is not initialised (a
    single process needs no group). Created once per rank and reused."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    groups = RUNTIME.get(SOLO)
    group = groups.get(rank)
    if group is None:
        group = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
        groups[rank] = group
    return group


#: each rank's one-member group, kept for the job's life (``ckptfs.close()`` leaves it)
SOLO: Resource[dict[int, ProcessGroup]] = Resource("the one-member groups", dict)
