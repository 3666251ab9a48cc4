"""The distributed optimizer's ``flattened_range`` through ckptfs.megatron's strategies, under
the real megatron-core on spawned gloo ranks (``make interop-strategies``).

Megatron's distributed optimizer keeps each data-parallel rank's optimizer state as a slice of
one flat buffer: the tensor-parallel-local parameters flattened one after another and cut in DP
equal parts, so a rank holds a 1-D slice (``flattened_range``) of some parameters' local chunks,
made with Megatron's ``ShardedTensor.from_rank_offsets_flat`` as the optimizer makes them.

megatron-core 0.15.x: two ranks save that state with ``("ckptfs", 1)`` as DP=2 (TP=1) and as
TP=2 (DP=1), and Megatron's own torch_dist saves the DP=2 one; then it is loaded bit-exact with
``dist_checkpointing.load`` on DP=1, DP=3, TP=2 (another chunk grid), as plain (non-flat) local
chunks, and from a checkpoint of plain chunks into flat slices. megatron-core 0.19 refuses a
``flattened_range`` when the ShardedTensor is built (checked here), so nothing reaches ckptfs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

import ckptfs.megatron
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing as dc
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.core import CheckpointingException
from ranks import cpu_only_cuda, spawn

import ckptfs

NEW = not ckptfs.megatron._REGISTRY  # megatron-core >= 0.19
#: name -> (global shape, tensor-parallel axis or None when replicated, prepended axes)
PARAMS = {"w1": ((6, 4), 0, 0), "w2": ((5, 6), 1, 0), "b": ((7,), None, 0),
          "stack": ((1, 4, 3), None, 1)}
STATES = ("exp_avg", "exp_avg_sq")


def whole(state: str, name: str) -> torch.Tensor:
    shape = PARAMS[name][0]
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32).reshape(shape) / 3 + len(name)) * (1 + STATES.index(state))


def local(state: str, name: str, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's chunk (prepended axes dropped, as Megatron's local_shape has them)."""
    _, axis, pre = PARAMS[name]
    t = whole(state, name)
    if axis is not None:
        t = t.chunk(tp, dim=axis)[tp_rank]
    return t.reshape(t.shape[pre:]).contiguous()


def ranges(tp: int, dp: int, dp_rank: int) -> dict[str, tuple[int, int]]:
    """Each parameter's part of this DP rank's slice of the flat buffer (as flattened_range),
    empty parts left out, as the distributed optimizer leaves them out."""
    sizes = {name: local(STATES[0], name, tp, 0).numel() for name in PARAMS}
    total = sum(sizes.values())
    per = -(-total // dp)
    lo, hi = dp_rank * per, min((dp_rank + 1) * per, total)
    out, at = {}, 0
    for name, n in sizes.items():
        a, b = max(lo, at), min(hi, at + n)
        if a < b:
            out[name] = (a - at, b - at)
        at += n
    return out


def optimizer_state(rank: int, world: int, tp: int, fill: bool, flat: bool = True) -> dict:
    tp_rank, dp_rank = rank % tp, rank // tp
    out: dict = {}
    for state in STATES:
        for name, (a, b) in (ranges(tp, world // tp, dp_rank) if flat else
                             {n: (0, 0) for n in PARAMS}).items():
            _, axis, pre = PARAMS[name]
            chunk = local(state, name, tp, tp_rank)
            offsets = [] if axis is None else [(axis, tp_rank, tp)]
            replica = (0, tp_rank if axis is None else 0, 0)
            data = chunk.flatten()[a:b].clone() if flat else chunk.clone()
            if not fill:
                data.zero_()
            key = f"optimizer.state.{state}.{name}"
            if flat:
                out[key] = ShardedTensor.from_rank_offsets_flat(
                    key, data, tuple(chunk.shape), *offsets, replica_id=replica,
                    prepend_axis_num=pre, flattened_range=slice(a, b))
            else:
                out[key] = ShardedTensor.from_rank_offsets(
                    key, data, *offsets, replica_id=replica, prepend_axis_num=pre)
    return out


def check(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for key, sh in want.items():
        assert torch.equal(got[key], sh.data), (what, key, got[key], sh.data)




def save_all(rank: int, world: int, root: str) -> None:
    for name, tp, flat in (("dp2", 1, True), ("tp2", 2, True), ("plain", 2, False)):
        if rank == 0:
            os.makedirs(f"{root}-{name}")
        dist.barrier()
        dc.save(optimizer_state(rank, world, tp, True, flat), f"{root}-{name}",
                sharded_strategy=("ckptfs", 1))
    if rank == 0:
        os.makedirs(f"{root}-own")
    dist.barrier()
    cpu_only_cuda()
    dc.save(optimizer_state(rank, world, 1, True), f"{root}-own")  # Megatron's torch_dist


def load_all(rank: int, world: int, root: str) -> None:
    tp0 = 1 if world != 2 else 2
    layouts = [(tp0, True)]
    if world == 1:
        layouts.append((1, False))  # plain local chunks of a flattened save
    for tp, flat in layouts:
        for name in ("dp2", "tp2", "own") if flat else ("dp2", "tp2"):
            want = optimizer_state(rank, world, tp, True, flat)
            strategy = ckptfs.megatron.LoadStrategy() if name == "own" else None
            got = dc.load(optimizer_state(rank, world, tp, False, flat), f"{root}-{name}",
                          sharded_strategy=strategy)
            check(got, want, f"{name} on world {world} tp {tp} flat {flat}")
    # flat slices out of a checkpoint of plain chunks
    got = dc.load(optimizer_state(rank, world, tp0, False), f"{root}-plain")
    check(got, optimizer_state(rank, world, tp0, True), f"plain on world {world}")


def run(rank: int, world: int, root: str, phase: str) -> None:
    (save_all if phase == "save" else load_all)(rank, world, root)




def main() -> int:
    if NEW:
        try:
            dataclasses.replace(ShardedTensor.from_rank_offsets("k", torch.zeros(2, 2)),
                                data=torch.zeros(3), flattened_range=slice(0, 3))
        except CheckpointingException as e:
            assert "flattened_range" in str(e), e
        else:
            raise AssertionError("megatron-core >= 0.19 built a flattened ShardedTensor")
        print("megatron-core >= 0.19 refuses flattened_range itself: nothing to test")
        return 0
    root = os.path.join(tempfile.mkdtemp(prefix="ckptfs-megatron-flat-"), "ckpt")
    spawn(run, 2, root, "save")
    got = ckptfs.load_keys(root + "-dp2")
    assert got["optimizer.state.exp_avg.w1"].shape == (1, 1, 24), "stored as Megatron's chunk grid"
    for world in (1, 3, 2):
        spawn(run, world, root, "load")
    print("flattened_range: DP=2 and TP=2 saves; DP=1, DP=3, TP=2, plain-chunk loads and "
          "Megatron's own DP=2 save, bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
