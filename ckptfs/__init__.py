"""ckptfs: distributed checkpointing with a versioned, pickle-free format over fsspec.

Layers, top to bottom (imports point down only):
  save / load / metadata    the public API and its orchestration
  state/                    what is saved: state-dict trees, tensors, DTensors, ShardedTensor
  planning/                 who reads and writes what: save and load plans, collectives
  layout/                   how bytes are laid out: index, boxes, dtypes, keys, backends, registry
  io/                       how bytes move: async stores over fsspec, local fast path
"""

from ckptfs._version import __version__
from ckptfs.errors import (
    BackendOptionsError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    ForbiddenGlobalError,
    FormatVersionError,
    IntegrityError,
    MalformedIndexError,
    MismatchError,
    MissingKeysError,
    RankError,
    ShardingError,
    StorageError,
    UnknownBackendError,
    UnsupportedValueError,
)
from ckptfs.io.store import IOConfig
from ckptfs.layout.backend import Backend
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import available_backends, get_backend, register_backend
from ckptfs.load import LoadResult, load, load_keys
from ckptfs.manage import delete
from ckptfs.metadata import load_metadata
from ckptfs.save import SaveResult, save
from ckptfs.state.shards import ShardedTensor

__all__ = [
    "INDEX_FILE",
    "Backend",
    "BackendOptionsError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChunkEntry",
    "CkptfsError",
    "ForbiddenGlobalError",
    "FormatVersionError",
    "IOConfig",
    "Index",
    "IntegrityError",
    "LoadResult",
    "MalformedIndexError",
    "MismatchError",
    "MissingKeysError",
    "RankError",
    "SaveResult",
    "ShardedTensor",
    "ShardingError",
    "StorageError",
    "TensorEntry",
    "UnknownBackendError",
    "UnsupportedValueError",
    "__version__",
    "available_backends",
    "delete",
    "get_backend",
    "load",
    "load_keys",
    "load_metadata",
    "register_backend",
    "save",
]
