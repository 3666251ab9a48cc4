"""Values the DCP plug-in passes between ranks, and its key rules.

DCP names an item by its FQN, the dot-joined object path of the leaf in the state dict; its
planner records the path itself (``SavePlan.planner_data`` / ``Metadata.planner_data``). The
ckptfs key of an item is the canonical key of that path (layout/backends/torch_dist_keys.py), so
``ckptfs.load`` sees the nested state dict that was saved, and the reader maps ckptfs keys back
to the FQNs DCP's planners make of the same state dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.layout.backends.torch_dist_keys import key_of_path
from ckptfs.layout.index import ChunkEntry, TensorEntry
from ckptfs.layout.plan import TensorPlan

Json = Any
Path = tuple[str | int, ...]

#: ``extra`` member of the chunk of a uint8 tensor that holds the bytes DCP made of an object
#: that is not a plain value (``torch.save``): the reader hands them back to DCP as they are
OPAQUE = "dcp_object"


@dataclass(frozen=True, slots=True)
class ItemWritten:
    """What a rank did with one DCP write item (the item's ``WriteResult.storage_data``)."""

    key: str  #: the ckptfs key
    path: Path  #: DCP's object path
    dtype: str | None = None  #: tensors: the dtype name; None for a plain value
    shape: tuple[int, ...] = ()  #: tensors: the global shape
    entries: tuple[ChunkEntry, ...] = ()  #: index entries of the item's stored chunks
    values: Mapping[str, Json] = field(default_factory=dict)  #: a plain value, expanded
    containers: Mapping[str, str] = field(default_factory=dict)  #: of the expanded value
    #: the rank's files (path -> bytes, path -> crc32c) and the plans of the keys it wrote:
    #: carried by the first item of each rank only
    files: Mapping[str, int] = field(default_factory=dict)
    sums: Mapping[str, str] = field(default_factory=dict)
    plans: Mapping[str, TensorPlan] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StoredChunks:
    """What the coordinator tells a rank through ``SavePlan.storage_data``: the plan (stored
    chunks and writers) of each tensor it writes, by FQN, for backends that cut DCP's chunks
    (``Backend.split_chunks``: zarr's regular grid)."""

    world_size: int  #: ranks of the save
    plans: Mapping[str, TensorPlan]


def item_paths(planner_data: Any) -> Mapping[str, Path]:
    """DCP's FQN -> object path table (``planner_data`` of DCP's default planners), or an empty
    one for planners that keep none (then each FQN is a top-level key)."""
    if isinstance(planner_data, Mapping):
        return planner_data
    return {}


def item_key(fqn: str, paths: Mapping[str, Path]) -> tuple[str, Path]:
    """The ckptfs key and object path of DCP item ``fqn``."""
    path = tuple(paths.get(fqn, (fqn,)))
    return key_of_path(path), path


def is_opaque(entry: TensorEntry) -> bool:
    """The tensor holds DCP's bytes of an object (``OPAQUE``)."""
    return entry.dtype == "uint8" and len(entry.shape) == 1 and any(
        c.extra.get(OPAQUE) for c in entry.chunks)
