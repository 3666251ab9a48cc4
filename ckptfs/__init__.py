"""ckptfs: distributed checkpointing with a versioned, pickle-free format over fsspec.

Layers, top to bottom (imports point down only; tests/test_layers.py pins it):
  cli, demo, tools/         command-line tools
  testing/                  spawned ranks for tests, the conformance suite (+ golden checkpoints)
  save / load / metadata /  the public API: short compositions of the engine's phases
    manage
  engine/                   how a save and a load run: stage -> write -> commit; the read engine;
                            the buffer allocator; index reading; pre-download; the error boundary
  state/                    what is saved: state-dict trees, tensors, DTensors, ShardedTensor
  planning/                 who reads and writes what: save and load plans
  dist/                     the distributed runtime: collectives that never hang, node topology,
                            throttled rounds (the only user of torch.distributed collectives)
  layout/                   how bytes are laid out: index, plan values, boxes, dtypes, keys,
                            values, checksums, the Backend ABC, registry, backends
  io/                       how bytes move: async stores over fsspec/s3fs/obstore, local fast path
"""

from ckptfs._version import __version__
from ckptfs.errors import (
    AccessDeniedError,
    BackendOptionsError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    ConfigError,
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


def register_zarr_dtypes() -> None:
    """Teach zarr-python the ML data types ckptfs's zarr checkpoints use (bfloat16, float8_e4m3fn,
    float8_e5m2), so ``zarr.open_group(...)`` reads them; idempotent."""
    from ckptfs.layout.backends.zarr_dtypes import register

    register()


__all__ = [
    "INDEX_FILE",
    "AccessDeniedError",
    "Backend",
    "BackendOptionsError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "ChunkEntry",
    "CkptfsError",
    "ConfigError",
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
    "register_zarr_dtypes",
    "save",
]
