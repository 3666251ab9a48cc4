"""``ckptfs.megatron``: strategies for Megatron-Core's ``dist_checkpointing`` that save and load
through ckptfs.

    # megatron-core 0.19.x: pass them explicitly, as Megatron's own
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.SaveStrategy())
    dist_checkpointing.load(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.LoadStrategy())
    # megatron-core 0.15.x: importing ckptfs.megatron registers backend ("ckptfs", 1)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("ckptfs", 1))
    dist_checkpointing.load(sd, ckpt_dir)            # metadata.json names ("ckptfs", 1)

Both subclass Megatron's ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy``
(0.19's ``save`` keeps only those) and are built without arguments. Their DCP calls go through
``ckptfs.dcp``, as Megatron's own go through its file system writer and reader: a save hands
each rank's boxes of Megatron's ``ShardedTensor``s (global offsets; the main replica writes each
box) to ``dcp.save`` with ``ckptfs.dcp.StorageWriter``; on 0.19 the common state goes with them
as plain values, which the ``torch_dist`` layout writes in Megatron's ``common_state`` form, so
Megatron's own reader reads the checkpoint too. A load fills the ``ShardedTensor``s' tensors in
place through ``dcp.load`` with ``ckptfs.dcp.StorageReader`` (resharded: other TP/DP layouts),
from any checkpoint ckptfs reads (its own, Megatron's torch_dist or zarr, DCP's). A rank may
hold several ``ShardedTensor``s of one key (0.15's stacked layers, and with the distributed
optimizer a flat slice of each): each is its own chunk (``megatron_parts.Parts``). The
distributed optimizer's ``flattened_range`` (0.15) is stored as Megatron's torch_dist stores it,
on the chunk grid (``megatron_parts.grid``), and loaded across DP and TP changes. Needs
megatron-core (tested with 0.19.2 and 0.15.3).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner

from ckptfs.dist import Comm
from ckptfs.errors import CkptfsError, ConfigError, MissingKeysError, UnsupportedValueError, UsageError
from ckptfs.integrations.dcp import StorageReader, StorageWriter
from ckptfs.integrations.megatron_parts import Part, Parts, empty_range, load_part, saved_part
from ckptfs.layout.backends.torch_dist_keys import expand_value
from ckptfs.layout.keys import decode_key, encode_key
from ckptfs.metadata import load_metadata

try:
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        is_main_replica,
    )
    from megatron.core.dist_checkpointing.strategies import torch as _mt
except ImportError as e:  # pragma: no cover - tested in the Megatron venvs
    raise ConfigError("ckptfs.megatron needs megatron-core (0.15.x or 0.19.x); install it: "
                      "pip install megatron-core") from e

try:  # megatron-core <= 0.18: the (backend, version) registry of default strategies
    from megatron.core.dist_checkpointing.strategies.base import (
        StrategyAction,
        register_default_strategy,
    )
except ImportError:
    register_default_strategy = None

#: the backend name and version of ``metadata.json`` on megatron-core's registry (<= 0.18)
BACKEND, VERSION = "ckptfs", 1
#: the common-state key of megatron-core 0.19's sharded state dict
_COMMON = "common_state"
_REGISTRY = register_default_strategy is not None
#: the metadata.json backends whose checkpoints ckptfs reads
_READS = (BACKEND, "torch_dist", "zarr")
T = TypeVar("T")


class SaveStrategy(_mt.TorchDistSaveShardedStrategy):
    """Megatron's sharded save through ``ckptfs.dcp.StorageWriter``. ``ckptfs_backend``: the layout (default
    ``torch_dist``: Megatron's and DCP's readers read it too); ``storage_options``: the store's
    (``checkpoint_dir`` may be a URL ckptfs opens)."""

    def __init__(self, backend: str = BACKEND if _REGISTRY else "torch_dist", version: int = VERSION,
                 *, ckptfs_backend: str = "torch_dist",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, version)
        if not _REGISTRY and ckptfs_backend != "torch_dist":
            raise ConfigError(
                f"ckptfs.megatron.SaveStrategy: ckptfs_backend={ckptfs_backend!r}; with "
                f"megatron-core >= 0.19 dist_checkpointing.load reads the common state through "
                f"DCP, so the layout must be 'torch_dist'")
        self.ckptfs_backend = ckptfs_backend
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        # 0.15: Megatron's common strategy saves the ShardedObjects; 0.19: only the common
        # state comes as one, and it is saved here
        return not _REGISTRY

    def save(self, sharded_state_dict: dict, checkpoint_dir: Any) -> None:
        state = _settled("ckptfs.megatron: mapping the state to save",
                         lambda: _save_state(sharded_state_dict))
        native = not _REGISTRY and self.ckptfs_backend == "torch_dist"
        writer = StorageWriter(os.fspath(checkpoint_dir), backend=self.ckptfs_backend,
                               backend_options={"megatron": "common_state"} if native else None,
                               storage_options=self.storage_options or None)
        with _ckptfs_errors():
            dcp.save(state, storage_writer=writer, planner=DefaultSavePlanner(flatten_state_dict=False))

    def async_save(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any) -> Any:
        raise UsageError("ckptfs.megatron.SaveStrategy: async_sharded_save is not supported; "
                         "save synchronously (or use ckptfs.CheckpointManager for background saves)")


class LoadStrategy(_mt.TorchDistLoadShardedStrategy):
    """Megatron's sharded load through ``ckptfs.dcp.StorageReader`` (any checkpoint ckptfs
    reads)."""

    def __init__(self, *, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return not _REGISTRY

    def load(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> dict:
        url = os.fspath(checkpoint_dir)
        options = self.storage_options or None
        parts = _settled("ckptfs.megatron: mapping the state to load",
                         lambda: _load_parts(sharded_state_dict, url, options))
        reader = StorageReader(url, storage_options=options)
        with _ckptfs_errors():
            dcp.load({key: Parts(ps) for key, ps in parts.items()}, storage_reader=reader,
                     planner=DefaultLoadPlanner(flatten_state_dict=False))
        for p in (p for ps in parts.values() for p in ps):
            if p.finish is not None:
                p.finish()
        return dict_list_map_inplace(lambda sh: sh.data if isinstance(sh, ShardedTensor) else sh,
                                     sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> dict:
        """Every tensor's key, global shape and dtype (from the index; no tensor data)."""
        out = {}
        stored = _stored(os.fspath(checkpoint_dir), self.storage_options or None)
        for key, (shape, dtype) in stored.items():
            meta = torch.empty(shape, dtype=_dtype(dtype), device="meta")
            out[key] = ShardedTensor.from_rank_offsets(key, meta).without_data()
        return out

    def load_sharded_metadata(self, checkpoint_dir: Any) -> dict:
        return self.load_tensors_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend not in _READS:
            raise ConfigError(f"ckptfs.megatron.LoadStrategy: metadata.json names backend "
                              f"{loaded_backend!r}; this strategy loads {list(_READS)}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version != VERSION:
            raise ConfigError(f"ckptfs.megatron.LoadStrategy: metadata.json names backend version "
                              f"{loaded_version!r}; this strategy knows version {VERSION}")


def _save_state(sharded_state_dict: dict) -> dict[str, Any]:
    """What this rank hands ``dcp.save``: each key's boxes of the main replica (``Parts``) and, on
    0.19 from the common state's main replica, its entries as plain values."""
    common: dict[str, Any] = {}
    main_common = False
    parts: dict[str, list[Part]] = {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject) and sh.key == _COMMON and not _REGISTRY:
            common.update(sh.data)
            main_common = is_main_replica(sh.replica_id)
        elif isinstance(sh, ShardedTensor):
            if is_main_replica(sh.replica_id) and not empty_range(sh):
                parts.setdefault(sh.key, []).append(saved_part(sh, sh.data.detach()))
        else:
            raise UnsupportedValueError(
                f"ckptfs.megatron: {_what(sh)} is not supported (ckptfs stores no pickled "
                f"objects); keep it in the common state as plain values")
    state: dict[str, Any] = {key: Parts(ps) for key, ps in parts.items()}
    values = {key: _plain(key, value) for key, value in common.items()}
    for key in values.keys() & {sh.key for sh in nested_values(sharded_state_dict)
                                if isinstance(sh, ShardedTensor)}:
        raise UnsupportedValueError(f"ckptfs.megatron: key {key!r} is both a tensor's and a "
                                    f"common state's")
    if main_common:  # Megatron gives every rank the common state, rank 0 the main replica
        state.update(values)
    return state


def _load_parts(sharded_state_dict: dict, url: str,
                options: Mapping[str, Any] | None) -> dict[str, list[Part]]:
    """What this rank reads for each key: its ``ShardedTensor``s' boxes as the checkpoint
    stores the key (``load_part``). A key the checkpoint lacks is refused, naming it."""
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            raise UnsupportedValueError(f"ckptfs.megatron: loading {_what(sh)} is not supported")
    tensors = [sh for sh in nested_values(sharded_state_dict) if not empty_range(sh)]
    stored = {k: shape for k, (shape, _) in _stored(url, options).items()}
    missing = sorted({sh.key for sh in tensors} - stored.keys())
    if missing:
        raise MissingKeysError(url, missing)
    parts: dict[str, list[Part]] = {}
    for sh in tensors:
        if sh.data is None:
            sh.init_data("cpu")
        parts.setdefault(sh.key, []).append(load_part(sh, stored[sh.key], url))
    return parts


def _settled(what: str, make: Callable[[], T]) -> T:
    """``make()`` on every rank, then one small collective: if it failed on any rank, every rank
    raises (its own error, or a ``RankError`` naming the failed ranks) before DCP's collectives,
    which would wait for the failed rank."""
    err: BaseException | None = None
    out: T | None = None
    try:
        out = make()
    except Exception as e:
        err = e
    Comm().settle(what, err)
    assert out is not None  # settle raised on every rank if any failed
    return out


def _stored(url: str, options: Mapping[str, Any] | None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every ShardedTensor key's stored shape and dtype name (from the index)."""
    out = {}
    for key, entry in load_metadata(url, storage_options=options).tensors.items():
        path = decode_key(key)
        if len(path) == 1 and isinstance(path[0], str):  # not a nested value's tensor
            out[path[0]] = (tuple(entry.shape), entry.dtype)
    return out


def _plain(key: str, value: Any) -> Any:
    """A common-state value, refused unless ckptfs stores it as values (no pickled objects:
    DCP would hand the writer its ``torch.save`` bytes, which no reader of values reads)."""
    skipped: list[str] = []
    expand_value(encode_key((key,)), value, {}, {}, skipped)
    if skipped:
        raise UnsupportedValueError(
            f"ckptfs.megatron: the common state holds values ckptfs stores no pickle of: "
            f"{'; '.join(skipped[:10])}; keep dicts, lists, tuples, None, bool, int, float and "
            f"str there")
    return value


@contextlib.contextmanager
def _ckptfs_errors() -> Iterator[None]:
    """DCP reports a failure of its storage plug-in as a ``CheckpointException`` holding each
    rank's exception; the ckptfs error among them is raised as it is."""
    try:
        yield
    except CheckpointException as e:
        for exc, _ in getattr(e, "failures", {}).values():
            if isinstance(exc, CkptfsError):
                raise exc from e
        raise


def _what(sh: Any) -> str:
    return f"{type(sh).__name__} {getattr(sh, 'key', '?')!r}"


def _dtype(name: str) -> torch.dtype:
    from ckptfs.layout.dtypes import from_name

    return from_name(name, name).torch


if _REGISTRY:  # megatron-core <= 0.18: load dispatches on metadata.json's (backend, version)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())

__all__ = ["BACKEND", "VERSION", "LoadStrategy", "SaveStrategy"]
