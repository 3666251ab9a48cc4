"""ckptfs vs torch.distributed.checkpoint on the very same DCP-written files.

    .venv/bin/python -m bench.torch_dist_quick [--gb 1.0] [--runs 3] [--dir /tmp/ckptfs-bench-td]

1. ``dcp.save`` (one process, fsync) writes a ~1 GB state: fp32 and bf16 matrices plus 64 small
   fp32 tensors. Every load below reads those files; ckptfs has no index for them and sniffs
   DCP's ``.metadata``.
2. Whole load into plain tensors, ``dcp.load`` vs ``ckptfs.load``: cold (``sync; echo 3 >
   /proc/sys/vm/drop_caches`` before each load) and warm, ``--runs`` each, alternating.
3. Partial load: the first half of every matrix's rows (ckptfs.ShardedTensor targets), cold:
   bytes read vs bytes needed.
4. Resharded load 1 -> 2: two spawned gloo ranks each load a Shard(0) DTensor half, cold; DCP
   deserialises whole chunks on every rank, ckptfs reads the rows each rank needs.
5. Save, each in a fresh spawned process (``run_ranks``, one rank): ``dcp.save`` vs
   ``ckptfs.save(backend="torch_dist")`` (both fsync), time and peak RSS above the state itself.

The machine is shared: medians of ``--runs``, and treat differences under ~20% as noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import warnings

import torch

import ckptfs
from bench.libs import dir_bytes
from bench.worker import drop_caches, on_own_rank
from ckptfs.testing.ranks import run_ranks

warnings.filterwarnings("ignore", category=UserWarning)
MB = 1 << 20
ROWS = 4096
COLS = 8192


def make_state(gb: float, fill: bool = True) -> dict:
    """fp32 and bf16 matrices (3/4 and 1/4 of the bytes) plus 64 small fp32 tensors; below one
    fp32 and one bf16 matrix of ``ROWS`` x ``COLS`` (192 MiB), one of each with fewer columns."""
    cols = min(COLS, max(8, int(gb * 1024 * MB / (ROWS * 6))))
    n32 = max(1, round(gb * 1024 * 0.75 / (ROWS * cols * 4 / MB)))
    n16 = max(1, round(gb * 1024 * 0.25 / (ROWS * cols * 2 / MB)))
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype):
        if not fill:
            return torch.empty(shape, dtype=dtype)
        return torch.randn(shape, generator=g).to(dtype)

    return {"fp32": {str(i): t((ROWS, cols), torch.float32) for i in range(n32)},
            "bf16": {str(i): t((ROWS, cols), torch.bfloat16) for i in range(n16)},
            "small": {str(i): t((4096,), torch.float32) for i in range(64)}, "step": 100}


def nbytes(sd: dict) -> int:
    return sum(x.numel() * x.element_size() for d in ("fp32", "bf16", "small") for x in sd[d].values())



def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def med(xs: list[float]) -> float:
    return statistics.median(xs)


# -- loads ----------------------------------------------------------------------------------------


def load_compare(path: str, gb: float, runs: int, cold: bool) -> dict[str, list[float]]:
    import torch.distributed.checkpoint as dcp

    out: dict[str, list[float]] = {"dcp": [], "ckptfs": []}
    ref = None
    for _ in range(runs):
        for lib in ("dcp", "ckptfs"):
            sd = make_state(gb, fill=False)
            if cold:
                drop_caches()
            if lib == "dcp":
                out[lib].append(timed(lambda sd=sd: dcp.load(sd, checkpoint_id=path, no_dist=True)))
            else:
                out[lib].append(timed(lambda sd=sd: ckptfs.load(sd, path)))
            if ref is None:
                ref = sd
            else:  # both libraries fill the same bytes
                assert all(torch.equal(sd[d][k], ref[d][k]) for d in ("fp32", "bf16") for k in sd[d])
    return out


def partial(path: str, gb: float, runs: int) -> tuple[list[float], int, int, int]:
    like = make_state(gb, fill=False)
    times, res = [], None
    for _ in range(runs):
        sd = {d: {k: ckptfs.ShardedTensor(torch.empty(ROWS // 2, v.shape[1], dtype=v.dtype),
                                          tuple(v.shape), (0, 0)) for k, v in like[d].items()}
              for d in ("fp32", "bf16")}
        drop_caches()
        t0 = time.perf_counter()
        res = ckptfs.load(sd, path, store_options=ckptfs.StoreOptions(max_gap=0))
        times.append(time.perf_counter() - t0)
    whole = sum(v.numel() * v.element_size() for d in ("fp32", "bf16") for v in like[d].values())
    return times, res.bytes_read, res.bytes_needed, whole


def _reshard_rank(rank: int, world: int, path: str, gb: float, runs: int, out: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor import zeros as dzeros

    warnings.filterwarnings("ignore", category=UserWarning)
    mesh = init_device_mesh("cpu", (world,))
    like = make_state(gb, fill=False)

    def target():
        return {d: {k: dzeros(v.shape, dtype=v.dtype, device_mesh=mesh, placements=[Shard(0)])
                    for k, v in like[d].items()} for d in ("fp32", "bf16", "small")} | {"step": 0}

    rows = []
    for _ in range(runs):
        for lib in ("dcp", "ckptfs"):
            sd = target()
            if rank == 0:
                drop_caches()
            dist.barrier()
            t0 = time.perf_counter()
            if lib == "dcp":
                dcp.load(sd, checkpoint_id=path)
                got = None
            else:
                got = ckptfs.load(sd, path, store_options=ckptfs.StoreOptions(max_gap=0))
            dist.barrier()  # the slower rank decides
            rows.append((lib, time.perf_counter() - t0, got.bytes_read if got else 0,
                         got.bytes_needed if got else 0))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def reshard(path: str, gb: float, runs: int) -> dict[int, list]:
    with tempfile.TemporaryDirectory() as out:
        run_ranks(2, _reshard_rank, path, gb, runs, out)
        return {r: [tuple(row) for row in json.load(open(os.path.join(out, f"rank{r}.json")))]
                for r in range(2)}


# -- saves ----------------------------------------------------------------------------------------


def _save(lib: str, path: str, gb: float) -> list:
    """One save in this process: [seconds, peak RSS rise in bytes]."""
    import torch.distributed.checkpoint as dcp  # imported before timing, for both libraries
    import torch.distributed.checkpoint.filesystem  # noqa: F401

    warnings.filterwarnings("ignore", category=UserWarning)
    sd = make_state(gb)
    base = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5\n")
    t0 = time.perf_counter()
    if lib == "dcp":
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True), no_dist=True)
    else:
        ckptfs.save(sd, path, backend="torch_dist")
    dt = time.perf_counter() - t0
    return [dt, _status("VmHWM") - base]


def _status(field: str) -> int:
    """A /proc/self/status memory field, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def save_in_child(lib: str, path: str, gb: float) -> tuple[float, int]:
    """The save on a spawned rank of its own (``run_ranks``, one rank): (seconds, peak RSS rise)."""
    dt, rise = on_own_rank(_save, lib, path, gb)
    return dt, rise


# -- main -----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-td")
    ap.add_argument("--skip-save", action="store_true")
    args = ap.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    dcp_dir, ck_dir = f"{args.dir}/dcp", f"{args.dir}/ckptfs"
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(f"# {load}; torch {torch.__version__}; cold loads: drop_caches={drop_caches()}")

    saves = {"dcp": [], "ckptfs": []}
    for _ in range(1 if args.skip_save else args.runs):
        for lib, path in (("dcp", dcp_dir), ("ckptfs", ck_dir)):
            shutil.rmtree(path, ignore_errors=True)
            saves[lib].append(save_in_child(lib, path, args.gb))
    size = dir_bytes(dcp_dir)
    print(f"state: {nbytes(make_state(args.gb, fill=False)) / MB:.0f} MiB; DCP files "
          f"{size / MB:.0f} MiB; ckptfs torch_dist files {dir_bytes(ck_dir) / MB:.0f} MiB")
    if not args.skip_save:
        for lib in ("dcp", "ckptfs"):
            ts = [t for t, _ in saves[lib]]
            rss = med([r for _, r in saves[lib]])
            print(f"save  {lib:7s} median {med(ts):6.2f} s ({size / MB / med(ts):6.0f} MiB/s)  "
                  f"peak RSS above the state {rss / MB:6.0f} MiB   runs {[round(t, 2) for t in ts]}")
        d, c = (med([t for t, _ in saves[lib]]) for lib in ("dcp", "ckptfs"))
        print(f"save  ratio dcp/ckptfs {d / c:.2f}x")

    for cold in (True, False):
        if not cold:
            load_compare(dcp_dir, args.gb, 1, cold=False)  # warm the page cache
        r = load_compare(dcp_dir, args.gb, args.runs, cold)
        tag = "cold" if cold else "warm"
        for lib in ("dcp", "ckptfs"):
            print(f"load  {tag} {lib:7s} median {med(r[lib]):6.2f} s ({size / MB / med(r[lib]):6.0f} "
                  f"MiB/s)   runs {[round(t, 2) for t in r[lib]]}")
        print(f"load  {tag} ratio dcp/ckptfs {med(r['dcp']) / med(r['ckptfs']):.2f}x")

    times, read, needed, whole = partial(dcp_dir, args.gb, args.runs)
    print(f"half rows, cold, ckptfs: median {med(times):.2f} s; read {read / MB:.1f} MiB for "
          f"{needed / MB:.1f} MiB needed (+{(read - needed) / 1024:.1f} KiB of blob headers; "
          f"whole chunks {whole / MB:.0f} MiB)")

    rows = reshard(dcp_dir, args.gb, args.runs)
    for lib in ("dcp", "ckptfs"):
        ts = [t for lb, t, _, _ in rows[0] if lb == lib]  # after a barrier: the slower rank
        print(f"reshard 1->2 cold {lib:7s} median {med(ts):6.2f} s   runs {[round(t, 2) for t in ts]}")
    r0 = [x for x in rows[0] if x[0] == "ckptfs"][-1]
    print(f"reshard 1->2 ckptfs rank 0 read {r0[2] / MB:.1f} MiB for {r0[3] / MB:.1f} MiB needed "
          f"(+{(r0[2] - r0[3]) / 1024:.1f} KiB); DCP deserialises whole chunks: "
          f"{whole / MB:.0f} MiB per rank")
    d = med([t for lb, t, _, _ in rows[0] if lb == "dcp"])
    c = med([t for lb, t, _, _ in rows[0] if lb == "ckptfs"])
    print(f"reshard 1->2 ratio dcp/ckptfs {d / c:.2f}x")


if __name__ == "__main__":
    main()
