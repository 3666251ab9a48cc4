"""Who writes what: from the ranks' layouts to stored chunks, each with exactly one writer.

1. ``agree_layouts`` checks the distinct descriptions of all ranks against each other (dtypes,
   shapes, key sets, tiling of explicit shards) and gives every key one ``KeyLayout``. Every
   rank computes the same result from the same input.
2. ``SavePlan`` turns layouts into stored chunks. A **region** is a distinct box and the ranks
   holding it (its holder group). Within a holder group, regions are cut into slices no larger
   than the group's fair share (its bytes over its ranks, at least ``min_slice`` bytes) and the
   slices go, largest first, to the least-loaded holder: every byte is written once and a large
   replicated tensor is written by all of its holders at once. Every region of a group is held
   by each rank of the group, so a rank computes its own writes from its own layouts alone
   (O(its tensors)); every key's full ``TensorPlan`` (what the coordinator's index needs) is
   built on demand.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ckptfs.errors import ShardingError
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.plan import PlannedChunk, TensorPlan
from ckptfs.planning.layouts import REPLICATE, Description, Layout, MeshSpec, mesh_box
from ckptfs.planning.tiling import check_tiling

#: a replicated region is never cut into slices smaller than this (bytes)
MIN_SLICE_BYTES = 1 << 20

#: (key, dtype, shape, boxes) -> stored boxes, each inside one of ``boxes`` (Backend.split_chunks)
SplitFn = Callable[[str, str, tuple[int, ...], list[Box]], list[Box]]


class Group:
    """A holder group: the sorted ranks holding a region (hash computed once: groups of
    thousands of ranks are dictionary keys)."""

    __slots__ = ("_hash", "ranks")

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self._hash = hash(ranks)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Group) and self._hash == other._hash
                                 and self.ranks == other.ranks)


@dataclass(frozen=True, slots=True, eq=False)
class KeyLayout:
    """The agreed layout of one key over the whole process group: one of ``PlainLayout``,
    ``MeshLayout``, ``ExplicitLayout`` (planning/layouts.py's three kinds)."""

    kind: ClassVar[str]  #: "plain", "mesh" or "explicit"
    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int

    def region_of(self, rank: int) -> tuple[Box, Group] | None:
        """The region ``rank`` holds, or None."""
        raise NotImplementedError

    def regions(self) -> Iterator[tuple[Box, Group]]:
        """Every region (distinct non-empty boxes and their holders)."""
        raise NotImplementedError


@dataclass(frozen=True, slots=True, eq=False)
class PlainLayout(KeyLayout):
    """A plain tensor: one replica on every rank of ``scope``."""

    kind: ClassVar[str] = "plain"
    scope: Group  #: the ranks holding a replica

    def region_of(self, rank: int) -> tuple[Box, Group] | None:
        return None if _empty(self.shape) else (full_box(self.shape), self.scope)

    def regions(self) -> Iterator[tuple[Box, Group]]:
        if not _empty(self.shape):
            yield full_box(self.shape), self.scope


@dataclass(frozen=True, slots=True, eq=False)
class MeshLayout(KeyLayout):
    """A DTensor: its boxes and holders follow from the mesh and the placements."""

    kind: ClassVar[str] = "mesh"
    mesh: MeshSpec
    placements: tuple[int, ...]
    groups: dict  #: memo of holder groups (shared by the mesh's keys)

    def region_of(self, rank: int) -> tuple[Box, Group] | None:
        coord = self.mesh.coordinate(rank)
        if coord is None:
            return None
        box = mesh_box(self.shape, self.mesh, self.placements, coord)
        return (box, _mesh_group(self, coord)) if box.volume else None

    def regions(self) -> Iterator[tuple[Box, Group]]:
        axes = [range(n) if d != REPLICATE else range(1)
                for n, d in zip(self.mesh.shape, self.placements, strict=True)]
        for coord in itertools.product(*axes):
            box = mesh_box(self.shape, self.mesh, self.placements, coord)
            if box.volume:
                yield box, _mesh_group(self, coord)


@dataclass(frozen=True, slots=True, eq=False)
class ExplicitLayout(KeyLayout):
    """Shards given box by box (ShardedTensor, or a key held in several ways)."""

    kind: ClassVar[str] = "explicit"
    shards: Mapping[Box, Group]  #: every non-empty box -> its holders
    owned: Mapping[int, Box]  #: rank -> the non-empty box it holds

    def region_of(self, rank: int) -> tuple[Box, Group] | None:
        box = self.owned.get(rank)
        return None if box is None else (box, self.shards[box])

    def regions(self) -> Iterator[tuple[Box, Group]]:
        yield from self.shards.items()


def _empty(shape: tuple[int, ...]) -> bool:
    return math.prod(shape) == 0


def region_of(lay: KeyLayout, rank: int) -> tuple[Box, Group] | None:
    """The region ``rank`` holds of ``lay``, or None."""
    return lay.region_of(rank)


def regions(lay: KeyLayout) -> Iterator[tuple[Box, Group]]:
    """Every region of ``lay`` (distinct non-empty boxes and their holders)."""
    return lay.regions()


def _mesh_group(lay: MeshLayout, coord: Sequence[int]) -> Group:
    """The ranks sharing ``coord``'s shard: every coordinate along the replicating mesh dims."""
    mesh = lay.mesh
    fixed = tuple(c if d != REPLICATE else -1 for c, d in zip(coord, lay.placements, strict=True))
    g = lay.groups.get(fixed)
    if g is None:
        axes = [range(n) if c < 0 else (c,) for n, c in zip(mesh.shape, fixed, strict=True)]
        g = lay.groups[fixed] = Group(tuple(sorted(mesh.rank_at(c)
                                                   for c in itertools.product(*axes))))
    return g


def slice_box(box: Box, k: int) -> list[Box]:
    """``box`` cut into at most ``k`` slices along its first dimension with at least ``k``
    elements (torch.chunk style: pieces of ceil(n / k)); whole rows keep slices contiguous."""
    if k <= 1 or not box.shape:
        return [box]
    dims = [d for d, n in enumerate(box.shape) if n >= k]
    if not dims:
        d = max(range(len(box.shape)), key=lambda i: box.shape[i])
        k = box.shape[d]
        if k <= 1:
            return [box]
    else:
        d = dims[0]
    n = box.shape[d]
    piece = -(-n // k)
    out = []
    for start in range(0, n, piece):
        off = list(box.offsets)
        shape = list(box.shape)
        off[d] += start
        shape[d] = min(piece, n - start)
        out.append(Box(tuple(off), tuple(shape)))
    return out


Assigned = dict[tuple[str, Box], list[tuple[Box, int]]]  #: (key, region) -> [(slice, writer)]


def assign(group: Group, items: Sequence[tuple[str, Box, int]], min_slice: int) -> Assigned:
    """Slices of a holder group's regions (``items``: key, box, bytes) and their writers."""
    ranks = group.ranks
    h = len(ranks)
    out: Assigned = {}
    if h == 1:
        for key, box, _ in items:
            out[(key, box)] = [(box, ranks[0])]
        return out
    share = max(sum(n for *_, n in items) / h, min_slice)
    heap = [(0, r) for r in ranks]  # (bytes assigned, rank): already a heap
    for key, box, nbytes in sorted(items, key=lambda t: (-t[2], t[0], t[1])):
        k = min(h, math.ceil(nbytes / share), max(1, nbytes // min_slice))
        slices = slice_box(box, k)
        per = nbytes // box.volume if box.volume else 0
        got = []
        for s in slices:
            load, r = heapq.heappop(heap)
            got.append((s, r))
            heapq.heappush(heap, (load + s.volume * per, r))
        out[(key, box)] = got
    return out


class SavePlan:
    """The agreed save plan as one rank sees it.

    ``writes()`` are the chunks this rank writes; ``slices(key)`` how a key this rank holds is
    cut among its holders; ``plans`` every key's ``TensorPlan`` (built on first access: the
    coordinator needs them all, other ranks only the keys they write).
    """

    def __init__(self, layouts: Mapping[str, KeyLayout], rank: int, world: int,
                 split: SplitFn | None = None, min_slice: int = MIN_SLICE_BYTES, *,
                 descs: Sequence[Description] = (), owners: Sequence[int] = (),
                 plan_id: int = 0) -> None:
        self.layouts = layouts
        self.rank = rank
        self.world = world
        self.split = split
        self.min_slice = min_slice
        self.descs = descs  #: the distinct descriptions it was planned from
        self.owners = owners  #: rank -> index into ``descs``
        self.plan_id = plan_id  #: the same on every rank that planned together
        self._mine: Assigned | None = None
        self._all: Assigned | None = None
        self._writes: tuple[tuple[str, Box], ...] | None = None
        self._replicas: tuple[tuple[str, Box], ...] | None = None
        self._plans: dict[str, TensorPlan] = {}
        self.plans: Mapping[str, TensorPlan] = _LazyPlans(self)

    def scope_of(self, rank: int) -> tuple[int, ...]:
        """The ranks ``rank``'s plain state is replicated over (Description.scope)."""
        if not self.descs:
            return tuple(range(self.world))
        return self.descs[self.owners[rank]].scope(self.world)

    # -- this rank ------------------------------------------------------------------------
    def _local(self) -> Assigned:
        """Assignments of every holder group this rank belongs to (from its own regions)."""
        if self._mine is None:
            if self.split is not None:  # backend chunking needs each key's every region
                self._mine = self._global()
            else:
                by_group: dict[Group, list[tuple[str, Box, int]]] = defaultdict(list)
                for key, lay in self.layouts.items():
                    reg = region_of(lay, self.rank)
                    if reg is not None:
                        by_group[reg[1]].append((key, reg[0], reg[0].volume * lay.itemsize))
                out: Assigned = {}
                for group, items in by_group.items():
                    out.update(assign(group, items, self.min_slice))
                self._mine = out
        return self._mine

    def slices(self, key: str) -> list[tuple[Box, int]]:
        """(slice, writer) of the region this rank holds of ``key`` (empty if none)."""
        reg = region_of(self.layouts[key], self.rank)
        if reg is None:
            return []
        if self.split is not None:
            return [(c.box, c.writer) for c in self.plans[key].chunks if reg[0].contains(c.box)]
        return self._local()[(key, reg[0])]

    def writes(self) -> list[tuple[str, Box]]:
        """The stored chunks this rank writes, in key order (computed once: a cached plan
        serves every later save of its structure)."""
        if self._writes is None:
            out: list[tuple[str, Box]] = []
            for key in self.layouts:
                out.extend((key, box) for box, w in self.slices(key) if w == self.rank)
            self._writes = tuple(out)
        return list(self._writes)

    def replicas(self) -> tuple[tuple[str, Box], ...]:
        """The slices of plain tensors this rank holds and another rank writes, in key order
        (computed once, as ``writes``)."""
        if self._replicas is None:
            out: list[tuple[str, Box]] = []
            for key, lay in self.layouts.items():
                if lay.kind == "plain":
                    out.extend((key, box) for box, w in self.slices(key) if w != self.rank)
            self._replicas = tuple(out)
        return self._replicas

    # -- the whole plan -----------------------------------------------------------------
    def chunk_bound(self) -> int | None:
        """At most how many chunks the whole plan has, without planning it (None where the
        backend cuts chunks itself): ``assign`` cuts a region into at most one slice per
        holder and one per ``min_slice`` bytes."""
        if self.split is not None:
            return None
        n, least = 0, self.min_slice
        for lay in self.layouts.values():
            if isinstance(lay, PlainLayout):  # most keys: one region, no box made
                size = math.prod(lay.shape)
                n += min(len(lay.scope.ranks), max(1, size * lay.itemsize // least)) if size else 0
                continue
            for box, group in regions(lay):
                n += min(len(group.ranks), max(1, box.volume * lay.itemsize // least))
        return n

    def _global(self) -> Assigned:
        if self._all is None:
            by_group: dict[Group, list[tuple[str, Box, int]]] = defaultdict(list)
            for key, lay in self.layouts.items():
                for box, group in regions(lay):
                    by_group[group].append((key, box, box.volume * lay.itemsize))
            out: Assigned = {}
            for group, items in by_group.items():
                out.update(assign(group, items, self.min_slice))
            self._all = out
        return self._all

    def plan(self, key: str) -> TensorPlan:
        got = self._plans.get(key)
        if got is not None:
            return got
        lay = self.layouts[key]
        assigned = self._global()
        chunks: list[PlannedChunk] = []
        for box, group in regions(lay):
            for s, w in assigned[(key, box)]:
                chunks.append(PlannedChunk(s, w, group.ranks))
        if self.split is not None and chunks:
            stored = self.split(key, lay.dtype, lay.shape, [c.box for c in chunks])
            owner = []
            for sb in stored:
                hit = next((c for c in chunks if c.box.contains(sb)), None)
                if hit is None:
                    raise ShardingError(f"key {key!r}: backend chunk {sb} lies in no rank's shard")
                owner.append(PlannedChunk(sb, hit.writer, hit.holders))
            chunks = owner
        chunks.sort(key=lambda c: c.box.offsets)
        got = self._plans[key] = TensorPlan(key, lay.dtype, lay.shape, lay.itemsize, tuple(chunks))
        return got


class _LazyPlans(Mapping[str, TensorPlan]):
    """Every key's TensorPlan, built when first asked for."""

    def __init__(self, plan: SavePlan) -> None:
        self._plan = plan

    def __getitem__(self, key: str) -> TensorPlan:
        if key not in self._plan.layouts:
            raise KeyError(key)
        return self._plan.plan(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._plan.layouts)

    def __len__(self) -> int:
        return len(self._plan.layouts)


def chunk_bound(plans: Mapping[str, TensorPlan]) -> int | None:
    """``SavePlan.chunk_bound`` of the plan behind ``plans`` (None for other mappings)."""
    return plans._plan.chunk_bound() if isinstance(plans, _LazyPlans) else None


def plan_boxes(tensors: Mapping[str, tuple[str, tuple[int, ...], Sequence[Box]]],
               itemsize: Callable[[str], int], split: SplitFn | None = None) -> dict[str, TensorPlan]:
    """The plan of one process that holds ``tensors`` (key -> dtype, shape, its boxes) and
    writes every chunk (rank 0): the boxes' tiling is checked, ``split`` may cut them further.
    What ``ckptfs.convert`` stores: the source's chunk boxes."""
    out = {}
    for key in sorted(tensors):
        dtype, shape, boxes = tensors[key]
        held = {b: [0] for b in boxes if b.volume}
        for b in held:
            if not b.in_bounds(shape):
                raise ShardingError(f"key {key!r}: box {b} is outside shape {list(shape)}")
        check_tiling(key, shape, held)
        stored = split(key, dtype, shape, list(held)) if split and held else list(held)
        for sb in stored:
            if not any(b.contains(sb) for b in held):
                raise ShardingError(f"key {key!r}: backend chunk {sb} lies in no box")
        chunks = tuple(sorted((PlannedChunk(b, 0, (0,)) for b in stored),
                              key=lambda c: c.box.offsets))
        out[key] = TensorPlan(key, dtype, shape, itemsize(dtype), chunks)
    return out


# -- agreeing on layouts --------------------------------------------------------------------

def _ranks(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:6]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{' ...' if len(ranks) > 6 else ''}"


@dataclass(frozen=True)
class _Ranks:
    """Who holds which description: what every key's agreement looks up."""

    descs: Sequence[Description]
    owners: Sequence[int]  #: rank -> index into ``descs``
    members: list[list[int]]  #: description -> its ranks
    scope_of: list[Group]  #: description -> the ranks its plain state is replicated over
    cover: list[frozenset[int]]  #: description -> the descriptions of the ranks in its scope

    @classmethod
    def of(cls, descs: Sequence[Description], owners: Sequence[int]) -> _Ranks:
        world = len(owners)
        members: list[list[int]] = [[] for _ in descs]
        for r, i in enumerate(owners):
            members[i].append(r)
        scopes: dict[tuple[int, ...], Group] = {}
        scope_of: list[Group] = []
        cover: list[frozenset[int]] = []
        for d in descs:
            s = d.scope(world)
            scope_of.append(scopes.setdefault(s, Group(s)))
            cover.append(frozenset(owners[r] for r in s))
        return cls(descs, owners, members, scope_of, cover)


def agree_layouts(descs: Sequence[Description], owners: Sequence[int],
                  itemsize: Callable[[str], int]) -> dict[str, KeyLayout]:
    """One layout per key from the distinct descriptions ``descs``; ``owners[r]`` is rank r's
    description. Raises ShardingError naming the key, the region and the ranks at fault."""
    ranks = _Ranks.of(descs, owners)
    meshes: dict[MeshSpec, MeshSpec] = {}  # one object per distinct mesh
    groups: dict[int, dict] = {}  # holder groups, shared by every key on one mesh
    by_key: dict[str, list[tuple[int, Layout]]] = defaultdict(list)
    for i, d in enumerate(descs):
        for key, lay in d.tensors:
            by_key[key].append((i, lay))

    out: dict[str, KeyLayout] = {}
    for key in sorted(by_key):
        entries = by_key[key]
        _check_alike(key, entries, ranks.members)
        first = entries[0][1]
        isz = itemsize(first.dtype)
        kinds = {lay.kind for _, lay in entries}
        got: KeyLayout | None = None
        if kinds == {"plain"}:
            got = _plain(key, first, isz, entries, ranks)
        elif kinds == {"mesh"}:
            got = _mesh(key, first, isz, entries, ranks, meshes, groups)
        out[key] = got or _explicit(key, first, isz, entries, descs, ranks.members)
    return out


def _check_alike(key: str, entries: list[tuple[int, Layout]], members: list[list[int]]) -> None:
    """Every description holds ``key`` with the same dtype and shape."""
    i0, first = entries[0]
    for i, lay in entries[1:]:
        if lay.dtype != first.dtype or lay.shape != first.shape:
            raise ShardingError(
                f"key {key!r}: ranks disagree: {_ranks(members[i0])} hold "
                f"{first.dtype} {list(first.shape)}, {_ranks(members[i])} hold "
                f"{lay.dtype} {list(lay.shape)}")


def _plain(key: str, first: Layout, isz: int, entries: list[tuple[int, Layout]],
           ranks: _Ranks) -> PlainLayout:
    """A plain tensor, held by every rank of each holder's scope."""
    members, scope_of = ranks.members, ranks.scope_of
    holders = {i for i, _ in entries}
    for i, _ in entries:
        if not ranks.cover[i] <= holders:
            have = sorted(r for j in holders for r in members[j])
            lack = sorted(r for r in scope_of[i].ranks if ranks.owners[r] not in holders)
            raise ShardingError(
                f"key {key!r}: a plain tensor is held by {_ranks(have)} but not by "
                f"{_ranks(lack)}. A plain tensor is a replica that every rank holds (every "
                f"rank of its pipeline stage, i.e. of the meshes of the rank's DTensors); "
                f"save state that differs per rank with ckptfs.PerRank, a shard with "
                f"ckptfs.ShardedTensor or a DTensor")
    scope = scope_of[entries[0][0]]
    if any(scope_of[i] is not scope for i, _ in entries):
        scope = Group(tuple(sorted(r for i, _ in entries for r in members[i])))
    return PlainLayout(key, first.dtype, first.shape, isz, scope=scope)


def _mesh(key: str, first: Layout, isz: int, entries: list[tuple[int, Layout]], ranks: _Ranks,
          meshes: dict[MeshSpec, MeshSpec], groups: dict[int, dict]) -> MeshLayout | None:
    """A DTensor held on one mesh with one placement everywhere, saved by every rank of the
    mesh; None where the descriptions hold it in several ways (explicit boxes then)."""
    specs = {(ranks.descs[i].meshes[lay.mesh], lay.placements) for i, lay in entries}  # type: ignore[index]
    if len(specs) != 1:
        return None
    (mesh, placements), = specs
    mesh = meshes.setdefault(mesh, mesh)
    held = sum(len(ranks.members[i]) for i, _ in entries)
    if held != len(mesh.ranks):
        have = {r for i, _ in entries for r in ranks.members[i]}
        lack = [r for r in mesh.ranks if r not in have]
        raise ShardingError(
            f"key {key!r}: DTensor on a mesh of ranks {_ranks(list(mesh.ranks))} is "
            f"not saved by {_ranks(lack)} (every rank of a DTensor's mesh must "
            f"save it)")
    return MeshLayout(key, first.dtype, first.shape, isz, mesh=mesh, placements=placements,
                      groups=groups.setdefault(id(mesh), {}))


def _explicit(key: str, first: Layout, isz: int, entries: list[tuple[int, Layout]],
              descs: Sequence[Description], members: list[list[int]]) -> ExplicitLayout:
    """Every rank's box, checked: in bounds, distinct replica ids per box, tiling."""
    shape = first.shape
    seen: dict[tuple[Box, int], int] = {}
    holders: dict[Box, list[int]] = defaultdict(list)
    for i, lay in entries:
        for r in members[i]:
            # plain tensors and DTensors held in several ways: each rank is its own replica
            # (negative ids never clash with a ShardedTensor's)
            if lay.box is not None:  # the kinds as Layout.kind tells them apart
                box, rid = lay.box, lay.replica_id
            elif lay.mesh is not None:
                mesh = descs[i].meshes[lay.mesh]
                coord = mesh.coordinate(r)
                assert coord is not None
                box, rid = mesh_box(shape, mesh, lay.placements, coord), -1 - r
            else:
                box, rid = full_box(shape), -1 - r
            if not box.in_bounds(shape):
                raise ShardingError(f"key {key!r}: rank {r}'s shard {box} is outside shape "
                                    f"{list(shape)}")
            other = seen.setdefault((box, rid), r)
            if other != r:
                raise ShardingError(
                    f"key {key!r}: ranks {other} and {r} both hold shard {box} as replica_id "
                    f"{rid}; replicas of one shard need distinct replica ids")
            if box.volume:
                holders[box].append(r)
    check_tiling(key, shape, holders)
    shards = {b: Group(tuple(sorted(rs))) for b, rs in sorted(holders.items())}
    owned = {r: b for b, g in shards.items() for r in g.ranks}
    return ExplicitLayout(key, first.dtype, shape, isz, shards=shards, owned=owned)
