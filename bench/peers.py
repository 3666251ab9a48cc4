"""The peer checkpointers beyond DCP: OLMo-core and Megatron-Core, each through its own API.

They run in venvs of their own (``make bench-venvs``): each class imports its library only when
used. Both take the bench's state as it is (row-sharded DTensors or plain tensors) and load in
place into the same pre-faulted targets as ckptfs and DCP.

- ``OLMo-core``: ``olmo_core.distributed.checkpoint.save_state_dict`` / ``load_state_dict``
  (its DCP planner and its own ``RemoteFileSystemWriter``/``Reader``). Its writer does not fsync:
  marked in the table.
- ``Megatron`` / ``Megatron-FP``: ``megatron.core.dist_checkpointing.save`` / ``load`` with its
  default ``torch_dist`` strategies, and with them wrapped in ``FullyParallelSaveStrategyWrapper``
  / ``FullyParallelLoadStrategyWrapper``. Each local shard becomes a ``ShardedTensor`` at its
  global offset (uneven splits, ``axis_fragmentations=None``). On a CPU-only torch its save and
  load call ``torch.cuda.synchronize`` and ``torch.cuda.current_device``: both are neutralised
  during the call (and restored after), marked in the table.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import torch

from bench.libs import Checkpointer, LoadBytes, _nbytes, local_box


class OlmoCore(Checkpointer):
    name = "OLMo-core"
    note = "no fsync (library default)"

    def save(self, state, path):
        from olmo_core.distributed.checkpoint import save_state_dict

        save_state_dict(path, state, save_overwrite=True)

    def load(self, state, path):
        from olmo_core.distributed.checkpoint import load_state_dict

        load_state_dict(path, state)
        n = sum(_nbytes(t) for t in state.values())
        return LoadBytes(-1, n)


@contextmanager
def cpu_only_cuda():
    """``torch.cuda.synchronize`` a no-op and ``current_device`` 'cpu' while Megatron runs, on a
    torch without CUDA (Megatron calls both unconditionally); restored afterwards."""
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def mcore_sharded(state: dict[str, torch.Tensor]) -> dict:
    """Megatron ShardedTensors over the local shards (no copy), at their global offsets."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    out = {}
    for key, t in state.items():
        local = _local(t)
        offset, _ = local_box(t)
        out[key] = ShardedTensor(key=key, data=local, dtype=local.dtype, local_shape=tuple(local.shape),
                                 global_shape=tuple(t.shape), global_offset=offset,
                                 axis_fragmentations=None)
    return out


class Megatron(Checkpointer):
    note = "CUDA calls neutralised (CPU-only torch)"

    def __init__(self, fully_parallel: bool) -> None:
        self.fully_parallel = fully_parallel
        self.name = "Megatron-FP" if fully_parallel else "Megatron"

    def remove(self, path):
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)  # Megatron saves into an existing directory

    def save(self, state, path):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

        strategy = None
        if self.fully_parallel:
            from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                FullyParallelSaveStrategyWrapper,
            )

            strategy = FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy())
        with cpu_only_cuda():
            dist_checkpointing.save(mcore_sharded(state), path, sharded_strategy=strategy)

    def load(self, state, path):
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy

        strategy = None
        if self.fully_parallel:
            from megatron.core.dist_checkpointing.strategies.fully_parallel import (
                FullyParallelLoadStrategyWrapper,
            )

            strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path))
        with cpu_only_cuda():
            out = dist_checkpointing.load(mcore_sharded(state), path, sharded_strategy=strategy)
        if isinstance(out, tuple):
            out = out[0]
        for key, t in state.items():  # in place where Megatron loaded into the given tensor
            local, got = _local(t), out[key]
            if got.data_ptr() != local.data_ptr():
                local.copy_(got)
        return LoadBytes(-1, sum(_nbytes(t) for t in state.values()))


PEERS = {"OLMo-core": lambda: [OlmoCore()],
         "Megatron": lambda: [Megatron(False), Megatron(True)]}
#: a module each peer group needs (a runner without it skips the group)
PEER_MODULES = {"OLMo-core": "olmo_core.distributed.checkpoint",
                "Megatron": "megatron.core.dist_checkpointing"}
