"""Recovery tiers: local steps copied to another node vs persistent steps on S3 (moto), for a
2-node, 4-rank job (spawned gloo ranks grouped into nodes by ``CKPTFS_NODE_ID``, one local
directory per node), in one run.

    .venv/bin/python -m bench.recovery_tiers [--mb 256] [--runs 3] [--out FILE]

Rows (wall seconds on rank 0 between barriers, median and min of ``--runs``; every run's
numbers also go to bench/results/recovery-tiers-<time>.json):

- save, blocking: ``mgr.save`` of a local step until it returns (staged) vs ``ckptfs.async_save``
  of the same state until ``staged``;
- local step (write + copy to the other node) and persistent step (to S3), until done;
- restore: the local step from each node's own tier; the same with node n1's tier wiped (its
  files fetched from n0's copy); the persistent step from S3 through a manager without a local
  tier. Each restore is checked bit for bit; "from S3" is the data bytes read from the URL;
- training-loop slowdown: a loop of matmuls alone vs while a local step's write and copy run
  in the background.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import ckptfs
from bench.s3_quick import BUCKET, moto_endpoint, storage_options
from ckptfs.testing.ranks import run_ranks

warnings.filterwarnings("ignore")
MB = 1 << 20
COLS = 1024


def state(rank: int, world: int, mb: float, step: int) -> dict:
    rows = max(world, int(mb * MB / 4 / COLS) // world * world)
    per = rows // world
    g = torch.Generator().manual_seed(step)
    w = torch.rand(per, COLS, generator=g) + rank
    return {"w": ckptfs.ShardedTensor(w, (rows, COLS), (rank * per, 0)), "step": step}


def loop(n: int = 40) -> float:
    a = torch.rand(256, 256)
    t0 = time.perf_counter()
    for _ in range(n):
        a = (a @ a).tanh_()
    return time.perf_counter() - t0


def timed_restore(add, name: str, mgr: ckptfs.CheckpointManager, rank: int, world: int,
                  mb: float, step: int, want: int | None = None) -> None:
    """``mgr.restore`` timed as ``name`` (the blank and the expected state are made outside the
    timed span: generating 1 GB of random numbers is not the restore), then checked bit for bit."""
    sd = state(rank, world, mb, 0)
    sd["w"].local_tensor.zero_()
    expect = state(rank, world, mb, step)["w"].local_tensor
    with timer(add, name):
        got = mgr.restore(sd, step=want)
    assert got == step, (got, step, mgr.last_restore and mgr.last_restore.reason)
    assert torch.equal(sd["w"].local_tensor, expect)


def one_round(mgr: ckptfs.CheckpointManager, far: ckptfs.CheckpointManager, rank: int,
              world: int, mb: float, step: int, local: str, add) -> int:
    """One round of every row; returns the data bytes the S3 restore read from S3."""
    sd = state(rank, world, mb, step)
    with timer(add, "save of a local step, blocking (until staged)"):
        h = mgr.save(step, sd)
    with timer(add, "local step: write + copy to the other node, until done"):
        h.result()
    with timer(add, "async_save to S3, blocking (until staged)"):
        h2 = ckptfs.async_save(sd, f"{mgr.url}-async/{step}", storage_options=far.storage_options)
        h2.wait_staged()
    h2.result()
    timed_restore(add, "restore the local step from each node's own tier", mgr, rank, world,
                  mb, step)
    assert mgr.last_restore is not None and mgr.last_restore.remote_bytes == 0
    if rank == 2:  # node n1 replaced: its own copy gone
        shutil.rmtree(os.path.join(local, f"step-{step:08d}"))
    timed_restore(add, "restore the local step, node n1 wiped (its files from n0's copy)", mgr,
                  rank, world, mb, step)
    assert mgr.last_restore.remote_bytes == 0
    timed_restore(add, "restore the persistent step from S3 (no local tier)", far, rank, world,
                  mb, 1000, want=1000)
    alone = statistics.median(loop() for _ in range(4))
    dist.barrier()
    h3 = mgr.save(step + 500, state(rank, world, mb, step + 500))
    busy = []
    while not h3.done.done():  # steps of the loop while the step is written and copied
        busy.append(loop())
    h3.result()
    dist.barrier()
    if busy:
        add("training-loop step while a local step is written and copied (x alone)",
            statistics.mean(busy) / alone)
    assert far.last_restore is not None
    return far.last_restore.remote_bytes


@contextmanager
def timer(add, name: str) -> Iterator[None]:
    """Wall time between barriers, recorded as ``name``."""
    dist.barrier()
    t0 = time.perf_counter()
    yield
    dist.barrier()
    add(name, time.perf_counter() - t0)


def rank_main(rank: int, world: int, url: str, locals_: list[str], opts: dict, mb: float,
              runs: int, out: dict) -> None:
    os.environ["CKPTFS_NODE_ID"] = f"n{rank // 2}"
    local = locals_[rank // 2]
    quiet = ckptfs.PreemptionPolicy(signals=())
    tiers = ckptfs.TierOptions(local_dir=local, local_interval_steps=1, keep_local=2, replicas=1)
    mgr = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(
        tiers=tiers, save_interval_steps=1000, preemption=quiet), storage_options=opts)
    far = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(preemption=quiet),
                                   storage_options=opts)
    rows: dict[str, list[float]] = {}

    def add(name: str, t: float) -> None:
        rows.setdefault(name, []).append(t)

    with timer(add, "persistent step to S3, until committed"):
        mgr.save_sync(1000, state(rank, world, mb, 1000))
    far_bytes = 0
    for i in range(runs):
        far_bytes = one_round(mgr, far, rank, world, mb, 1001 + i, local, add)
    if rank == 0:
        out.update(rows)
        out["far_bytes"] = far_bytes
    mgr.close()
    far.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default=None,
                    help="results file (default bench/results/recovery-tiers-<time>.json)")
    args = ap.parse_args(argv)
    with moto_endpoint() as endpoint, tempfile.TemporaryDirectory(
            prefix="ckptfs-bench-tiers-", ignore_cleanup_errors=True) as work:
        out_file = os.path.join(work, "out.txt")
        run_ranks(4, _rank, f"s3://{BUCKET}/tiers", [os.path.join(work, "n0"),
                                                     os.path.join(work, "n1")],
                  storage_options(endpoint), args.mb, args.runs, out_file, timeout=1800, threads=1)
        with open(out_file) as f:
            print(f.read())
        with open(out_file + ".json") as f:
            result = json.load(f)
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"recovery-tiers-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# results: {out}")


def _rank(rank: int, world: int, url: str, locals_: list[str], opts: dict, mb: float, runs: int,
          out_file: str) -> None:
    out: dict = {}
    rank_main(rank, world, url, locals_, opts, mb, runs, out)
    if rank == 0:
        load = os.getloadavg()[0]
        lines = [f"## recovery tiers: 2 nodes x 2 ranks, {mb:.0f} MiB of state, {runs} runs; "
                 f"torch {torch.__version__}; load average {load:.1f}", "",
                 "| what | median s | min s |", "|---|---|---|"]
        far_bytes = out.pop("far_bytes")
        med = {k: statistics.median(v) for k, v in out.items()}
        lines += [f"| {k} | {med[k]:.3f} | {min(v):.3f} |" for k, v in out.items()]
        loc = med["restore the local step from each node's own tier"]
        peer = med["restore the local step, node n1 wiped (its files from n0's copy)"]
        s3 = med["restore the persistent step from S3 (no local tier)"]
        ratios = {"s3_over_local": s3 / loc, "s3_over_peer": s3 / peer}
        lines += ["", f"S3 restore / local restore: {s3 / loc:.2f}x; S3 / peer restore: "
                      f"{s3 / peer:.2f}x (medians); data bytes from S3 in the S3 restore "
                      f"(rank 0): {far_bytes}; in the local ones: 0"]
        with open(out_file, "w") as f:
            f.write("\n".join(lines) + "\n")
        with open(out_file + ".json", "w") as f:
            json.dump({"mb": mb, "runs": out, "median": med, "ratios": ratios,
                       "s3_bytes_rank0": far_bytes, "load_average": load,
                       "torch": torch.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
