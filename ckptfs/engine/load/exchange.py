"""``load(..., exchange=True)``: each region some ranks need is read from storage once per process
group and sent to the other ranks that need it (planning/exchange_plan.py decides who reads what).

1. Every rank lists the units its targets need (key, chunk, region); the distinct lists are
   exchanged (``Comm.distinct``: replicated state sends one list in all) and every rank computes
   the same plan: one reader per unit, balanced by bytes, and the transfers in rounds.
2. Each rank reads its units into its own targets (the usual read engine, checksums included).
3. Round by round the readers send: a unit every rank needs is broadcast from its reader, the
   others go point to point to the ranks that need them. A region moves in place when it is
   contiguous on the group's device (CPU for gloo, CUDA for NCCL), else through a staging
   buffer there. A round moves at most ``LoadOptions.exchange_bytes`` per rank (sent plus
   received), which bounds the staging memory in transit at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ckptfs.dist import Comm
from ckptfs.engine.load.schedule import TensorRead
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.planning.exchange_plan import ExchangePlan, Unit, plan_exchange


@dataclass(frozen=True, slots=True)
class Place:
    """Where a unit lives in this rank's targets."""

    target: torch.Tensor
    dst: Box  #: in the target's coordinates
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Exchange:
    """One rank's part of an exchange load."""

    plan: ExchangePlan
    reads: tuple[TensorRead, ...]  #: what this rank reads from storage
    places: dict[Unit, Place]  #: every unit this rank needs


def plan_load(comm: Comm, jobs: Sequence[TensorRead], budget: int) -> Exchange:
    """Agree on who reads what (collective)."""
    places: dict[Unit, Place] = {}
    needs = []
    for job in jobs:
        dt = from_name(job.entry.dtype, job.entry.key)
        for p in job.pieces:
            u = (job.entry.key, p.chunk.offsets, p.src)
            places[u] = Place(job.target, p.dst, dt.torch)
            needs.append((u, p.src.volume * dt.itemsize))
    needs.sort()
    lists, owners = comm.distinct(tuple(needs), hashlib.blake2b(
        repr(needs).encode(), digest_size=16).digest(), "load: planning the exchange")
    plan = plan_exchange(lists, owners, budget)
    mine = plan.reads_of(comm.rank)
    reads = []
    for job in jobs:
        pieces = tuple(p for p in job.pieces if (job.entry.key, p.chunk.offsets, p.src) in mine)
        if pieces:
            reads.append(TensorRead(job.entry, job.target, pieces))
    return Exchange(plan, tuple(reads), places)


def _buffer(p: Place, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, bool]:
    """The tensor a transfer moves for ``p``: the target region itself when the collective can
    use it in place (contiguous, on the group's device), else a staging copy. (tensor, staged)"""
    region = p.target[p.dst.slices()]
    if region.is_contiguous() and region.device == device:
        return region, False
    return torch.empty(shape, dtype=p.dtype, device=device), True


def run(comm: Comm, ex: Exchange) -> int:
    """Send what this rank read, receive what others read (collective); returns the bytes
    received. A unit every rank needs is broadcast from its reader; others go point to point.
    Regions move in place where they are contiguous on the group's device, through staging
    buffers otherwise. Every rank runs every round, even after a local failure (raised at the
    end)."""
    me, world = comm.rank, comm.size
    received = 0
    error: BaseException | None = None
    for rnd_no, rnd in enumerate(ex.plan.rounds):
        pending: list[tuple[Place, torch.Tensor]] = []  # staged receives to place after
        ops: list[tuple[str, torch.Tensor, int, int]] = []  # point-to-point ("send"/"recv")
        for i, t in enumerate(rnd):
            if t.src != me and me not in t.dsts:
                continue
            p = ex.places[t.unit]
            try:
                buf, staged = _buffer(p, tuple(t.unit[2].shape), comm.device)
                if t.src == me and staged:
                    buf.copy_(p.target[p.dst.slices()])
            except Exception as e:  # keep taking part in the rounds; raise after them
                error = error or e
                buf, staged = torch.empty(t.unit[2].shape, dtype=p.dtype, device=comm.device), True
            if len(t.dsts) + 1 == world:
                comm.broadcast_tensor(buf, t.src, f"load: exchanging (round {rnd_no})")
            elif t.src == me:
                ops.extend(("send", buf, d, i) for d in t.dsts)
            else:
                ops.append(("recv", buf, t.src, i))
            if t.src != me:
                received += t.nbytes
                if staged:
                    pending.append((p, buf))
        comm.point_to_point(ops, f"load: exchanging (round {rnd_no})")
        for p, buf in pending:
            try:
                p.target[p.dst.slices()].copy_(buf)
            except Exception as e:
                error = error or e
    if error is not None:
        raise error
    return received
