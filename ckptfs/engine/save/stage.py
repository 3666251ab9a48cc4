"""Save, phase 1 of 3: stage. After ``stage`` returns, the checkpoint's content is fixed.

Every rank flattens its state dict and describes its tensors without data (planning/layouts.py:
one layout per tensor; a DTensor's mesh and placements stand for every rank's shard). The ranks
then agree on one plan with as little traffic as the layouts allow:

1. One small collective (``Comm.settle``, read as an ``Agreement``) settles, at once, whether
   any rank failed, whether every rank may reuse the same cached plan (planning/plan_cache.py),
   whether all ranks' plain values are equal, and whether any rank holds ``PerRank`` state.
2. On a cache miss the distinct descriptions are exchanged (``Comm.distinct``: nothing more when
   all are equal, e.g. SPMD training; one per pipeline stage otherwise), every rank checks them
   the same way and plans; each rank computes only its own writes (planning/save_plan.py).
3. Plain values and ``PerRank`` state go to the coordinator only (gathered when they differ
   between ranks or exist), which checks them and builds the index from them later.

Then each rank takes the bytes of the chunks it writes: with ``copy=True`` into buffers leased
from the pool (the caller may change its tensors as soon as ``stage`` returns: what an
asynchronous save needs), with ``copy=False`` as zero-copy views where the data is CPU and
contiguous (a synchronous save, whose caller waits), copying only what must be (non-contiguous
or non-CPU data). ``copy_chunk`` is the one place a chunk is copied into a staging buffer: CPU
data by ``copies.copy_all`` (large tensors in pieces over a few threads), CUDA
data by a ``DeviceToHost`` (pinned buffers: ``staging_allocator``), all copies
queued on a side stream and waited for once (a synchronous save into a backend that streams
chunks copies none of its CUDA data here: engine/memory/device_parts.py). Each rank also checksums the
slices of plain tensors that another rank writes, so the coordinator can tell replicas that
differ (commit.py): with ``copy=True`` here, before the caller changes its tensors; with
``copy=False`` the slices are handed to the write phase, which checksums them while this rank's
files are written. The ranks agree on the outcome of the copies, so a rank that failed to stage
fails the save everywhere instead of leaving the others in the next collective.

The stage phase runs every collective on the ``Comm`` it is given (a background save gives it
its own group's); the plan cache is keyed by the group's members and the structure, so saves
of one structure over the same ranks share an entry safely (plan_cache.py).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from ckptfs.dist import Comm
from ckptfs.engine.memory.buffers import BufferAllocator, BufferPool, Lease, allocator_for
from ckptfs.engine.memory.copies import PIECE, copy_all, copy_threads
from ckptfs.engine.memory.device_parts import DeviceParts
from ckptfs.engine.memory.overflow import Overflow
from ckptfs.engine.memory.ring import SideStreams
from ckptfs.engine.save.hash_memo import ChunkId
from ckptfs.errors import ShardingError
from ckptfs.io import run_sync
from ckptfs.layout.backend import Backend, ChunkData
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.checksum import checksum
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import ChunkEntry
from ckptfs.layout.nogc import catch_up, paused_gc
from ckptfs.layout.plan import PlannedChunk, TensorPlan
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.planning import save_plan
from ckptfs.planning.layouts import Description
from ckptfs.planning.plan_cache import CachedPlan, PlanCache, plan_cache
from ckptfs.planning.save_plan import SavePlan, agree_layouts
from ckptfs.state.flatten import flatten, merge_order
from ckptfs.state.shards import LocalShard, MeshTable, described_shards

Json = Any
#: a save's test of the chunks it would copy, before any is copied: the references it records
#: instead of copying them (engine/save/pipeline.py builds it from the hooks' ``before_copy``)
Refer = Callable[[Sequence[ChunkData]], Mapping[ChunkId, ChunkEntry]]


@dataclass(frozen=True, slots=True)
class Private:
    """What only the coordinator needs of a rank: its plain values and containers (when they
    differ between ranks) and its ``PerRank`` tensors (key, dtype, shape) and values."""

    values: Mapping[str, Json]
    containers: Mapping[str, str]
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    per_rank: tuple[str, ...]  #: PerRank keys
    order: tuple[str, ...] = ()  #: every key, depth first, dicts in insertion order


@dataclass
class Described:
    """One rank's state taken apart: its description and everything staying on the rank."""

    desc: Description
    digest: bytes
    shards: dict[str, LocalShard]  #: planned keys -> local shard
    own: dict[str, LocalShard]  #: PerRank tensors (written by this rank only)
    values: dict[str, Json]  #: plain values outside PerRank
    containers: dict[str, str]
    private: Private
    order: tuple[str, ...] = ()  #: every key, depth first, dicts in insertion order
    values_digest: bytes = field(default=b"")


@dataclass(frozen=True, slots=True)
class IndexContent:
    """What only the coordinator holds after staging: the index's content besides the chunks
    (every rank's plain values and containers, merged, and every tensor)."""

    values: Mapping[str, Json]
    containers: Mapping[str, str]
    #: (dtype, global shape) of every tensor, PerRank ones included, without building plans
    tensors: Mapping[str, tuple[str, tuple[int, ...]]]
    order: tuple[str, ...] = ()  #: the index's ``order`` (formats/README.md §3.2)
    per_rank: tuple[str, ...] = ()  #: the PerRank keys of the checkpoint


@dataclass(frozen=True, slots=True)
class StagedSave:
    """One rank's staged save: the plan every rank agreed on and the bytes this rank writes;
    ``content`` on the coordinator only."""

    rank: int
    world_size: int
    plans: Mapping[str, TensorPlan]  #: every tensor (built on access: the coordinator uses all)
    chunks: tuple[ChunkData, ...]  #: the chunks this rank writes, CPU and C-contiguous
    leases: tuple[Lease, ...]  #: buffers holding copied chunks; release after the write
    copied: bool  #: every chunk is a copy: the caller's tensors are no longer read
    #: (key, slice, checksum) of plain-tensor slices this rank holds and another rank writes
    #: (``copy=True``: computed while staging)
    replica_sums: tuple[tuple[str, Box, str], ...] = ()
    #: (key, slice, view) of such slices still to checksum (``copy=False``: the write phase
    #: checksums them, ``replica_sums``, while the files are written)
    replicas: tuple[tuple[str, Box, torch.Tensor], ...] = ()
    cached: bool = False  #: the plan came from the plan cache
    content: IndexContent | None = None  #: the coordinator's; None on the other ranks
    #: each hook's note (engine/save/hooks.py), in the order of the save's hooks
    notes: tuple[Any, ...] = ()
    #: the chunks this rank records as references to a base checkpoint, found before any byte
    #: was copied (``refer``), by (key, offsets, shape): not copied, not in ``chunks``
    references: Mapping[ChunkId, ChunkEntry] = field(default_factory=dict)
    #: bytes this rank copied into host staging buffers (not those streamed while written)
    staged_bytes: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks this rank writes."""
        return sum(c.data.numel() * c.dtype.itemsize for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Agreement:
    """What the ranks settle in the stage's first collective (one ``Comm.settle``)."""

    #: every rank may reuse its cached plan, and all ranks cached the same plan
    cached: bool
    #: all ranks' plain values and containers are alike and no rank holds PerRank state: the
    #: coordinator's own stand for all, and nothing is gathered
    values_alike: bool


class Taking(Enum):
    """How ``_take`` takes the bytes of one chunk."""

    STREAMED = "streamed"  #: streamed off its device while written (engine/memory/device_parts.py)
    VIEW = "view"  #: the caller's CPU, contiguous bytes as they are (``copy=False``)
    EMPTY = "empty"  #: a copy of no bytes: a new empty tensor
    COPIED = "copied"  #: copied into a buffer leased from the pool


def _digest(*parts: Any) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def _h63(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "little") >> 1


def describe(state_dict: Mapping[str, Any], comm: Comm, backend: Backend,
             min_slice: int) -> Described:
    """This rank's description and its local shards (views of the caller's tensors)."""
    flat = flatten(state_dict, comm.rank)
    pos = {g: i for i, g in enumerate(comm.members)}
    meshes = MeshTable(pos.get)
    shards: dict[str, LocalShard] = {}
    own: dict[str, LocalShard] = {}
    layouts = []
    for key, s, layout in described_shards(flat.tensors, comm.rank, meshes, flat.private):
        if layout is None:
            own[key] = s
        else:
            shards[key] = s
            layouts.append((key, layout))
    # what shapes the plan besides the layouts: the backend and the slicing threshold
    desc = Description(tuple(layouts), tuple(meshes.specs))
    digest = _digest(desc.digest(), comm.size, backend.name, backend.version,
                     sorted(backend.options.items()), min_slice)
    values = {k: v for k, v in flat.values.items() if k not in flat.private}
    mine = {k: v for k, v in flat.values.items() if k in flat.private}
    containers = dict(flat.containers)
    order = tuple(flat.order)
    private = Private(mine, {}, tuple((k, s.dtype.name, s.global_shape) for k, s in own.items()),
                      tuple(flat.per_rank), order)
    return Described(desc, digest, shards, own, values, containers, private, order,
                     _digest(sorted(values.items()), sorted(containers.items()), order))


@paused_gc()
def stage(state_dict: Mapping[str, Any], comm: Comm, backend: Backend, pool: BufferPool, *,
          copy: bool, cache: PlanCache | None = None, min_slice: int | None = None,
          on_copied: Callable[[], None] | None = None,
          threads: int | None = None, copy_piece: int = PIECE,
          device: DeviceParts | None = None, overflow: Overflow | None = None,
          on_queued: Callable[[list[Any]], None] | None = None,
          refer: Refer | None = None) -> StagedSave:
    """Describe, agree, plan, and take this rank's chunk bytes (collective over ``comm``).
    ``min_slice``: bytes below which replicated regions are not cut among their holders
    (default ``planning.save_plan.MIN_SLICE_BYTES``, read at each call). ``on_copied`` is
    called as soon as this rank has taken its bytes, before the ranks agree on the outcome (an
    asynchronous save resolves its ``staged`` future there). ``threads``: the threads copying
    CPU data (``SaveOptions.copy_threads``), ``copy_piece`` the bytes of one piece of a large
    copy (``SaveOptions.copy_piece``; engine/memory/copies.py). The garbage collector is paused
    meanwhile: a state of many small tensors makes many small acyclic objects (layout/nogc.py).
    ``device`` (a synchronous save, ``copy=False``): the chunks it accepts are not copied but
    streamed off their device while they are written (engine/memory/device_parts.py). ``overflow``
    (``copy=True`` under ``SaveOptions.host_memory_limit``): the chunks beyond its bound are
    streamed through its ring while written, and ``on_copied`` waits for their last byte
    (engine/memory/overflow.py). ``on_queued(events)``: called once the CPU copies are done and the
    CUDA copies queued, with a CUDA event recorded after them on each side stream (not called
    when nothing is copied from CUDA). ``refer`` (``copy=True``): called with the chunks to copy
    from the caller's CPU, contiguous tensors, as views, before any is copied; the chunks it
    names are references (``StagedSave.references``), neither copied nor counted against
    ``overflow``'s bound (CUDA and non-contiguous chunks are copied first, then tested by the
    hooks' ``after_stage``)."""
    if min_slice is None:
        min_slice = save_plan.MIN_SLICE_BYTES
    cache = plan_cache() if cache is None else cache
    d, entry, agreed = _describe_and_agree(state_dict, comm, backend, min_slice, cache)
    if agreed.cached:
        assert entry is not None  # this rank's own cache hit is part of the agreement
        plan: SavePlan = entry.plan
    else:
        plan = _plan(d, comm, backend, min_slice)
        cache.put((comm.members, comm.rank, d.digest), CachedPlan(d.digest, plan.plan_id, plan))
    content, private_plans = _index_content(d, comm, plan, agreed.values_alike)
    views = _write_views(d, plan)
    replicas = _replica_views(d, plan)
    sums: tuple[tuple[str, Box, str], ...] = ()
    if copy:  # the caller may change its tensors once stage returns: checksum them now
        sums = comm.run_everywhere("save: checksumming replicas", lambda: replica_sums(replicas))
        replicas = ()
    shards = {**d.shards, **d.own}
    del d  # freed before ``on_copied``: see ``_take_agreed``
    if copy and overflow is not None:
        device = overflow  # type: ignore[assignment]  # the same hooks: accepts, part
        if on_copied is not None:
            on_copied = functools.partial(overflow.arm, on_copied)
    elif copy:
        device = None
    chunks, leases, refs = _take_agreed(comm, views, shards, pool, copy,
                                        (copy_threads(threads), copy_piece), device, on_copied,
                                        on_queued, refer if copy else None)
    return StagedSave(comm.rank, comm.size, _Plans(plan.plans, private_plans), chunks, leases,
                      copy, sums, replicas, agreed.cached, content, references=refs,
                      staged_bytes=sum(lease.nbytes for lease in leases))


def _describe_and_agree(state_dict: Mapping[str, Any], comm: Comm, backend: Backend,
                        min_slice: int, cache: PlanCache,
                        ) -> tuple[Described, CachedPlan | None, Agreement]:
    """This rank's description, its entry in ``cache`` (None: none), and what the ranks settle
    about theirs in one collective: whether any failed, whether all may reuse the same cached
    plan, whether all plain values are alike and no rank holds PerRank state."""
    err: BaseException | None = None
    d: Described | None = None
    entry: CachedPlan | None = None
    try:
        d = describe(state_dict, comm, backend, min_slice)
        entry = cache.get((comm.members, comm.rank, d.digest))
    except Exception as e:
        err = e
    hit = d is not None and entry is not None and entry.digest == d.digest
    private = d is not None and bool(d.private.tensors or d.private.values or d.private.per_rank)
    said = comm.settle(
        "save: describing the state dict", err,
        all_true={"cached": hit, "shared only": not private},
        all_equal={"plan": entry.plan_id if entry is not None and hit else 0,
                   "values": _h63(d.values_digest) if d is not None else 0})
    assert d is not None  # settle raised on every rank if any failed
    return d, entry, Agreement(said["cached"] and said["plan"],
                               said["values"] and said["shared only"])


def _index_content(d: Described, comm: Comm, plan: SavePlan, values_alike: bool,
                   ) -> tuple[IndexContent | None, dict[str, TensorPlan]]:
    """(the coordinator's ``IndexContent``, None elsewhere; the plans of the PerRank tensors
    this rank knows: its own, every rank's on the coordinator). Unless ``values_alike``, every
    rank's values, containers and PerRank state go to the coordinator, which checks them."""
    values, containers, per_rank = d.values, d.containers, ()
    private_plans = {k: _own_plan(k, s, comm.rank) for k, s in d.own.items()}
    orders: list[tuple[str, ...]] = [d.order]
    if not values_alike:
        parts = comm.gather((d.values, d.containers, d.private), "save: merging plain values")
        def merge() -> tuple:
            assert parts is not None  # gathered on the coordinator, the one rank running this
            return merge_values(parts, plan)

        merged = comm.run_on_coordinator("save: merging plain values", merge, share=False)
        if merged is not None:
            values, containers, per_rank, private_plans, orders = merged
    if not comm.is_coordinator:
        return None, private_plans
    tensors = {k: (lay.dtype, lay.shape) for k, lay in plan.layouts.items()}
    tensors.update((k, (p.dtype, p.shape)) for k, p in private_plans.items())
    order = merge_order(orders, [*containers, *values, *tensors])
    return IndexContent(values, containers, tensors, tuple(order), per_rank), private_plans


def _write_views(d: Described, plan: SavePlan) -> list[tuple[str, tuple[int, ...], Box, torch.Tensor]]:
    """(key, global shape, box, view) of every chunk this rank writes: its planned writes, then
    its PerRank tensors."""
    views = []
    for key, box in plan.writes():
        s = d.shards[key]
        local = s.local.detach()
        # a rank writing its whole shard (the usual case) takes it as it is: no indexing
        views.append((key, s.global_shape, box,
                      local if box == s.box else local[box.relative_to(s.box).slices()]))
    for key, s in d.own.items():
        if s.box.volume:
            views.append((key, s.global_shape, s.box, s.local.detach()))
    return views


def _take_agreed(comm: Comm, views: list, shards: dict[str, LocalShard], pool: BufferPool,
                 copy: bool, threads: tuple[int, int], device: DeviceParts | None,
                 on_copied: Callable[[], None] | None,
                 on_queued: Callable[[list[Any]], None] | None = None,
                 refer: Refer | None = None,
                 ) -> tuple[tuple[ChunkData, ...], tuple[Lease, ...], Mapping[ChunkId, ChunkEntry]]:
    """``_take`` of the views ``refer`` does not name (all without it), then ``on_copied``; the
    ranks settle the outcome (a failed rank fails all, its leases given back). Empties
    ``views`` and ``shards`` (what the chunks do not hold is freed before ``on_copied``, and
    the young objects collected)."""
    taken: list[tuple[tuple[ChunkData, ...], tuple[Lease, ...]]] = []
    refs: dict[ChunkId, ChunkEntry] = {}

    def take() -> None:
        if refer is not None:  # hashed in place before copying: a reference is never copied
            refs.update(_referenced(views, shards, refer))
            views[:] = [v for v in views if (v[0], v[2].offsets, v[2].shape) not in refs]
        taken.append(_take(views, shards, pool, copy, threads, device, on_queued))
        # the views and shards not held by a chunk are freed, and the collector paused by
        # ``stage`` catches up, here, before ``on_copied``: for thousands of tensors each takes
        # tens of milliseconds in one hold of the GIL, which would stall the caller's first
        # step once ``staged`` resolves
        views.clear()
        shards.clear()
        catch_up()
        if on_copied is not None:
            on_copied()

    try:
        comm.run_everywhere("save: copying the chunks", take)
    except BaseException:
        if taken:
            _release(taken[0][1], pool)
        raise
    return (*taken[0], refs)


def _referenced(views: list, shards: Mapping[str, LocalShard], refer: Refer
                ) -> Mapping[ChunkId, ChunkEntry]:
    """What ``refer`` records as references among the views it can read in place: CPU,
    contiguous and not empty. A CUDA chunk's bytes are not on the host before they are copied:
    it is staged, then hashed (the hooks' ``after_stage``), as a non-contiguous one is."""
    host = [ChunkData(key, shards[key].dtype, shape, box, data) for key, shape, box, data in views
            if data.numel() and not _needs_copy(data)]
    return refer(host) if host else {}


def _plan(d: Described, comm: Comm, backend: Backend, min_slice: int) -> SavePlan:
    """Exchange the distinct descriptions, check them, plan (collective)."""
    descs, owners = comm.distinct(d.desc, d.digest, "save: exchanging shard descriptions")
    split = backend.split_chunks if type(backend).split_chunks is not Backend.split_chunks else None

    def agree() -> SavePlan:
        layouts = agree_layouts(descs, owners, lambda n: from_name(n).itemsize)
        pid = _h63(_digest(owners, [x.digest() for x in descs], comm.size, backend.name,
                           backend.version, sorted(backend.options.items()), min_slice))
        plan = SavePlan(layouts, comm.rank, comm.size, split, min_slice, descs=descs,
                        owners=owners, plan_id=pid)
        plan.writes()  # this rank's part of the plan, computed now (it is cached with it)
        plan.replicas()
        return plan

    return comm.run_everywhere("save: checking the shards of every rank", agree)


def _own_plan(key: str, s: LocalShard, rank: int) -> TensorPlan:
    isz = s.dtype.itemsize
    chunks = (PlannedChunk(s.box, rank, (rank,)),) if s.box.volume else ()
    return TensorPlan(key, s.dtype.name, s.global_shape, isz, chunks)


def _replica_views(d: Described, plan: SavePlan) -> tuple[tuple[str, Box, torch.Tensor], ...]:
    """The slices of plain tensors this rank holds but another rank writes (views)."""
    out = []
    for key, box in plan.replicas():
        s = d.shards.get(key)
        if s is not None:
            out.append((key, box, s.local.detach()[box.relative_to(s.box).slices()]))
    return tuple(out)


def replica_sums(replicas: Sequence[tuple[str, Box, torch.Tensor]], *, yielding: bool = False
                 ) -> tuple[tuple[str, Box, str], ...]:
    """(key, slice, checksum) of each replica slice (``yielding``: as for ``crc_of``, so that
    I/O threads writing meanwhile get the GIL)."""
    out = []
    for key, box, view in replicas:
        if view.device.type != "cpu" or not view.is_contiguous():
            view = view.to("cpu").contiguous()
        out.append((key, box, checksum(tensor_bytes(view), yielding=yielding)))
    return tuple(out)


class _Plans(Mapping[str, TensorPlan]):
    """The agreed plans, then the PerRank tensors' plans."""

    def __init__(self, planned: Mapping[str, TensorPlan], own: Mapping[str, TensorPlan]) -> None:
        self._planned, self._own = planned, own

    def __getitem__(self, key: str) -> TensorPlan:
        got = self._own.get(key)
        return got if got is not None else self._planned[key]

    def __iter__(self) -> Iterator[str]:
        yield from self._planned
        yield from self._own

    def __len__(self) -> int:
        return len(self._planned) + len(self._own)


def split_plans(plans: Mapping[str, TensorPlan]) -> tuple[Any, Mapping[str, TensorPlan]] | None:
    """A staged save's plans as (the agreed plans, the PerRank plans), or None when they are
    not in that form (a writer process keeps the agreed plans of the plan cache)."""
    if isinstance(plans, _Plans):
        return plans._planned, plans._own
    return None


def join_plans(planned: Any, own: Mapping[str, TensorPlan]
               ) -> Mapping[str, TensorPlan]:
    """The plans ``split_plans`` split."""
    return _Plans(planned, own)


def merge_values(parts: Sequence[tuple[Mapping[str, Json], Mapping[str, str], Private]],
                 plan: SavePlan) -> tuple[dict[str, Json], dict[str, str], tuple[str, ...],
                                          dict[str, TensorPlan], list[tuple[str, ...]]]:
    """Coordinator: every rank's plain values (which must agree where ranks share them),
    containers and PerRank state; raises ShardingError naming the key and the ranks."""
    values: dict[str, Json] = {}
    holders: dict[str, list[int]] = {}
    containers: dict[str, str] = {}
    per_rank: set[str] = set()
    own: dict[str, TensorPlan] = {}
    for r, (vals, conts, priv) in enumerate(parts):
        for k, v in vals.items():
            if k in values and values[k] != v:
                first = holders[k][0]
                raise ShardingError(
                    f"key {k!r}: ranks hold different values ({values[k]!r} on rank {first}, "
                    f"{v!r} on rank {r}); a plain value is a replica every rank holds alike. "
                    f"Save values that differ per rank with ckptfs.PerRank")
            values.setdefault(k, v)
            holders.setdefault(k, []).append(r)
        values.update(priv.values)
        for k, kind in conts.items():
            if containers.setdefault(k, kind) != kind:
                raise ShardingError(f"key {k!r}: ranks disagree whether it is a {kind} or a "
                                    f"{containers[k]}")
        per_rank.update(priv.per_rank)
        for k, dtype, shape in priv.tensors:
            isz = from_name(dtype, k).itemsize
            box = full_box(shape)
            own[k] = TensorPlan(k, dtype, shape, isz,
                                (PlannedChunk(box, r, (r,)),) if box.volume else ())
    world = len(parts)
    for k, rs in holders.items():
        scope = plan.scope_of(rs[0])
        if len(rs) != world and any(x not in set(rs) for x in scope):
            lack = [x for x in scope if x not in set(rs)]
            raise ShardingError(
                f"key {k!r}: a plain value is held by rank(s) {rs[:6]} but not by rank(s) "
                f"{lack[:6]}; every rank (of its pipeline stage) must hold it. Save values "
                f"that differ per rank with ckptfs.PerRank")
    tensors = set(plan.layouts) | set(own)
    clash = sorted((set(values) & tensors) | (set(containers) & (set(values) | tensors)))
    if clash:
        raise ShardingError(f"key {clash[0]!r} is a tensor, a value or a container on different "
                            f"ranks")
    return values, containers, tuple(sorted(per_rank)), own, [p.order for _, _, p in parts]


def _needs_copy(data: torch.Tensor) -> bool:
    return data.device.type != "cpu" or not data.is_contiguous()


def _taking(data: torch.Tensor, copy: bool, device: DeviceParts | None) -> Taking:
    if device is not None and device.accepts(data):
        return Taking.STREAMED
    if not (copy or _needs_copy(data)):
        return Taking.VIEW
    return Taking.COPIED if data.numel() else Taking.EMPTY


def _take(views: list, shards: Mapping[str, LocalShard], pool: BufferPool, copy: bool,
          threads: tuple[int, int], device: DeviceParts | None = None,
          on_queued: Callable[[list[Any]], None] | None = None,
          ) -> tuple[tuple[ChunkData, ...], tuple[Lease, ...]]:
    """ChunkData for every view: copied into leased buffers (all of them with ``copy``,
    otherwise only those that are not CPU and contiguous, and not streamed by ``device``); CPU
    copies on ``threads`` = (threads, bytes of one piece of a large copy)."""
    ways = [_taking(data, copy, device) for *_, data in views]
    wanted = [data.numel() * data.element_size()
              for way, (*_, data) in zip(ways, views, strict=True) if way is Taking.COPIED]
    leases = run_sync(pool.lease_all(wanted)) if wanted else []
    got = iter(leases)
    typed = pool.allocator.typed
    d2h = DeviceToHost() if any(way is Taking.COPIED and v[-1].is_cuda
                                for v, way in zip(views, ways, strict=True)) else None
    chunks: list[ChunkData] = []
    on_host: list[tuple[torch.Tensor, torch.Tensor]] = []  #: (buffer, source) of CPU data
    try:
        for (key, shape, box, data), way in zip(views, ways, strict=True):
            if way is Taking.STREAMED:
                chunks.append(ChunkData(key, shards[key].dtype, shape, box, data,
                                        device.part(data)))  # type: ignore[union-attr]  # set: STREAMED
                continue
            if way is Taking.COPIED:
                data = copy_chunk(data, next(got), d2h, on_host, typed)
            elif way is Taking.EMPTY:
                data = torch.empty(data.shape, dtype=data.dtype)
            chunks.append(ChunkData(key, shards[key].dtype, shape, box, data))
        copy_all(on_host, *threads)
        if d2h is not None:
            if on_queued is not None:
                on_queued(d2h.record())
            d2h.wait()  # the bytes are on the host before anyone reads them (or ``staged``)
    except BaseException:
        if d2h is not None:
            d2h.wait()  # no queued copy still writes into a buffer given back
        _release(leases, pool)
        raise
    return tuple(chunks), tuple(leases)


def copy_chunk(data: torch.Tensor, lease: Lease, d2h: DeviceToHost | None = None,
               on_host: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
               typed: Callable[[torch.Tensor, torch.dtype, torch.Size], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """``data`` copied into ``lease``'s buffer, as a tensor of its dtype and shape (CUDA data
    by ``d2h``, complete only after ``d2h.wait()``; CPU data, with ``on_host``, only queued
    there as (buffer, source) for ``copies.copy_all``). ``typed``: how the buffer is seen as
    that tensor (the pool's ``allocator.typed``: a caching allocator reuses its views)."""
    buf = (typed(lease.tensor, data.dtype, data.shape) if typed is not None
           else lease.tensor.view(data.dtype).view(data.shape))
    if d2h is not None and data.device.type == "cuda":
        d2h.copy(buf, data)
    elif on_host is not None and data.device.type == "cpu":
        on_host.append((buf, data))
    else:
        buf.copy_(data)
    return buf


class DeviceToHost:
    """Device-to-host copies queued on a side stream per device, after the work already
    queued on the device's current stream (which may still be writing the source); ``wait``
    synchronizes them. Into pinned buffers the copies run asynchronously, back to back, at the
    D2H bandwidth (52-54 GB/s of 54.9 on an H100: docs/guide/gpu.md)."""

    def __init__(self) -> None:
        self.streams = SideStreams()

    def copy(self, buf: torch.Tensor, data: torch.Tensor) -> None:
        with torch.cuda.stream(self.streams.get(data.device)):
            buf.copy_(data, non_blocking=buf.is_pinned())

    def record(self) -> list[torch.cuda.Event]:
        """A CUDA event recorded after the copies queued so far, on each side stream."""
        return self.streams.record()

    def wait(self) -> None:
        for _, stream in self.streams.items():
            stream.synchronize()


def staging_allocator(state_dict: Mapping[str, Any]) -> BufferAllocator:
    """Pinned host memory when the state dict holds CUDA tensors (for asynchronous D2H
    copies), pageable otherwise."""
    return allocator_for(_tensors(state_dict))


def has_cuda(state_dict: Mapping[str, Any]) -> bool:
    """Whether the state dict holds a tensor on a CUDA device."""
    return any(t.is_cuda for t in _tensors(state_dict))  # not .device: a new object each


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, list | tuple):
        for v in obj:
            yield from _tensors(v)


def release(staged: StagedSave, pool: BufferPool) -> None:
    """Give the staging buffers back to the pool."""
    _release(staged.leases, pool)


def _release(leases: Sequence[Lease], pool: BufferPool) -> None:
    if leases:
        run_sync(pool.release_all(leases))
