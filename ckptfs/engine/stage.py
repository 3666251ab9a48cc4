"""Save, phase 1 of 3: stage. After ``stage`` returns, the checkpoint's content is fixed.

Every rank flattens its state dict, describes its shards (no data), and the ranks exchange the
descriptions (one ``agree``) so that every rank computes the same plan: which stored chunks
there are and which one rank writes each. Then each rank takes the bytes of the chunks it
writes: with ``copy=True`` into buffers leased from the pool (the caller may change its tensors
as soon as ``stage`` returns: what an asynchronous save needs), with ``copy=False`` as zero-copy
views where the data is CPU and contiguous (a synchronous save, whose caller waits), copying
only what must be (non-contiguous or non-CPU data). ``copy_chunk`` is the one place a chunk is
copied into a staging buffer; CUDA data is copied there by a ``DeviceToHost`` (pinned buffers:
``staging_allocator``), all copies queued on a side stream and waited for once. The CUDA copy
is UNTESTED (no GPU machine was available; README, GPU). The ranks agree on the outcome of the
copies, so a rank that failed to stage fails the save everywhere instead of leaving the others
in the next collective.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.dist import Comm
from ckptfs.engine.buffers import BufferAllocator, BufferPool, Lease, allocator_for
from ckptfs.errors import ShardingError
from ckptfs.io import run_sync
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.plan import TensorPlan
from ckptfs.planning.save_plan import ShardInfo, plan_save
from ckptfs.state.flatten import flatten, merge_order
from ckptfs.state.shards import LocalShard, local_shard

Json = Any


@dataclass(frozen=True, slots=True)
class Description:
    """What one rank holds, without data: what the ranks exchange before planning."""

    shards: tuple[ShardInfo, ...]
    values: Mapping[str, Json]  #: key -> encoded plain value
    containers: Mapping[str, str]  #: key -> dict | list | tuple
    order: tuple[str, ...] = ()  #: every key, depth first, dicts in insertion order


@dataclass(frozen=True, slots=True)
class StagedSave:
    """One rank's staged save: the plan every rank agreed on and the bytes this rank writes."""

    rank: int
    world_size: int
    plans: Mapping[str, TensorPlan]  #: every tensor of the checkpoint
    chunks: tuple[ChunkData, ...]  #: the chunks this rank writes, CPU and C-contiguous
    values: Mapping[str, Json]  #: plain values of all ranks (lowest rank wins)
    containers: Mapping[str, str]
    leases: tuple[Lease, ...]  #: buffers holding copied chunks; release after the write
    copied: bool  #: every chunk is a copy: the caller's tensors are no longer read
    order: tuple[str, ...] = ()  #: the index's ``order`` (formats/README.md §3.2)

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks this rank writes."""
        return sum(c.data.numel() * c.dtype.itemsize for c in self.chunks)


def describe(state_dict: Mapping[str, Any], rank: int) -> tuple[Description, dict[str, LocalShard]]:
    """This rank's description and its local shards (views of the caller's tensors)."""
    flat = flatten(state_dict)
    shards: dict[str, LocalShard] = {}
    for key, obj in flat.tensors.items():
        s = local_shard(key, obj, rank)
        if s is not None:
            shards[key] = s
    infos = tuple(ShardInfo(k, s.dtype.name, s.global_shape, s.box, s.replica_id)
                  for k, s in shards.items())
    return Description(infos, flat.values, flat.containers, tuple(flat.order)), shards


def merge_values(descriptions: Sequence[Description],
                 plans: Mapping[str, TensorPlan]) -> tuple[dict[str, Json], dict[str, str]]:
    """Values and containers of all ranks (lowest rank wins for a value held by several)."""
    values: dict[str, Json] = {}
    containers: dict[str, str] = {}
    for d in descriptions:
        for k, v in d.values.items():
            values.setdefault(k, v)
        for k, kind in d.containers.items():
            if containers.setdefault(k, kind) != kind:
                raise ShardingError(f"key {k!r}: ranks disagree whether it is a {kind} or a "
                                    f"{containers[k]}")
    clash = sorted((set(values) & set(plans)) | (set(containers) & (set(values) | set(plans))))
    if clash:
        raise ShardingError(f"key {clash[0]!r} is a tensor, a value or a container on different ranks")
    return values, containers


def stage(state_dict: Mapping[str, Any], comm: Comm, backend: Backend, pool: BufferPool, *,
          copy: bool, on_copied: Callable[[], None] | None = None) -> StagedSave:
    """Describe, agree, plan, and take this rank's chunk bytes (collective over ``comm``).

    ``on_copied`` is called as soon as this rank has taken its bytes, before the ranks agree on
    the outcome (an asynchronous save resolves its ``staged`` future there)."""
    (_, local), described = comm.exchange("save: describing the state dict",
                                          lambda: describe(state_dict, comm.rank), lambda r: r[0])
    plans = plan_save([d.shards for d in described], lambda d: from_name(d).itemsize,
                      split=backend.split_chunks)
    values, containers = merge_values(described, plans)
    views: list[tuple[str, TensorPlan, Any, torch.Tensor]] = []
    for key, plan in plans.items():
        for c in plan.chunks:
            if c.writer == comm.rank:
                s = local[key]
                views.append((key, plan, c.box, s.local.detach()[c.box.relative_to(s.box).slices()]))
    shards = {k: local[k] for k, *_ in views}
    taken: list[tuple[tuple[ChunkData, ...], tuple[Lease, ...]]] = []

    def take() -> None:
        taken.append(_take(views, shards, pool, copy))
        if on_copied is not None:
            on_copied()

    try:
        comm.agree("save: copying the chunks", take)
    except BaseException:
        if taken:
            _release(taken[0][1], pool)
        raise
    chunks, leases = taken[0]
    order = merge_order((d.order for d in described), [*containers, *values, *plans])
    return StagedSave(comm.rank, comm.size, plans, chunks, values, containers, leases, copy,
                      tuple(order))


def _needs_copy(data: torch.Tensor) -> bool:
    return data.device.type != "cpu" or not data.is_contiguous()


def _take(views: list, shards: Mapping[str, LocalShard], pool: BufferPool,
          copy: bool) -> tuple[tuple[ChunkData, ...], tuple[Lease, ...]]:
    """ChunkData for every view: copied into leased buffers (all of them with ``copy``,
    otherwise only those that are not CPU and contiguous)."""
    sizes = [data.numel() * data.element_size() if copy or _needs_copy(data) else -1
             for *_, data in views]
    wanted = [n for n in sizes if n > 0]
    leases = run_sync(_lease_all(pool, wanted)) if wanted else []
    got = iter(leases)
    d2h = DeviceToHost() if any(v[-1].device.type == "cuda" for v in views) else None
    chunks: list[ChunkData] = []
    try:
        for (key, plan, box, data), n in zip(views, sizes, strict=True):
            if n > 0:
                data = copy_chunk(data, next(got), d2h)
            elif n == 0:
                data = torch.empty(data.shape, dtype=data.dtype)
            chunks.append(ChunkData(key, shards[key].dtype, plan.shape, box, data))
        if d2h is not None:
            d2h.wait()  # the bytes are on the host before anyone reads them (or ``staged``)
    except BaseException:
        if d2h is not None:
            d2h.wait()  # no queued copy still writes into a buffer given back
        _release(leases, pool)
        raise
    return tuple(chunks), tuple(leases)


def copy_chunk(data: torch.Tensor, lease: Lease, d2h: DeviceToHost | None = None) -> torch.Tensor:
    """``data`` copied into ``lease``'s buffer, as a tensor of its dtype and shape (CUDA data
    by ``d2h``, complete only after ``d2h.wait()``)."""
    buf = lease.tensor.view(data.dtype).view(data.shape)
    if d2h is not None and data.device.type == "cuda":
        d2h.copy(buf, data)
    else:
        buf.copy_(data)
    return buf


class DeviceToHost:
    """UNTESTED (no GPU was available): device-to-host copies queued on a side stream per
    device, after the work already queued on the device's current stream (which may still be
    writing the source); ``wait`` synchronizes them. Into pinned buffers the copies run
    asynchronously, back to back, at the D2H bandwidth."""

    def __init__(self) -> None:
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def copy(self, buf: torch.Tensor, data: torch.Tensor) -> None:
        stream = self.streams.get(data.device)
        if stream is None:
            stream = self.streams[data.device] = torch.cuda.Stream(data.device)
            stream.wait_stream(torch.cuda.current_stream(data.device))
        with torch.cuda.stream(stream):
            buf.copy_(data, non_blocking=buf.is_pinned())

    def wait(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


def staging_allocator(state_dict: Mapping[str, Any]) -> BufferAllocator:
    """Pinned host memory when the state dict holds CUDA tensors (for asynchronous D2H
    copies), pageable otherwise."""
    return allocator_for(_tensors(state_dict))


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


async def _lease_all(pool: BufferPool, sizes: list[int]) -> list[Lease]:
    pool.expect(sizes)
    out: list[Lease] = []
    try:
        for n in sizes:
            out.append(await pool.lease(n))
    except BaseException:
        for lease in out:
            await pool.release(lease)
        raise
    return out


def release(staged: StagedSave, pool: BufferPool) -> None:
    """Give the staging buffers back to the pool."""
    _release(staged.leases, pool)


def _release(leases: Sequence[Lease], pool: BufferPool) -> None:
    async def go() -> None:
        for lease in leases:
            await pool.release(lease)

    if leases:
        run_sync(go())
