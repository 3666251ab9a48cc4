"""What one rank holds of a tensor: plain tensors, DTensors and explicit ShardedTensors."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeGuard, cast

import torch

from ckptfs.errors import ShardingError, UnsupportedValueError
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.dtypes import DType, from_torch
from ckptfs.planning.layouts import REPLICATE, Layout, MeshSpec, mesh_box

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(obj: object) -> TypeGuard[DTensor]:
    """Whether ``obj`` is a DTensor. An object can only be one once its module is imported, so
    the module is looked up, never imported here: importing it (and the symbolic-shapes code it
    pulls in) would cost every process that never makes a DTensor most of a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


@dataclass(frozen=True)
class ShardedTensor:
    """A hand-made shard: ``local_tensor`` is the box ``[global_offset, +shape)`` of a tensor of
    ``global_shape``. Ranks holding the same box are replicas and must use distinct
    ``replica_id``s; each box is written once, by one of its holders."""

    local_tensor: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "global_shape", tuple(int(x) for x in self.global_shape))
        object.__setattr__(self, "global_offset", tuple(int(x) for x in self.global_offset))
        box = Box(self.global_offset, tuple(self.local_tensor.shape))
        if len(self.global_shape) != self.local_tensor.dim() or not box.in_bounds(self.global_shape):
            raise ShardingError(
                f"ShardedTensor: local shape {tuple(self.local_tensor.shape)} at offset "
                f"{self.global_offset} does not fit in global shape {self.global_shape}"
            )


@dataclass(frozen=True)
class LocalShard:
    """One rank's piece of one tensor, in global coordinates."""

    key: str
    local: torch.Tensor  #: the data this rank holds (a view of the user's tensor)
    dtype: DType
    global_shape: tuple[int, ...]
    box: Box  #: where ``local`` sits in the global tensor
    replica_id: int  #: distinct among ranks holding the same box


#: the types a state dict's tensors are (an ``isinstance`` test per leaf, no call)
TENSOR_LIKE = (torch.Tensor, ShardedTensor)


def is_tensor_like(obj: object) -> bool:
    return isinstance(obj, TENSOR_LIKE)


def is_plain_tensor(obj: object) -> bool:
    """A tensor that is neither a DTensor nor a ShardedTensor (a replica on every rank)."""
    return isinstance(obj, torch.Tensor) and not is_dtensor(obj)


def local_shard(key: str, obj: torch.Tensor | ShardedTensor, rank: int) -> LocalShard | None:
    """Describe what this rank holds of ``obj``; None when the rank holds nothing of it."""
    if isinstance(obj, ShardedTensor):
        t = obj.local_tensor
        return LocalShard(key, t, from_torch(t.dtype, key), obj.global_shape,
                          Box(obj.global_offset, tuple(t.shape)), obj.replica_id)
    if is_dtensor(obj):
        return _dtensor_shard(key, obj)
    if isinstance(obj, torch.Tensor):
        if obj.is_sparse or obj.layout != torch.strided:
            raise UnsupportedValueError(f"key {key!r}: {obj.layout} tensors cannot be stored")
        return LocalShard(key, obj, from_torch(obj.dtype, key), tuple(obj.shape),
                          full_box(obj.shape), rank)
    raise UnsupportedValueError(f"key {key!r}: {type(obj).__name__} is not a tensor")


def _dtensor_shard(key: str, x: DTensor) -> LocalShard | None:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    mesh, placements = x.device_mesh, x.placements
    coord = mesh.get_coordinate()
    if coord is None:  # this rank is not in the mesh
        return None
    replica_id, stride = 0, 1
    for dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise UnsupportedValueError(
                f"key {key!r}: DTensor with a Partial placement on mesh dim {dim}; "
                "reduce it first (x.redistribute(placements=[Replicate()...]))"
            )
        if type(p) is not Shard and not isinstance(p, Replicate):
            raise UnsupportedValueError(
                f"key {key!r}: DTensor placement {p} is not supported (Shard and Replicate are)"
            )
        if isinstance(p, Replicate):
            replica_id += coord[dim] * stride
            stride *= mesh.size(dim)
    shape, offset = compute_local_shape_and_global_offset(x.shape, mesh, placements)
    local = x._local_tensor
    if tuple(local.shape) != tuple(shape):
        raise ShardingError(
            f"key {key!r}: DTensor local tensor has shape {tuple(local.shape)}, "
            f"its placements imply {tuple(shape)}"
        )
    if math.prod(shape) == 0:
        offset = tuple(min(o, n) for o, n in zip(offset, x.shape, strict=True))
    return LocalShard(key, local, from_torch(x.dtype, key), tuple(x.shape),
                      Box(tuple(offset), tuple(shape)), replica_id)


@dataclass
class MeshTable:
    """The meshes of one rank's DTensors, each once (``Description.meshes``), as ranks of the
    process group (``group_rank`` maps a global rank; None when the rank is outside it)."""

    group_rank: Callable[[int], int | None]
    specs: list[MeshSpec] = field(default_factory=list)
    _index: dict[int, int | None] = field(default_factory=dict)  #: id(DeviceMesh) -> index
    _by_spec: dict[MeshSpec, int] = field(default_factory=dict)

    def index(self, mesh) -> int | None:
        """Index of ``mesh``'s spec, or None when a rank of it is outside the process group."""
        got = self._index.get(id(mesh), -1)
        if got != -1:
            return got
        ranks = [self.group_rank(int(r)) for r in mesh.mesh.flatten().tolist()]
        if any(r is None for r in ranks):
            out = None
        else:
            spec = MeshSpec(tuple(int(n) for n in mesh.mesh.shape),
                            tuple(cast("list[int]", ranks)))  # no None: checked above
            out = self._by_spec.setdefault(spec, len(self.specs))
            if out == len(self.specs):
                self.specs.append(spec)
        self._index[id(mesh)] = out
        return out


def tensor_layout(shard: LocalShard, obj: torch.Tensor | ShardedTensor, rank: int,
                  meshes: MeshTable) -> Layout:
    """The planner's view of ``shard`` (``local_shard(key, obj, rank)``): plain, mesh (a DTensor
    whose placements give this very box) or explicit."""
    dtype, shape = shard.dtype.name, shard.global_shape
    if isinstance(obj, ShardedTensor):
        return Layout(dtype, shape, box=shard.box, replica_id=shard.replica_id)
    if is_dtensor(obj):
        from torch.distributed.tensor.placement_types import Shard

        i = meshes.index(obj.device_mesh)
        if i is not None:
            spec = meshes.specs[i]
            placements = tuple(p.dim % max(len(shape), 1) if isinstance(p, Shard) else REPLICATE
                               for p in obj.placements)
            coord = spec.coordinate(rank)
            if coord is not None:
                box = mesh_box(shape, spec, placements, coord)
                # an empty shard's offset is immaterial (DTensor and the planner clamp it apart)
                if box == shard.box or box.volume == shard.box.volume == 0:
                    return Layout(dtype, shape, mesh=i, placements=placements)
        return Layout(dtype, shape, box=shard.box, replica_id=shard.replica_id)
    return Layout(dtype, shape)


def described_shards(tensors: Mapping[str, torch.Tensor | ShardedTensor], rank: int,
                     meshes: MeshTable, private: Container[str] = ()
                     ) -> list[tuple[str, LocalShard, Layout | None]]:
    """(key, ``local_shard``, ``tensor_layout``) of each tensor this rank holds, in key order
    (one call for a save's description); ``private`` keys get no layout (None)."""
    out = []
    for key in sorted(tensors):
        obj = tensors[key]
        s = local_shard(key, obj, rank)
        if s is not None:
            out.append((key, s, None if key in private else tensor_layout(s, obj, rank, meshes)))
    return out
