"""Throttled uploads: at most K ranks of a node upload at once.

Ranks upload in rounds: the rank with local index i on its node goes in round ``i // K``; a
barrier ends each round. Every rank takes part in every round, also after a local failure (the
failure is re-raised after the last round and reported by the caller's ``Comm.run_everywhere``), so a failed
rank never leaves the others waiting. Rounds waste some time when ranks' files differ in size;
they need nothing but the process group (no store, no server).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ckptfs.dist.comm import Comm
from ckptfs.dist.nodes import NodeLayout, node_id
from ckptfs.errors import ConfigError

T = TypeVar("T")


def upload_rounds(layout: NodeLayout, limit: int) -> tuple[int, ...]:
    """The round of each rank: its index on its node divided by ``limit``."""
    return tuple(lr // limit for lr in layout.local_rank)


def run_throttled(limit: int | None, comm: Comm, fn: Callable[[], T], *,
                  agreed: bool = False) -> T:
    """Run ``fn`` (this rank's uploads) in this rank's round; collective over ``comm``.

    Every rank calls this with its own ``limit``; the smallest one given wins, and when no rank
    gives one (all None) ``fn`` runs at once after one small ``all_min``. ``agreed``: ``limit``
    is already the group's (the smallest given, the same on every rank; the save's write phase
    shares the limits in the collective that prepares its layout): no ``all_min``.
    """
    none = 1 << 62
    what = "save: planning throttled upload rounds"
    k = (none if limit is None else limit) if agreed else \
        comm.all_min([none if limit is None else limit], what)[0]
    if k == none:
        return fn()
    seen = comm.all_gather(node_id(), what)
    if k < 1:
        raise ConfigError(f"throttle_uploads must be at least 1, got {k}")
    layout = NodeLayout.from_ids(seen)
    rounds = upload_rounds(layout, k)
    result: Any = None
    error: BaseException | None = None
    for r in range(max(rounds) + 1):
        if r == rounds[comm.rank]:
            try:
                result = fn()
            except Exception as e:  # re-raised after the rounds: never skip a barrier
                error = e
        comm.all_min([0], f"save: upload round {r}")  # barrier: round r is over everywhere
    if error is not None:
        raise error
    return result
