"""``ckptfs.megatron``: strategies for Megatron-Core's ``dist_checkpointing`` that save and load
through ckptfs.

    # megatron-core 0.19.x: pass them explicitly, as Megatron's own
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.SaveStrategy())
    dist_checkpointing.load(sd, ckpt_dir, sharded_strategy=ckptfs.megatron.LoadStrategy())
    # megatron-core 0.15.x: importing ckptfs.megatron registers backend ("ckptfs", 1)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=("ckptfs", 1))
    dist_checkpointing.load(sd, ckpt_dir)            # metadata.json names ("ckptfs", 1)

Both subclass Megatron's ``TorchDistSaveShardedStrategy`` / ``TorchDistLoadShardedStrategy``
(0.19's ``save`` keeps only those) and are built without arguments. A save maps Megatron's
``ShardedTensor``s (global offsets; the main replica writes each box) to ckptfs's and calls
``ckptfs.save``; on 0.19 the common state goes with them, in Megatron's ``common_state`` form, so
Megatron's own reader reads the checkpoint too. A load fills the ``ShardedTensor``s' tensors in
place with ``ckptfs.load`` (resharded: other TP/DP layouts), from any checkpoint ckptfs reads
(its own, Megatron's torch_dist or zarr, DCP's). Needs megatron-core (tested with 0.19.2 and
0.15.3).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ckptfs.errors import ConfigError, UnsupportedValueError, UsageError
from ckptfs.layout.keys import decode_key
from ckptfs.load import load
from ckptfs.metadata import load_metadata
from ckptfs.save import save
from ckptfs.state.shards import ShardedTensor as _Shard

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


class SaveStrategy(_mt.TorchDistSaveShardedStrategy):
    """Megatron's sharded save through ``ckptfs.save``. ``ckptfs_backend``: the layout (default
    ``torch_dist``: Megatron's and DCP's readers read it too); ``storage_options``: the store's
    (``checkpoint_dir`` may be a URL ckptfs opens)."""

    def __init__(self, backend: str = BACKEND if _REGISTRY else "torch_dist", version: int = VERSION,
                 *, ckptfs_backend: str = "torch_dist",
                 storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__(backend, version)
        self.ckptfs_backend = ckptfs_backend
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        # 0.15: Megatron's common strategy saves the ShardedObjects; 0.19: only the common
        # state comes as one, and it is saved here
        return not _REGISTRY

    def save(self, sharded_state_dict: dict, checkpoint_dir: Any) -> None:
        tree: dict[str, Any] = {}
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedObject) and sh.key == _COMMON and not _REGISTRY:
                tree.update(sh.data)
            elif isinstance(sh, ShardedTensor):
                _put(tree, sh.key, _shard(sh, sh.data))
            else:
                raise UnsupportedValueError(
                    f"ckptfs.megatron: {_what(sh)} is not supported (ckptfs stores no pickled "
                    f"objects); keep it in the common state as plain values")
        native = not _REGISTRY and self.ckptfs_backend == "torch_dist"
        options = {"megatron": "common_state"} if native else {}
        save(tree, os.fspath(checkpoint_dir), backend=self.ckptfs_backend, backend_options=options,
             storage_options=self.storage_options or None)

    def async_save(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any) -> Any:
        raise UsageError("ckptfs.megatron.SaveStrategy: async_sharded_save is not supported; "
                         "save synchronously (or use ckptfs.CheckpointManager for background saves)")


class LoadStrategy(_mt.TorchDistLoadShardedStrategy):
    """Megatron's sharded load through ``ckptfs.load`` (any checkpoint ckptfs reads)."""

    def __init__(self, *, storage_options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})

    @property
    def can_handle_sharded_objects(self) -> bool:
        return not _REGISTRY

    def load(self, sharded_state_dict: dict, checkpoint_dir: Any, *args: Any, **kwargs: Any) -> dict:
        target: dict[str, Any] = {}
        for sh in nested_values(sharded_state_dict):
            if not isinstance(sh, ShardedTensor):
                raise UnsupportedValueError(f"ckptfs.megatron: loading {_what(sh)} is not supported")
            _put(target, sh.key, _shard(sh, sh.data))
        load(target, os.fspath(checkpoint_dir), storage_options=self.storage_options or None)
        return dict_list_map_inplace(lambda sh: sh.data if isinstance(sh, ShardedTensor) else sh,
                                     sharded_state_dict)

    def load_tensors_metadata(self, checkpoint_dir: Any, metadata: Any = None) -> dict:
        """Every tensor's key, global shape and dtype (from the index; no tensor data)."""
        index = load_metadata(os.fspath(checkpoint_dir), storage_options=self.storage_options or None)
        out = {}
        for key, entry in index.tensors.items():
            path = decode_key(key)
            if len(path) != 1 or not isinstance(path[0], str):
                continue  # not a ShardedTensor's key (a nested value's tensor)
            meta = torch.empty(entry.shape, dtype=_dtype(entry.dtype), device="meta")
            out[path[0]] = ShardedTensor.from_rank_offsets(path[0], meta).without_data()
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


def _shard(sh: Any, data: torch.Tensor) -> _Shard:
    """ckptfs's ShardedTensor of Megatron's: the box at ``global_offset`` (prepended axes are
    size 1 in ``local_shape``); the main replica is replica 0, the others get the rank + 1."""
    if getattr(sh, "flattened_range", None) is not None:
        raise UnsupportedValueError(
            f"ckptfs.megatron: key {sh.key!r} has a flattened_range (the distributed optimizer's "
            f"flat buffers); not supported: save the optimizer with a fully sharded layout")
    replica = 0 if is_main_replica(sh.replica_id) else 1 + torch.distributed.get_rank()
    return _Shard(data.view(sh.local_shape), tuple(sh.global_shape), tuple(sh.global_offset), replica)


def _put(tree: dict[str, Any], key: str, shard: _Shard) -> None:
    if key in tree:
        raise UnsupportedValueError(f"ckptfs.megatron: key {key!r} is held twice by this rank")
    tree[key] = shard


def _what(sh: Any) -> str:
    return f"{type(sh).__name__} {getattr(sh, 'key', '?')!r}"


def _dtype(name: str) -> torch.dtype:
    from ckptfs.layout.dtypes import from_name

    return from_name(name, name).torch


if _REGISTRY:  # megatron-core <= 0.18: load dispatches on metadata.json's (backend, version)
    register_default_strategy(StrategyAction.SAVE_SHARDED, BACKEND, VERSION, SaveStrategy())
    register_default_strategy(StrategyAction.LOAD_SHARDED, BACKEND, VERSION, LoadStrategy())

__all__ = ["BACKEND", "VERSION", "LoadStrategy", "SaveStrategy"]
