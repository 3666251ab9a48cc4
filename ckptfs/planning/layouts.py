"""What a rank holds, as the planner sees it: one ``Layout`` per tensor, without data.

A layout says how a tensor is spread over the ranks, as compactly as the tensor's type allows:

- **plain**: a plain tensor, a replica on every rank of its scope (the process group, or the
  ranks of the meshes the rank's DTensors live on: a pipeline stage);
- **mesh**: a DTensor; the mesh (its ranks) and the placements determine every rank's shard, so
  one layout describes all of them and every rank of the mesh sends the same one;
- **explicit**: a hand-made ``ShardedTensor``: this rank's box and replica id.

A ``Description`` is one rank's layouts (sorted by key) and the meshes they refer to. Ranks with
equal descriptions (every rank of an SPMD job, every rank of a pipeline stage) share one digest,
so the ranks exchange each distinct description once, not once per rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptfs.layout.boxes import Box

#: placement of a mesh dimension that replicates the tensor
REPLICATE = -1


@dataclass(frozen=True, slots=True, eq=False)
class MeshSpec:
    """A device mesh as the ranks of the process group it spans. Equality and hash are by
    value; the hash is computed once (meshes of thousands of ranks are dictionary keys)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]  #: group ranks in the mesh's C order (len == prod(shape))
    _pos: dict[int, int] = field(default_factory=dict, repr=False)
    _hash: list[int] = field(default_factory=list, repr=False)

    def __hash__(self) -> int:
        if not self._hash:
            self._hash.append(hash((self.shape, self.ranks)))
        return self._hash[0]

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, MeshSpec) and hash(self) == hash(other)
                                 and self.shape == other.shape and self.ranks == other.ranks)

    def __reduce__(self):  # the position cache does not travel
        return (MeshSpec, (self.shape, self.ranks))

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """``rank``'s coordinate in the mesh, or None when it is not part of it."""
        if not self._pos:
            self._pos.update((r, i) for i, r in enumerate(self.ranks))
        i = self._pos.get(rank)
        if i is None:
            return None
        out = []
        for n in reversed(self.shape):
            out.append(i % n)
            i //= n
        return tuple(reversed(out))

    def rank_at(self, coord: Sequence[int]) -> int:
        i = 0
        for c, n in zip(coord, self.shape, strict=True):
            i = i * n + c
        return self.ranks[i]


@dataclass(frozen=True, slots=True)
class Layout:
    """How one tensor is held (see the module docstring for the three kinds)."""

    dtype: str
    shape: tuple[int, ...]
    mesh: int | None = None  #: index into ``Description.meshes`` (mesh kind)
    placements: tuple[int, ...] = ()  #: per mesh dim: the tensor dim it shards, or REPLICATE
    box: Box | None = None  #: this rank's shard (explicit kind)
    replica_id: int = 0  #: explicit kind: distinct among the ranks holding the same box

    @property
    def kind(self) -> str:
        return "explicit" if self.box is not None else "mesh" if self.mesh is not None else "plain"


@dataclass(frozen=True, slots=True)
class Description:
    """One rank's tensors without data: what the ranks agree on before planning a save."""

    tensors: tuple[tuple[str, Layout], ...]  #: sorted by key
    meshes: tuple[MeshSpec, ...] = ()

    def __reduce__(self):  # plain tuples on the wire: unpickling dataclasses is slow
        rows = tuple((k, x.dtype, x.shape, x.mesh, x.placements,
                      None if x.box is None else (x.box.offsets, x.box.shape), x.replica_id)
                     for k, x in self.tensors)
        return (_description, (rows, tuple((m.shape, m.ranks) for m in self.meshes)))

    def digest(self) -> bytes:
        """16 bytes that differ between different descriptions (BLAKE2b of the repr of its
        fields as plain tuples: a dataclass's generated repr costs microseconds a tensor)."""
        rows, meshes = self.__reduce__()[1]
        return hashlib.blake2b(repr((rows, meshes)).encode(), digest_size=16).digest()

    def scope(self, world: int) -> tuple[int, ...]:
        """The ranks this rank's plain tensors are replicated over: the union of its meshes'
        ranks, or the whole group when it has no DTensor (or its meshes span the group)."""
        if not self.meshes:
            return tuple(range(world))
        return tuple(sorted({r for m in self.meshes for r in m.ranks}))


def _description(rows: tuple, meshes: tuple) -> Description:
    return Description(
        tuple((k, Layout(dt, sh, m, pl, None if b is None else Box(*b), rid))
              for k, dt, sh, m, pl, b, rid in rows),
        tuple(MeshSpec(shape, ranks) for shape, ranks in meshes))


def mesh_box(shape: tuple[int, ...], mesh: MeshSpec, placements: tuple[int, ...],
             coord: Sequence[int]) -> Box:
    """The box of the DTensor shard at mesh coordinate ``coord``: ``Shard(d)`` placements split
    tensor dim d left to right over the mesh dims, each split torch.chunk style (pieces of
    ceil(n / k), the last ones shorter or empty), as DTensor does."""
    size = list(shape)
    off = [0] * len(shape)
    for mdim, d in enumerate(placements):
        if d == REPLICATE:
            continue
        k = mesh.shape[mdim]
        piece = -(-size[d] // k) if size[d] else 0
        start = min(piece * coord[mdim], size[d])
        n = max(0, min(size[d] - start, piece))
        off[d] += start
        size[d] = n
    # an emptied dimension sits at the tensor's end, as DTensor reports it
    off = [n if k == 0 else o for o, k, n in zip(off, size, shape, strict=True)]
    return Box(tuple(off), tuple(size))


def shard_dims(placements: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh dims that shard the tensor."""
    return tuple(i for i, d in enumerate(placements) if d != REPLICATE)
