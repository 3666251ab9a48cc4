"""A sync point the ranks of a group agree on through the group's c10d store, with no
collective: how one rank's preemption notice becomes "every rank saves at the same step".

Call order, on every rank, once per training step: ``reached(local_notice)``. Each call costs
one store round trip (``check`` of the flag key) until a notice is seen; no collective ever runs
on the group. The protocol:

1. A rank that got a notice itself (a signal) raises the flag (``set``); every rank sees it at
   its next call (``check``). The call where a rank first sees it is its *notice call*; it
   publishes that call's number (``set noticed/<rank>``).
2. Once every rank has published, the sync point is ``max(notice calls) + 1``: a call no rank
   has made yet when it learns it (each rank learns it at its notice call or the next one).
3. A rank that does not know the sync point at ``its notice call + 1`` waits there (``wait`` on
   the other ranks' keys, bounded by ``timeout``): this never deadlocks a loop whose steps run
   collectives on the group, since a rank one call ahead has already made those collectives
   possible, so every other rank reaches its own next call and publishes.

``reached`` is True at the sync point on every rank. Calls are counted, not steps: every rank
must call once per iteration.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from ckptfs.errors import RankError

_instances = 0


class SyncPoint:
    """One agreement over the ranks of ``group`` (or a world of one); see the module doc."""

    def __init__(self, group: dist.ProcessGroup | None, name: str, timeout: float = 600.0) -> None:
        global _instances
        _instances += 1
        self.timeout = timeout
        self.calls = 0
        self.notice_call: int | None = None
        self.target: int | None = None
        self.value: str | None = None  #: what the first notice carried (e.g. a signal number)
        self.group = group
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.size = 0, 1
        if self.distributed:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        # the n-th agreement of this process: ranks create theirs in the same order
        self.prefix = f"ckptfs/{name}/{_instances}/"

    def _store(self) -> dist.Store:
        """The group's store, looked up per call and never held: a store object kept past
        ``destroy_process_group()`` can abort the process at exit (its client thread)."""
        base = (dist.distributed_c10d._get_default_store() if self.group is None
                else dist.distributed_c10d._get_process_group_store(self.group))
        return dist.PrefixStore(self.prefix, base)

    def _keys(self) -> list[str]:
        return [f"noticed/{r}" for r in range(self.size)]

    def reached(self, local_notice: str | None = None) -> bool:
        """Count one call; True when this call is the agreed sync point. ``local_notice``
        (not None) raises the flag with that value."""
        self.calls += 1
        call = self.calls
        if self.target is not None:
            return call == self.target
        if not self.distributed:  # one process: act on this very call
            if local_notice is None:
                return False
            self.value, self.target = local_notice, call
            return True
        st = self._store()
        if self.notice_call is None:
            if local_notice is not None:
                st.compare_set("flag", "", local_notice)  # the first notice's value wins
            elif not st.check(["flag"]):
                return False
            self.notice_call = call
            st.set(f"noticed/{self.rank}", str(call))
        keys = self._keys()
        if call > self.notice_call:
            try:
                st.wait(keys, timedelta(seconds=self.timeout))
            except Exception as e:  # DistStoreError on timeout; a dead store
                late = {r: "did not reach its next should_save call" for r, k in enumerate(keys)
                        if not _has(st, k)}
                raise RankError(f"agreeing on a sync point (waited {self.timeout:g} s: {e})",
                                late or {self.rank: str(e)}) from e
        elif not st.check(keys):
            return False
        self.target = max(int(st.get(k)) for k in keys) + 1
        self.value = st.get("flag").decode()
        return call == self.target


def _has(store: dist.Store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:
        return False
