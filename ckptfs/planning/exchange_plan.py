"""Who reads what when ranks share what they read (``load(..., exchange=True)``).

A **unit** is one region of one stored chunk that some rank needs: (key, chunk offsets, region
of the chunk). Ranks that need the same unit (replicas, the ranks of a DTensor's replicate
dims) form its needers; one of them, the least loaded so far (largest units first), reads it
from storage and sends it to the others. Transfers are grouped into rounds in which no rank
sends plus receives more than the byte budget. Every rank computes the same plan from the same
input: the distinct need lists and which rank has which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ckptfs.layout.boxes import Box

#: (key, chunk offsets, region in the chunk's coordinates)
Unit = tuple[str, tuple[int, ...], Box]


@dataclass(frozen=True, slots=True)
class Transfer:
    """Send ``unit`` (``nbytes``) from ``src`` to every rank of ``dsts``."""

    unit: Unit
    nbytes: int
    src: int
    dsts: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ExchangePlan:
    reader: dict[Unit, int]  #: the rank reading each unit from storage
    rounds: tuple[tuple[Transfer, ...], ...]  #: transfers, round by round

    def reads_of(self, rank: int) -> set[Unit]:
        return {u for u, r in self.reader.items() if r == rank}


def plan_exchange(needs: Sequence[Sequence[tuple[Unit, int]]], owners: Sequence[int],
                  budget: int) -> ExchangePlan:
    """``needs``: the distinct need lists ((unit, bytes) pairs); ``owners[r]``: rank r's list.
    ``budget``: bytes one rank may send plus receive in one round."""
    members: list[list[int]] = [[] for _ in needs]
    for r, i in enumerate(owners):
        members[i].append(r)
    needers: dict[Unit, list[int]] = {}
    size: dict[Unit, int] = {}
    for i, lst in enumerate(needs):
        for unit, n in lst:
            needers.setdefault(unit, []).extend(members[i])
            size[unit] = n
    order = sorted(needers, key=lambda u: (-size[u], u[0], u[1], u[2]))
    load = [0] * len(owners)
    reader: dict[Unit, int] = {}
    transfers: list[Transfer] = []
    for u in order:
        ranks = sorted(needers[u])
        r = min(ranks, key=lambda x: (load[x], x))
        load[r] += size[u]
        reader[u] = r
        if len(ranks) > 1:
            transfers.append(Transfer(u, size[u], r, tuple(x for x in ranks if x != r)))
    return ExchangePlan(reader, tuple(_rounds(transfers, len(owners), budget)))


def _rounds(transfers: list[Transfer], world: int, budget: int) -> list[tuple[Transfer, ...]]:
    """Consecutive transfers per round while every rank sends plus receives at most ``budget``
    bytes in it (a transfer larger than that gets a round of its own)."""
    rounds: list[tuple[Transfer, ...]] = []
    current: list[Transfer] = []
    used = [0] * world
    for t in transfers:
        cost = {t.src: t.nbytes * len(t.dsts)}
        for d in t.dsts:
            cost[d] = cost.get(d, 0) + t.nbytes
        if current and any(used[r] + c > budget for r, c in cost.items()):
            rounds.append(tuple(current))
            current, used = [], [0] * world
        current.append(t)
        for r, c in cost.items():
            used[r] += c
    if current:
        rounds.append(tuple(current))
    return rounds
