"""ckptfs's own process groups: gloo groups over the same ranks as the caller's, created once.

ckptfs never runs its collectives on the caller's group. Each Comm runs on a gloo group of
ckptfs's own over the same ranks (CPU; works beside NCCL), created with the collective timeout
(dist/guard.py): gloo reports a dead peer at once and a peer that never arrives after the
timeout, where the caller's group would wait 30 minutes (gloo) or never notice (NCCL).

Groups are keyed by (ranks, lane, timeout). A lane is a kind of work that may run concurrently
with another, so the lanes never share a group: ``FOREGROUND`` (the blocking save and load)
and ``BACKGROUND`` (an asynchronous save writing and committing while the training loop runs
its own collectives, and perhaps a ``ckptfs.load``: two threads issuing collectives on one
group interleave and hang). ``Comm(group, timeout=..., background=...)`` picks the group.

Creating a group is itself a synchronisation among its ranks, so it happens in the caller's
thread, where every rank calls save/load/``async_save`` in the same order: over the default
group it is a plain ``new_group`` (every rank of the job takes part); over a subgroup it uses
``use_local_synchronization`` so only that subgroup's members need to call it.

On torch's "fake" backend (a world of one real process whose collectives do nothing, for
planning at a scale no machine runs) there are no peers to connect: ckptfs's groups are fake
groups too, so a save or load can be planned in such a world.

A group that failed a collective is forgotten (``drop``), not destroyed: destroying it on the
ranks that noticed would change the number of groups torch counts there but not on the others,
and torch names later groups by that count. The background groups are destroyed by
``destroy_background_groups`` (``ckptfs.close()``), which every rank calls; the foreground
groups are kept for the life of the job.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from ckptfs.runtime import RUNTIME, Resource

FOREGROUND = "foreground"  #: the lane of ckptfs's blocking save and load collectives
BACKGROUND = "background"  #: the lane of asynchronous saves


class OwnGroups:
    """ckptfs's groups, one per (ranks, lane, timeout), and the lock guarding them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table: dict[tuple[tuple[int, ...], str, float], dist.ProcessGroup] = {}


#: ckptfs's own groups, kept for the job's life (creating a group is collective: every rank
#: must see the same ones); ``ckptfs.close()`` leaves them (the background groups are destroyed
#: by the savers' close), a forked child forgets them
GROUPS: Resource[OwnGroups] = Resource("ckptfs's process groups", OwnGroups)


def own_group(group: dist.ProcessGroup | None, lane: str, timeout: float) -> dist.ProcessGroup:
    """ckptfs's gloo group of ``lane`` over the ranks of ``group`` (None: the default group),
    created with ``timeout`` (seconds) on first use and kept (torch.distributed must be
    initialised)."""
    whole = group is None or dist.get_world_size(group) == dist.get_world_size()
    ranks = (tuple(range(dist.get_world_size())) if whole
             else tuple(sorted(dist.get_process_group_ranks(group))))
    key = (ranks, lane, timeout)
    own = RUNTIME.get(GROUPS)
    with own.lock:
        g = own.table.get(key)
        if g is not None and _alive(g):  # not alive: the job was torn down and set up again
            return g
        t = timedelta(seconds=timeout)
        desc = f"ckptfs_{lane}"
        backend = "fake" if dist.get_backend() == "fake" else "gloo"
        if whole:
            g = dist.new_group(backend=backend, timeout=t, group_desc=desc)
        else:
            g = dist.new_group(list(ranks), backend=backend, timeout=t,
                               use_local_synchronization=True, group_desc=desc)
        own.table[key] = g
        return g


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def drop(group: dist.ProcessGroup) -> None:
    """Forget one of our groups after a failure: the next save or load creates a fresh one."""
    own = RUNTIME.get(GROUPS)
    with own.lock:
        for k, g in list(own.table.items()):
            if g is group:
                del own.table[k]


def destroy_background_groups(lane: str = BACKGROUND) -> None:
    """Tear down the groups of background ``lane`` (the next asynchronous save on it creates a
    new one); every rank calls this (``BackgroundSaver.close()``). The foreground groups are
    left alone. Groups already destroyed with the whole job (``destroy_process_group()``) are
    skipped."""
    if lane == FOREGROUND:
        raise ValueError("the foreground groups are kept for the life of the job")
    own = RUNTIME.get(GROUPS)
    with own.lock:
        keys = [k for k in own.table if k[1] == lane]
        groups = [own.table.pop(k) for k in keys]
    if not (dist.is_available() and dist.is_initialized()):
        return
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except (ValueError, RuntimeError):
            pass  # already gone
