"""Megatron-Core's ``dist_checkpointing.save`` / ``load`` with ckptfs's strategies against its own
``torch_dist`` strategy (``make bench-megatron``; in the megatron-core 0.19.x venv).

    PYTHONPATH=. .venv-megatron/bin/python -m bench.megatron_strategies [--gb 0.5] [--runs 3]

The same state, the same run, alternating which goes first: 2 spawned gloo ranks hold a
tensor-parallel state (fp32 and bf16 matrices split by rows, a replicated bias per layer) and
save it with ``ckptfs.megatron.SaveStrategy()`` and with Megatron's default, then load it (same
layout, the page cache dropped before each load when permitted) with
``ckptfs.megatron.LoadStrategy()`` and with Megatron's ``TorchDistLoadShardedStrategy``. Times
are the slowest rank's, medians over ``--runs``; the machine may be shared, so treat differences
under ~20% as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ckptfs
from bench.worker import drop_caches
from ckptfs.testing.ranks import free_port

try:
    import ckptfs.megatron
    from megatron.core import dist_checkpointing as dc
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
except (ImportError, ckptfs.ConfigError):  # run in the Megatron venv (make bench-megatron)
    dc = None

LAYERS = 8


def state(rank: int, world: int, gb: float, fill: bool) -> dict:
    """Per layer an fp32 and a bf16 matrix split by rows over the ranks, and a replicated bias."""
    cols = 1024
    rows = max(world, int(gb * 2**30 / LAYERS / cols / 6) // world * world)  # 4 + 2 bytes a cell
    part = rows // world
    sd: dict = {"iteration": 1}
    g = torch.Generator().manual_seed(rank)
    for i in range(LAYERS):
        for name, dtype in (("w", torch.float32), ("v", torch.bfloat16)):
            key = f"layers.{i}.{name}"
            t = (torch.randn(part, cols, generator=g) if fill else torch.empty(part, cols)).to(dtype)
            sd[key] = ShardedTensor.from_rank_offsets(key, t, (0, rank, world))
        b = f"layers.{i}.bias"
        sd[b] = ShardedTensor.from_rank_offsets(b, torch.ones(cols), replica_id=rank)
    return sd


def cpu_only_cuda() -> None:
    """Megatron's own save synchronises CUDA (none on a CPU-only torch)."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def timed(fn, *args: object, **kwargs: object) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    dist.barrier()
    return time.perf_counter() - t0


def run(rank: int, world: int, port: int, root: str, gb: float, runs: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cpu_only_cuda()
    peers = {
        "ckptfs": (lambda: ckptfs.megatron.SaveStrategy(), lambda: ckptfs.megatron.LoadStrategy()),
        "torch_dist": (lambda: None, lambda: TorchDistLoadShardedStrategy()),
    }
    if ckptfs.megatron._REGISTRY:  # <= 0.18: Megatron saves the common state, any layout loads
        peers["ckptfs-chunks"] = (
            lambda: ckptfs.megatron.SaveStrategy(ckptfs_backend="safetensors_chunks"),
            lambda: ckptfs.megatron.LoadStrategy())
    times: dict = {f"{op}/{name}": [] for op in ("save", "load") for name in peers}
    sd = state(rank, world, gb, True)
    for r in range(runs):
        order = list(peers)[r % len(peers):] + list(peers)[:r % len(peers)]
        for name in order:
            path = os.path.join(root, f"{name}-{r}")
            if rank == 0:
                os.makedirs(path)
            dist.barrier()
            save_s, load_s = peers[name]
            times[f"save/{name}"].append(timed(dc.save, sd, path, sharded_strategy=save_s()))
            if rank == 0:
                drop_caches()
            target = state(rank, world, gb, False)
            times[f"load/{name}"].append(timed(dc.load, target, path, sharded_strategy=load_s()))
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        result = {f"{k}/{how}": round(fn(v), 3) for k, v in times.items()
                  for how, fn in (("median", statistics.median), ("min", min))}
        result.update(gb=gb, runs=runs, ranks=world, cache_dropped=drop_caches())
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=0.5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out", default="bench/results/megatron_strategies.json")
    a = ap.parse_args(argv)
    if dc is None:
        print("bench.megatron_strategies needs megatron-core: run it in the Megatron venv "
              "(make bench-megatron)")
        return 2
    root = tempfile.mkdtemp(prefix="ckptfs-bench-megatron-", dir=a.dir)
    port = free_port()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    try:
        mp.start_processes(run, args=(2, port, root, a.gb, a.runs, os.path.abspath(a.out)),
                           nprocs=2, start_method="spawn")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
