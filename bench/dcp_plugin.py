"""``dcp.save`` / ``dcp.load`` through ckptfs's DCP plug-in against DCP's own storage.

    .venv/bin/python -m bench.dcp_plugin [--gb 0.5] [--runs 3] [--dir /tmp/ckptfs-bench-dcp]

The same state, the same run, alternating which goes first:

1. Save, 2 spawned gloo ranks: a DTensor state (fp32 and bf16 matrices, rows sharded over the
   ranks, and a few replicated small tensors) through ``dcp.save`` with
   ``FileSystemWriter(sync_files=True)`` and with ``ckptfs.dcp.StorageWriter`` (whose files are
   fsynced too), the page cache dropped before each.
2. Cold load, same 2 ranks: ``dcp.load`` through ``FileSystemReader`` and through
   ``ckptfs.dcp.StorageReader``, the page cache dropped before each.
3. Resharded cold load 2 -> 3: three spawned ranks load the checkpoints of step 1 into
   3-way-sharded DTensors. Bytes read: what each process read from files (``/proc/self/io``
   ``rchar``) and, for the plug-in, what its reader fetched; bytes needed: the regions the
   ranks' targets cover.

Times are the slowest rank's, medians over ``--runs``; the machine may be shared, so treat
differences under ~20% as noise. Results go to bench/results/dcp_plugin.json (``--out``).
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

import ckptfs.dcp
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from bench.worker import drop_caches
from ckptfs.testing.ranks import run_ranks

warnings.filterwarnings("ignore")
ROWS, COLS = 2048, 2048


def shapes(gb: float) -> dict[str, tuple[tuple[int, int], torch.dtype, bool]]:
    """name -> (shape, dtype, sharded): fp32 and bf16 matrices (3/4 and 1/4 of the bytes, rows
    of 8 KiB and 4 KiB) plus 16 small replicated fp32 tensors."""
    total = gb * (1 << 30)
    rows = max(24, min(ROWS, int(total * 0.25 / (COLS * 2))))  # a tiny run: shorter matrices
    n32 = max(1, round(total * 0.75 / (rows * COLS * 4)))
    n16 = max(1, round(total * 0.25 / (rows * COLS * 2)))
    out = {f"fp32.{i}": ((rows, COLS), torch.float32, True) for i in range(n32)}
    out |= {f"bf16.{i}": ((rows, COLS), torch.bfloat16, True) for i in range(n16)}
    out |= {f"small.{i}": ((1024, 1), torch.float32, False) for i in range(16)}
    return out


def state(gb: float, mesh, fill: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, (shape, dtype, sharded) in shapes(gb).items():
        full = torch.randn(shape, generator=g).to(dtype) if fill else torch.empty(shape, dtype=dtype)
        sd[name] = distribute_tensor(full, mesh, [Shard(0) if sharded else Replicate()])
    return {"model": sd, "step": 100}


def rchar() -> int:
    """Bytes this process read through read calls (page cache hits included)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return -1


def timed(fn) -> tuple[float, int]:
    """(seconds of the slowest rank, bytes this rank read) of ``fn`` run between barriers, after
    the page cache was dropped."""
    if dist.get_rank() == 0:
        drop_caches()
    dist.barrier()
    r0, t0 = rchar(), time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0, rchar() - r0


def needed(sd: dict) -> int:
    return sum(t.to_local().numel() * t.element_size() for t in sd["model"].values())


def _save_rank(rank: int, world: int, root: str, gb: float, runs: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = state(gb, mesh, True)
    rows = []
    for run in range(runs):
        order = ["dcp", "ckptfs"] if run % 2 == 0 else ["ckptfs", "dcp"]
        for lib in order:
            path = os.path.join(root, f"{lib}-{run}")
            writer = (dcp.FileSystemWriter(path, sync_files=True) if lib == "dcp"
                      else ckptfs.dcp.StorageWriter(path))
            s, _ = timed(lambda w=writer: dcp.save(sd, storage_writer=w))
            rows.append(["save", lib, run, s, 0, 0])
        for lib in order:
            path = os.path.join(root, f"{lib}-{run}")
            reader = (dcp.FileSystemReader(path) if lib == "dcp"
                      else ckptfs.dcp.StorageReader(path))
            tgt = state(gb, mesh, False)
            s, got = timed(lambda r=reader, t=tgt: dcp.load(t, storage_reader=r))
            rows.append(["load", lib, run, s, got, needed(tgt)])
    with open(os.path.join(out, f"save{rank}.json"), "w") as f:
        json.dump(rows, f)


def _reshard_rank(rank: int, world: int, root: str, gb: float, runs: int, out: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    rows = []
    for run in range(runs):
        for lib in (["dcp", "ckptfs"] if run % 2 == 0 else ["ckptfs", "dcp"]):
            path = os.path.join(root, f"{lib}-{run}")
            reader = (dcp.FileSystemReader(path) if lib == "dcp"
                      else ckptfs.dcp.StorageReader(path))
            tgt = state(gb, mesh, False)
            s, got = timed(lambda r=reader, t=tgt: dcp.load(t, storage_reader=r))
            fetched = reader.stats.bytes_read if lib == "ckptfs" else got
            rows.append(["reshard", lib, run, s, got, needed(tgt), fetched])
    with open(os.path.join(out, f"reshard{rank}.json"), "w") as f:
        json.dump(rows, f)


def summarize(rows: list[list], phase: str, lib: str) -> dict:
    """Median slowest-rank seconds, and bytes summed over the ranks of one run."""
    mine = [r for r in rows if r[0] == phase and r[1] == lib]
    runs = sorted({r[2] for r in mine})
    secs = [max(r[3] for r in mine if r[2] == run) for run in runs]
    out = {"seconds": statistics.median(secs), "all_seconds": secs}
    if phase != "save":
        first = [r for r in mine if r[2] == runs[0]]
        out["bytes_read"] = sum(r[4] for r in first)
        out["bytes_needed"] = sum(r[5] for r in first)
        if phase == "reshard":
            out["bytes_fetched"] = sum(r[6] for r in first)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.5, help="state size in GB (default 0.5)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "ckptfs-bench-dcp"))
    ap.add_argument("--out", default=os.path.join("bench", "results", "dcp_plugin.json"))
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    rows: list[list] = []
    with tempfile.TemporaryDirectory() as out:
        run_ranks(2, _save_rank, args.dir, args.gb, args.runs, out)
        run_ranks(3, _reshard_rank, args.dir, args.gb, args.runs, out)
        for name in sorted(os.listdir(out)):
            with open(os.path.join(out, name)) as f:
                rows += json.load(f)
    result = {"gb": args.gb, "runs": args.runs, "cache_dropped": drop_caches(),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cpus": os.cpu_count(), "torch": torch.__version__}
    for phase in ("save", "load", "reshard"):
        result[phase] = {lib: summarize(rows, phase, lib) for lib in ("dcp", "ckptfs")}
        d, c = result[phase]["dcp"]["seconds"], result[phase]["ckptfs"]["seconds"]
        result[phase]["speedup"] = d / c  # > 1: the plug-in is faster
    rs = result["reshard"]
    for lib in ("dcp", "ckptfs"):
        rs[lib]["read_over_needed"] = rs[lib]["bytes_read"] / rs[lib]["bytes_needed"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({p: {k: v for k, v in result[p].items()} for p in ("save", "load", "reshard")},
                     indent=1))
    shutil.rmtree(args.dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
