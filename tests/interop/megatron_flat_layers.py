"""The distributed optimizer's state of stacked layers through ckptfs.megatron's strategies:
several ``flattened_range`` ShardedTensors of one key on one rank (``make interop-strategies``;
megatron-core 0.15.x, spawned gloo ranks).

With stacked layers (``prepend_axis_num=1``) every layer is its own model parameter, so the
distributed optimizer (``sharded_param_state_fs_model_space``) gives a rank one flat slice per
layer it holds a part of: Megatron's ``dataclasses.replace`` of the layer's ShardedTensor with the
state tensor, ``flattened_range`` and the (PP, TP, 0) replica id, as the optimizer makes them.
Here the flat buffer holds an embedding then four layers ``[4, 6]``; two data-parallel ranks
save, rank 0 holding layer 0 whole and the start of layer 1, rank 1 the rest of layer 1 and
layers 2 and 3, and Megatron's own torch_dist saves the same. Loaded bit-exact: on one rank
(every layer whole), on three ranks (other cuts), on two tensor-parallel ranks (another chunk
grid), as plain stacked layers, and Megatron's own save through ckptfs's load strategy.
megatron-core 0.19 refuses ``flattened_range`` (tests/interop/megatron_flattened.py checks it).
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
from ranks import cpu_only_cuda, spawn

import ckptfs

LAYERS, SHAPE, EMB = 4, (4, 6), 5
KEY, EMB_KEY = "decoder.layers.mlp.weight", "embedding.weight"
STATES = ("exp_avg", "exp_avg_sq")


def whole(state: str) -> torch.Tensor:
    n = LAYERS * SHAPE[0] * SHAPE[1]
    return (torch.arange(n, dtype=torch.float32).reshape(LAYERS, *SHAPE) / 3 + 1) * \
        (1 + STATES.index(state))


def embedding(state: str) -> torch.Tensor:
    return torch.arange(EMB, dtype=torch.float32) * (2 + STATES.index(state)) - 1


def model_params(tp: int, tp_rank: int) -> list[ShardedTensor]:
    """The model's ShardedTensors in the order of the flat buffer (TP splits columns)."""
    cols = SHAPE[1] // tp
    out = [ShardedTensor.from_rank_offsets(EMB_KEY, torch.zeros(EMB), replica_id=(0, tp_rank, 0))]
    for i in range(LAYERS):
        out.append(ShardedTensor.from_rank_offsets(
            KEY, torch.zeros(SHAPE[0], cols), (0, i, LAYERS), (2, tp_rank, tp),
            replica_id=(0, 0, 0), prepend_axis_num=1))
    return out


def local(state: str, sh: ShardedTensor) -> torch.Tensor:
    """The state of the model parameter ``sh`` on this TP rank (its local chunk)."""
    if sh.key == EMB_KEY:
        return embedding(state)
    i, _, c = sh.global_offset
    return whole(state)[i, :, c:c + sh.local_shape[1]].contiguous()


def optimizer_state(rank: int, world: int, tp: int, fill: bool, flat: bool = True) -> dict:
    """This rank's optimizer state as the distributed optimizer builds it: the flat buffer of
    the TP-local parameters cut in ``world // tp`` equal parts, one flat slice per parameter the
    rank's part touches (``flat``), or the plain local chunks."""
    tp_rank, dp_rank = rank % tp, rank // tp
    params = model_params(tp, tp_rank)
    total = sum(p.data.numel() for p in params)
    per = -(-total // (world // tp))
    lo, hi = dp_rank * per, min((dp_rank + 1) * per, total)
    out: dict = {}
    for state in STATES:
        at = 0
        for n, p in enumerate(params):
            a, b = max(lo, at) - at, min(hi, at + p.data.numel()) - at
            at += p.data.numel()
            chunk = local(state, p)
            key = f"optimizer.state.{state}.{p.key}"
            if not flat:
                out[f"{key}.{n}"] = dataclasses.replace(p, key=key, data=chunk.clone() if fill
                                                        else torch.zeros_like(chunk))
                continue
            if a >= b:
                continue
            data = chunk.flatten()[a:b].clone() if fill else torch.zeros(b - a)
            sh = dataclasses.replace(p, key=key, data=data, dtype=data.dtype,
                                     flattened_range=slice(a, b), replica_id=(*p.replica_id[:2], 0))
            sh.validate_metadata_integrity()
            out[f"{key}.{n}"] = sh
    return out


def check(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for key, sh in want.items():
        assert torch.equal(got[key], sh.data), (what, key, got[key], sh.data)


def run(rank: int, world: int, root: str, phase: str) -> None:
    if phase == "save":
        for name in ("ckptfs", "own"):
            if rank == 0:
                os.makedirs(f"{root}-{name}")
        dist.barrier()
        state = optimizer_state(rank, world, 1, True)
        if rank == 0:  # layer 0 whole, the start of layer 1: two flat slices of one key
            assert sum(k.endswith(".1") or k.endswith(".2") for k in state) == 4, sorted(state)
        dc.save(state, f"{root}-ckptfs", sharded_strategy=("ckptfs", 1))
        cpu_only_cuda()
        dc.save(optimizer_state(rank, world, 1, True), f"{root}-own")  # Megatron's torch_dist
        return
    tp = 2 if phase == "tp" else 1
    flat = phase != "plain"
    for name in ("ckptfs", "own"):
        got = dc.load(optimizer_state(rank, world, tp, False, flat), f"{root}-{name}",
                      sharded_strategy=ckptfs.megatron.LoadStrategy())
        check(got, optimizer_state(rank, world, tp, True, flat), f"{name} {phase} world {world}")


def main() -> int:
    if not ckptfs.megatron._REGISTRY:
        print("megatron-core >= 0.19 refuses flattened_range itself: nothing to test")
        return 0
    root = os.path.join(tempfile.mkdtemp(prefix="ckptfs-megatron-flat-layers-"), "ckpt")
    spawn(run, 2, root, "save")
    got = ckptfs.load_keys(root + "-ckptfs")
    stored = got[f"optimizer.state.exp_avg.{KEY}"]
    assert stored.shape == (LAYERS, 1, 1, 24), "stored as Megatron's chunk grid"
    assert torch.equal(stored.reshape(LAYERS, *SHAPE), whole("exp_avg"))
    for world, phase in ((1, "dp"), (3, "dp"), (2, "tp"), (1, "plain")):
        spawn(run, world, root, phase)
    print("flattened_range of stacked layers (several flat slices of one key a rank): DP=2 "
          "save; DP=1, DP=3, TP=2 and plain-layer loads, and Megatron's own DP=2 save, bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
