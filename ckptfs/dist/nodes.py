"""Which ranks share a node: grouped by ``CKPTFS_NODE_ID`` when set, else by the launcher's
node (torchrun's ``GROUP_RANK``: one agent per node, even several on one host), else by
hostname."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

NODE_ENV = "CKPTFS_NODE_ID"


def node_id() -> str:
    """This process's node: ``$CKPTFS_NODE_ID`` if set (tests, containers sharing a host,
    schedulers with better names), else the hostname, with torchrun's node rank when a
    torchrun agent started the process (``$GROUP_RANK`` under ``$TORCHELASTIC_RUN_ID``)."""
    host = os.environ.get(NODE_ENV) or socket.gethostname()
    if NODE_ENV not in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        group = os.environ.get("GROUP_RANK")
        if group is not None:
            return f"{host}:{group}"
    return host


@dataclass(frozen=True, slots=True)
class NodeLayout:
    """Ranks grouped into nodes, in order of first appearance; ranks keep their global order."""

    node_of: tuple[int, ...]  #: node index of each rank
    local_rank: tuple[int, ...]  #: index of each rank among the ranks of its node

    @classmethod
    def from_ids(cls, ids: Sequence[str]) -> NodeLayout:
        index: dict[str, int] = {}
        count: dict[str, int] = {}
        node_of, local = [], []
        for nid in ids:
            node_of.append(index.setdefault(nid, len(index)))
            local.append(count.get(nid, 0))
            count[nid] = local[-1] + 1
        return cls(tuple(node_of), tuple(local))

    @property
    def num_nodes(self) -> int:
        return max(self.node_of, default=-1) + 1

    def ranks_on(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.node_of) if n == node]

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node (the one that downloads for it)."""
        return self.ranks_on(self.node_of[rank])[0]
