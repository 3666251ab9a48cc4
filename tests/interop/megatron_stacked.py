"""Megatron's stacked layers through ckptfs.megatron's strategies, on spawned gloo ranks
(``make interop-strategies``; not in ``make test``: it needs the Megatron venvs).

With ``non_homogeneous_layers`` off (megatron-core 0.15's default), every layer of a pipeline
stage is a shard of one key along a prepended axis (``ShardedTensor.from_rank_offsets(key,
layer, (0, layer_index, layers), prepend_axis_num=1)``), so a stage of several layers holds
several shards of one key. Two ranks of two layers each save; the checkpoint is loaded bit-exact
with the same layout, by one rank holding all four layers, by two ranks holding all four layers
split on a tensor-parallel axis (four shards each), and by two ranks holding one plain (not
stacked) shard each; ckptfs reads it alone, and on 0.19 Megatron's own load strategy does too.
Shards of one key on one rank need not tile one box: ranks holding layers 0 and 2, and 1 and 3,
save too (each layer its own chunk), and load as two consecutive layers a rank. Shards of one key
on one rank of different dtypes are refused naming the key, on that rank; the other rank raises
too instead of waiting, and nothing is written.
"""

from __future__ import annotations

import os
import sys
import tempfile

import ckptfs.megatron
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from ranks import spawn

import ckptfs

NEW = not ckptfs.megatron._REGISTRY  # megatron-core >= 0.19
KEY, LAYERS, SHAPE = "decoder.layers.mlp.weight", 4, (6, 8)


def whole() -> torch.Tensor:
    return torch.arange(LAYERS * 48, dtype=torch.float32).reshape(LAYERS, *SHAPE) / 7 + 0.25


def layer(index: int, fill: bool, cols: tuple[int, int] = (0, 8)) -> torch.Tensor:
    data = whole()[index, :, cols[0]:cols[1]].clone()
    return data if fill else torch.full_like(data, -1.0)


def stacked(layers: list[int], fill: bool, tp: tuple[int, int] = (0, 1)) -> dict:
    """Megatron's stacked layers: one shard per layer, along the prepended axis 0; ``tp`` (rank,
    size) splits each layer's axis 1 (axis 2 of the global tensor)."""
    n = SHAPE[1] // tp[1]
    return {f"layer{i}": ShardedTensor.from_rank_offsets(
        KEY, layer(i, fill, (tp[0] * n, tp[0] * n + n)), (0, i, LAYERS), (2, *tp),
        prepend_axis_num=1) for i in layers}


def check(got: dict, want: dict) -> None:
    for name, sh in want.items():
        assert torch.equal(got[name], sh.data), (name, got[name])


def save_phase(rank: int, root: str) -> None:
    strategy = ckptfs.megatron.SaveStrategy() if NEW else ("ckptfs", 1)
    if rank == 0:
        os.makedirs(root)
        os.makedirs(root + "-apart")
        os.makedirs(root + "-bad")
    dist.barrier()
    dc.save(stacked([2 * rank, 2 * rank + 1], True), root, sharded_strategy=strategy)
    dc.save(stacked([rank, rank + 2], True), root + "-apart", sharded_strategy=strategy)
    mixed = stacked([2 * rank, 2 * rank + 1], True)
    if rank == 0:  # one rank only: the other must not wait in DCP's collectives
        mixed["layer0"] = ShardedTensor.from_rank_offsets(
            KEY, layer(0, True).double(), (0, 0, LAYERS), prepend_axis_num=1)
    try:  # Megatron's save checks dtypes across ranks itself: the strategy alone
        ckptfs.megatron.SaveStrategy().save(mixed, root + "-bad")
    except ckptfs.UnsupportedValueError as e:
        assert rank == 0 and KEY in str(e) and "dtypes" in str(e), e
    except ckptfs.RankError as e:
        assert rank == 1 and "mapping the state to save" in str(e), e
    else:
        raise AssertionError("float32 and float64 shards of one key on one rank were saved")
    assert not os.listdir(root + "-bad"), "a refused save wrote files"


def load(sd: dict, root: str) -> dict:
    return dc.load(sd, root, sharded_strategy=ckptfs.megatron.LoadStrategy() if NEW else None)


def run(rank: int, world: int, root: str, phase: str) -> None:
    if phase == "save":
        save_phase(rank, root)
    elif phase == "same":  # two layers a rank, as saved
        mine = [2 * rank, 2 * rank + 1]
        check(load(stacked(mine, False), root), stacked(mine, True))
        check(load(stacked(mine, False), root + "-apart"), stacked(mine, True))
        if NEW:  # Megatron's own load strategy reads it too
            check(dc.load(stacked(mine, False), root), stacked(mine, True))
    elif phase == "tp":  # every layer on each rank, its columns split in two
        check(load(stacked(list(range(LAYERS)), False, (rank, world)), root),
              stacked(list(range(LAYERS)), True, (rank, world)))
    elif phase == "plain":  # one plain shard a rank: all layers, half the rows
        rows = slice(3 * rank, 3 * rank + 3)
        want = whole()[:, rows].clone()
        sd = {"w": ShardedTensor.from_rank_offsets(KEY, torch.zeros_like(want), (1, rank, 2))}
        assert torch.equal(load(sd, root)["w"], want)


def main() -> int:
    root = os.path.join(tempfile.mkdtemp(prefix="ckptfs-megatron-"), "ckpt")
    spawn(run, 2, root, "save")
    assert torch.equal(ckptfs.load_keys(root)[KEY], whole()), "ckptfs reads it alone"
    spawn(run, 2, root, "same")
    spawn(run, 1, root, "tp")  # one rank holding all four layers
    spawn(run, 2, root, "tp")
    spawn(run, 2, root, "plain")
    print(f"ckptfs.megatron stacked layers with megatron-core "
          f"{'>= 0.19' if NEW else '<= 0.18 (registry)'}: 2x2 layers saved; loads as saved, "
          f"4 layers on 1 rank, 4 layers x TP=2, plain shards ok; layers 0 and 2 on one rank ok; "
          f"mixed dtypes refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
