"""ckptfs: distributed checkpointing with a versioned, pickle-free format over fsspec.

Layers, top to bottom (imports point down only; tests/test_layers.py pins it):
  cli, demo, tools/         command-line tools: inspect, verify, convert, unshard, bench; the
                            model+optimizer helpers (re-exported here lazily)
  testing/                  spawned ranks for tests, the conformance suite (+ golden checkpoints)
  save / async_save / load  the public API: short compositions of the engine's phases
    / metadata / deletion     (manager/: CheckpointManager, steps, retention, local tier)
  engine/                   how a save and a load run: stage -> write -> commit; the read engine;
                            the buffer allocator; index reading; pre-download; the error boundary
  state/                    what is saved: state-dict trees, tensors, DTensors, ShardedTensor
  planning/                 who reads and writes what: save and load plans
  dist/                     the distributed runtime: collectives that never hang, node topology,
                            throttled rounds (the only user of torch.distributed collectives)
  layout/                   how bytes are laid out: index, plan values, boxes, dtypes, keys,
                            values, checksums, the Backend ABC, registry, backends
  io/                       how bytes move: async stores over fsspec/s3fs/obstore, local fast path,
                            the store registry by URL protocol
  runtime                   the process's long-lived resources, closed by ``close()``
"""

from ckptfs import _aliases
from ckptfs._version import __version__
from ckptfs.async_save import AsyncSave, async_save, close
from ckptfs.deletion import delete
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.errors import (
    AccessDeniedError,
    BackendOptionsError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CollectiveError,
    ConfigError,
    ForbiddenGlobalError,
    FormatVersionError,
    IntegrityError,
    MalformedIndexError,
    MismatchError,
    MissingKeysError,
    NonFiniteError,
    RankError,
    ReferencedCheckpointError,
    SaveInProgressError,
    ShardingError,
    StorageError,
    UnknownBackendError,
    UnsupportedValueError,
    UsageError,
    WriterError,
)
from ckptfs.layout.backend import Backend
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry
from ckptfs.layout.registry import available_backends, get_backend, register_backend
from ckptfs.load import LoadResult, load, load_keys
from ckptfs.manager import (
    CheckpointManager,
    ManagerOptions,
    PreemptionPolicy,
    RestoreResult,
    Retention,
    TierOptions,
)
from ckptfs.metadata import load_metadata
from ckptfs.options import (
    AsyncOptions,
    DistOptions,
    HealthOptions,
    LoadOptions,
    SaveOptions,
    StoreOptions,
    removed_attribute,
)
from ckptfs.save import SaveResult, save
from ckptfs.state.flatten import PerRank
from ckptfs.state.shards import ShardedTensor

_aliases.install()  # ckptfs.dcp, ckptfs.lightning, ...: ckptfs/integrations/, on first use


def register_zarr_dtypes() -> None:
    """Teach zarr-python the ML data types ckptfs's zarr checkpoints use (bfloat16, float8_e4m3fn,
    float8_e5m2), so ``zarr.open_group(...)`` reads them; idempotent."""
    from ckptfs.layout.backends.zarr_dtypes import register

    register()


#: Tools (ckptfs/tools/, a layer above this API) exported here and imported on first use
#: (PEP 562), so ``import ckptfs`` stays light and imports still point down only.
_TOOLS: dict[str, str] = {
    "verify": "ckptfs.tools.verify",
    "VerifyReport": "ckptfs.tools.verify",
    "Problem": "ckptfs.tools.verify",
    "convert": "ckptfs.tools.convert",
    "ConvertResult": "ckptfs.tools.convert",
    "unshard": "ckptfs.tools.unshard",
    "UnshardResult": "ckptfs.tools.unshard",
    "export_hf": "ckptfs.tools.hf_export",
    "load_hf_fp8": "ckptfs.tools.hf_fp8",
    "load_hf_quantized": "ckptfs.tools.hf_fp8",
    "save_model_and_optim_state": "ckptfs.tools.model_state",
    "async_save_model_and_optim_state": "ckptfs.tools.model_state",
    "load_model_and_optim_state": "ckptfs.tools.model_state",
    "clean": "ckptfs.tools.clean",
    "CleanResult": "ckptfs.tools.clean",
    "diff": "ckptfs.tools.diff",
    "DiffReport": "ckptfs.tools.diff",
    "KeyDiff": "ckptfs.tools.diff",
    "to_torch_save": "ckptfs.tools.torch_save",
    "from_torch_save": "ckptfs.tools.torch_save",
}


def __getattr__(name: str):
    import importlib

    if f"ckptfs.{name}" in _aliases.DROP_INS:  # ckptfs.dcp, ... without an import statement
        return importlib.import_module(f"ckptfs.{name}")
    module = _TOOLS.get(name)
    if module is None:
        return removed_attribute(name)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_TOOLS})


__all__ = [
    "INDEX_FILE",
    "AccessDeniedError",
    "AsyncOptions",
    "AsyncSave",
    "Backend",
    "BackendOptionsError",
    "BackgroundSaver",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "ChunkEntry",
    "CkptfsError",
    "CleanResult",
    "CollectiveError",
    "ConfigError",
    "ConvertResult",
    "DiffReport",
    "DistOptions",
    "ForbiddenGlobalError",
    "FormatVersionError",
    "HealthOptions",
    "Index",
    "IntegrityError",
    "KeyDiff",
    "LoadOptions",
    "LoadResult",
    "MalformedIndexError",
    "ManagerOptions",
    "MismatchError",
    "MissingKeysError",
    "NonFiniteError",
    "PerRank",
    "PreemptionPolicy",
    "Problem",
    "RankError",
    "ReferencedCheckpointError",
    "RestoreResult",
    "Retention",
    "SaveInProgressError",
    "SaveOptions",
    "SaveResult",
    "ShardedTensor",
    "ShardingError",
    "StorageError",
    "StoreOptions",
    "TensorEntry",
    "TierOptions",
    "UnknownBackendError",
    "UnshardResult",
    "UnsupportedValueError",
    "UsageError",
    "VerifyReport",
    "WriterError",
    "__version__",
    "async_save",
    "async_save_model_and_optim_state",
    "available_backends",
    "clean",
    "close",
    "convert",
    "delete",
    "diff",
    "export_hf",
    "from_torch_save",
    "get_backend",
    "load",
    "load_hf_fp8",
    "load_hf_quantized",
    "load_keys",
    "load_metadata",
    "load_model_and_optim_state",
    "register_backend",
    "register_zarr_dtypes",
    "save",
    "save_model_and_optim_state",
    "to_torch_save",
    "unshard",
    "verify",
]
