"""Bounded waits: ckptfs's collectives run on a gloo group of their own, created with a timeout.

A save or load waits in collectives for the other ranks. On the caller's group such a wait is
bounded only by that group's timeout (30 minutes for gloo, 10 for NCCL), and NCCL does not even
notice a dead peer before it. So ckptfs talks over a gloo group it creates once per set of ranks
and timeout (``own_group``): gloo reports a peer whose process died at once ("connection closed
by peer"), and a peer that is alive but never arrives (hung, or it never called ``save``) after
``timeout`` seconds. ``translate`` turns either into a ``CollectiveError`` naming the phase; the
group is then forgotten and the next save or load creates a new one. (It is not destroyed:
that would change the number of groups torch counts on this rank but not on the others, and
torch names later groups by that count. gloo already tells the peers of a failed collective.)
A failure means a rank is dead or lost: the job's own process group is as broken, and the
job should restart.

Creating the group is itself collective: over the default group every rank takes part (every
rank calls save); over a subgroup only its members do (``use_local_synchronization``). It is
bounded by the same timeout.

Groups are keyed by (ranks, lane, timeout) with the lane ``FOREGROUND``, the same keys as the
background lane of asynchronous saves (issue 10's ``dist/groups.py``): the two tables merge into
one module owning ckptfs's groups, where this ``own_group(group, timeout)`` is
``own_group(group, FOREGROUND, timeout)``, and the lanes never share a group.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from ckptfs.errors import CollectiveError, ConfigError

#: seconds a rank waits for the others at one step of a save or load, unless configured
DEFAULT_TIMEOUT = 600.0
TIMEOUT_ENV = "CKPTFS_COLLECTIVE_TIMEOUT"

_lock = threading.Lock()
FOREGROUND = "foreground"  #: the lane of ckptfs's blocking save and load collectives
_groups: dict[tuple[tuple[int, ...], str, float], dist.ProcessGroup] = {}


def collective_timeout(seconds: float | None = None) -> float:
    """The timeout to use: ``seconds``, else ``$CKPTFS_COLLECTIVE_TIMEOUT``, else 600 s."""
    if seconds is None:
        env = os.environ.get(TIMEOUT_ENV)
        try:
            seconds = float(env) if env else DEFAULT_TIMEOUT
        except ValueError:
            raise ConfigError(f"${TIMEOUT_ENV} must be a number of seconds, got {env!r}") from None
    if not seconds > 0:
        raise ConfigError(f"collective_timeout must be a positive number of seconds, got {seconds}")
    return float(seconds)


def own_group(group: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup:
    """ckptfs's gloo group over the ranks of ``group`` (None: the default group), created with
    ``timeout`` on first use and kept."""
    whole = group is None or dist.get_world_size(group) == dist.get_world_size()
    ranks = (tuple(range(dist.get_world_size())) if whole
             else tuple(sorted(dist.get_process_group_ranks(group))))
    with _lock:
        g = _groups.get((ranks, FOREGROUND, timeout))
        if g is not None and _alive(g):
            return g
        t = timedelta(seconds=timeout)
        if whole:
            g = dist.new_group(backend="gloo", timeout=t, group_desc=f"ckptfs_{FOREGROUND}")
        else:
            g = dist.new_group(list(ranks), backend="gloo", timeout=t,
                               use_local_synchronization=True, group_desc=f"ckptfs_{FOREGROUND}")
        _groups[(ranks, FOREGROUND, timeout)] = g
        return g


def _alive(group: dist.ProcessGroup) -> bool:
    try:
        dist.get_rank(group)
    except (ValueError, RuntimeError):
        return False
    return True


def drop(group: dist.ProcessGroup) -> None:
    """Forget one of our groups after a failure: the next save or load creates a fresh one."""
    with _lock:
        for k, g in list(_groups.items()):
            if g is group:
                del _groups[k]


def translate(e: BaseException, what: str, timeout: float) -> CollectiveError:
    """The CollectiveError for a failed collective of phase ``what``."""
    text = str(e).split("\n")[0]
    low = text.lower()
    if "timed out" in low or "timeout" in low:
        why = (f"no answer from the other ranks within the collective timeout of {timeout:g} s: "
               f"a rank died, hangs, or never reached this step (collective_timeout= or "
               f"${TIMEOUT_ENV} sets the timeout)")
    elif "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        why = "a rank's process is gone (killed or crashed) or left this step after a failure"
    else:
        why = "the collective failed"
    return CollectiveError(what, f"{why} [{type(e).__name__}: {text}]")
