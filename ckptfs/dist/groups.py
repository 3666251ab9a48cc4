"""Background process groups: a gloo group over the same ranks as the caller's, created once.

An asynchronous save writes and commits while the training loop runs its own collectives. Two
threads issuing collectives on one group interleave and hang, so the background work runs on
a group of its own: a gloo group (CPU; works beside NCCL) over the ranks of the caller's group,
created by the first asynchronous save and kept until ``destroy_background_groups``.

Creating it is itself a synchronisation among those ranks (they all call ``async_save``
together): over the default group it is a plain ``new_group`` (every rank of the job takes
part); over a subgroup it uses ``use_local_synchronization`` so only that subgroup's members
need to call it.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

_lock = threading.Lock()
_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}


def background_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """The gloo group the background work of ``group``'s ranks runs on (None when
    torch.distributed is not initialised: a world of one needs none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    whole = group is None or dist.get_world_size(group) == dist.get_world_size()
    ranks = (tuple(range(dist.get_world_size())) if whole
             else tuple(sorted(dist.get_process_group_ranks(group))))
    with _lock:
        bg = _groups.get(ranks)
        if bg is not None and not _alive(bg):  # the job was torn down and initialised again
            bg = None
        if bg is None:
            if whole:
                bg = dist.new_group(backend="gloo", group_desc="ckptfs_background")
            else:
                bg = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                                    group_desc="ckptfs_background")
            _groups[ranks] = bg
        return bg


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def destroy_background_groups() -> None:
    """Tear down the background groups (a later ``background_group`` creates a new one).
    Groups already destroyed with the whole job (``destroy_process_group()``) are skipped."""
    with _lock:
        groups = list(_groups.values())
        _groups.clear()
    if not (dist.is_available() and dist.is_initialized()):
        return
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except (ValueError, RuntimeError):
            pass  # already gone
