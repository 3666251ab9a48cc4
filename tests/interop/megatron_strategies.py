"""ckptfs.megatron's strategies under the real megatron-core, on spawned gloo ranks
(``make interop-strategies``; not in ``make test``: it needs the Megatron venvs).

Run in a venv with megatron-core 0.19.x or 0.15.x and this repository on PYTHONPATH. Two ranks
save a tensor-parallel (TP=2) state with ``dist_checkpointing.save`` and ckptfs's save strategy
(0.19: passed explicitly; 0.15: ``("ckptfs", 1)`` from Megatron's registry): a row-split weight,
a column-split one with an uneven split, a replicated bias and the common state. Then one rank
(TP=1) and three ranks (another split) load it with ``dist_checkpointing.load``, bit-exact:
0.19 with ckptfs's load strategy and with Megatron's own; 0.15 with no strategy given (picked
from metadata.json). An unknown backend or version is refused, naming it; ckptfs reads the
checkpoint by itself; ckptfs's load strategy reads a checkpoint Megatron's own strategy wrote and
one Megatron's ``FullyParallelSaveStrategyWrapper`` wrote around ckptfs's save strategy, and
Megatron's ``FullyParallelLoadStrategyWrapper`` around it loads (its ``gather_object``
exchange). The distributed optimizer's ``flattened_range``: tests/interop/megatron_flattened.py
and megatron_flat_layers.py.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import ckptfs.megatron
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.strategies import fully_parallel as fp
from ranks import cpu_only_cuda, spawn

import ckptfs

NEW = not ckptfs.megatron._REGISTRY  # megatron-core >= 0.19
ROWS = {1: [(0, 8)], 2: [(0, 4), (4, 8)], 3: [(0, 3), (3, 5), (5, 8)]}


def whole(key: str) -> torch.Tensor:
    n = {"dense.weight": (8, 6), "proj.weight": (5, 8), "bias": (5,)}[key]
    return torch.arange(torch.Size(n).numel(), dtype=torch.float32).reshape(n) / 7 + len(key)


def state(rank: int, world: int, fill: bool) -> dict:
    lo, hi = ROWS[world][rank]
    w = whole("dense.weight")[lo:hi]  # row-split (axis 0), uneven for 3 ranks
    p = whole("proj.weight")[:, lo:hi]  # column-split (axis 1)
    b = whole("bias")
    if not fill:
        w, p, b = torch.zeros_like(w), torch.zeros_like(p), torch.zeros_like(b)
    return {
        "layer": {
            "dense.weight": ShardedTensor(key="dense.weight", data=w.contiguous(), dtype=w.dtype,
                                          local_shape=tuple(w.shape), global_shape=(8, 6),
                                          global_offset=(lo, 0), axis_fragmentations=None),
            "proj.weight": ShardedTensor(key="proj.weight", data=p.contiguous(), dtype=p.dtype,
                                         local_shape=tuple(p.shape), global_shape=(5, 8),
                                         global_offset=(0, lo), axis_fragmentations=None),
        },
        "bias": ShardedTensor.from_rank_offsets("bias", b.clone(), replica_id=rank),
        "iteration": 12, "args": {"lr": 0.5, "name": "gpt"},
    }


def check(got: dict, rank: int, world: int) -> None:
    want = state(rank, world, True)
    for k in ("dense.weight", "proj.weight"):
        assert torch.equal(got["layer"][k], want["layer"][k].data), (k, got["layer"][k])
    assert torch.equal(got["bias"], want["bias"].data)
    assert got["iteration"] == 12 and got["args"] == {"lr": 0.5, "name": "gpt"}, got


def run(rank: int, world: int, root: str, phase: str) -> None:
    if phase == "save":
        if rank == 0:
            os.makedirs(root)
        dist.barrier()
        strategy = ckptfs.megatron.SaveStrategy() if NEW else ("ckptfs", 1)
        dc.save(state(rank, world, True), root, sharded_strategy=strategy)
        if rank == 0:
            os.makedirs(root + "-own")
        dist.barrier()
        cpu_only_cuda()
        dc.save(state(rank, world, True), root + "-own")  # Megatron's own torch_dist
        if rank == 0:
            os.makedirs(root + "-fp")
        dist.barrier()
        dc.save(state(rank, world, True), root + "-fp",
                sharded_strategy=fp.FullyParallelSaveStrategyWrapper(
                    ckptfs.megatron.SaveStrategy(), None, False, *backend_of_wrapper()))
    else:
        if NEW:
            check(dc.load(state(rank, world, False), root,
                          sharded_strategy=ckptfs.megatron.LoadStrategy()), rank, world)
            check(dc.load(state(rank, world, False), root), rank, world)  # Megatron's own
        else:
            check(dc.load(state(rank, world, False), root), rank, world)
        own = dc.load(state(rank, world, False), root + "-own",
                      sharded_strategy=ckptfs.megatron.LoadStrategy())
        check(own, rank, world)  # a checkpoint Megatron wrote, read by ckptfs's strategy
        # what Megatron's fully parallel save wrapper around ckptfs's wrote
        check(dc.load(state(rank, world, False), root + "-fp",
                      sharded_strategy=ckptfs.megatron.LoadStrategy()), rank, world)
        # Megatron's fully parallel load wrapper around ckptfs's: each rank loads part of the
        # boxes and the ranks exchange them; "gather_object" is its exchange that stays on the
        # tensors' device (its others allocate on "cuda"), and its torch.cuda.synchronize()
        # calls are made no-ops on a CPU-only machine (cpu_only_cuda)
        cpu_only_cuda()
        wrapped = fp.FullyParallelLoadStrategyWrapper(ckptfs.megatron.LoadStrategy(), None, False,
                                                      "gather_object")
        check(dc.load(state(rank, world, False), root, sharded_strategy=wrapped), rank, world)
        meta = ckptfs.megatron.LoadStrategy().load_tensors_metadata(root)
        assert meta["dense.weight"].global_shape == (8, 6), meta


def backend_of_wrapper() -> tuple:
    """The (backend, version) 0.19's save wrapper reports in metadata.json (0.15's: its
    strategy's)."""
    return ("torch_dist", 1) if NEW else ()






def main() -> int:
    root = os.path.join(tempfile.mkdtemp(prefix="ckptfs-megatron-"), "ckpt")
    spawn(run, 2, root, "save")
    with open(os.path.join(root, "metadata.json")) as f:
        config = json.load(f)
    assert config["sharded_backend"] == ("torch_dist" if NEW else "ckptfs"), config
    for bad, call in ((2, "check_version_compatibility"), ("tensorstore", "check_backend_compatibility")):
        try:
            getattr(ckptfs.megatron.LoadStrategy(), call)(bad)
        except ckptfs.ConfigError as e:
            assert repr(bad) in str(e), e
        else:
            raise AssertionError(f"{call}({bad!r}) passed")
    got = ckptfs.load_keys(root)
    assert torch.equal(got["dense.weight"], whole("dense.weight")), "ckptfs reads it alone"
    for world in (1, 3):
        spawn(run, world, root, "load")
    print(f"ckptfs.megatron strategies with megatron-core "
          f"{'>= 0.19' if NEW else '<= 0.18 (registry)'}: TP=2 save, TP=1 and 3-rank loads ok (also through the fully parallel wrappers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
