"""``python -m bench.gpu``: loads into and saves from CUDA tensors, ckptfs vs DCP (issue 12).

In one run on a GPU machine, for an fp32 and a bf16 state of ``--gb`` GB (default 8) saved as a
2-rank sharded checkpoint (row-sharded DTensors, spawned CPU ranks) by each checkpointer:

- the physical floors: pinned host-to-device bandwidth (one ``copy_`` of a pinned buffer to the
  device) and the page-cache read bandwidth of the checkpoint's files;
- the load of the whole state into CUDA tensors (one process): ckptfs (through its pinned ring,
  with and without crc32c checks), ``dcp.load`` into the same CUDA state dict, and ckptfs with
  GPUDirect Storage (``IOConfig(gds=True)``) when kvikio imports;
- the save of the same CUDA state: ckptfs vs ``dcp.save``, with the pinned memory in use at
  once (torch's host allocator statistics).

Runs alternate between checkpointers; medians of ``--repeats``; the page cache stays warm (the
floor beside the loads is the warm read bandwidth). Without CUDA it exits with a message;
``--device cpu`` runs every code path on CPU targets (a smoke test of the harness, not GPU
numbers). The targets of the issue: load >= 80% of min(H2D, page cache) and >= 2x DCP; save
>= 2x DCP.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

import ckptfs
from ckptfs.io import IOConfig

WORLD = 2  #: ranks that write the sharded checkpoints
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shape(gb: float, dtype: torch.dtype) -> list[tuple[str, tuple[int, int]]]:
    """(key, shape) of 4096-column matrices holding ``gb`` GB of ``dtype``, 256 MiB at most each."""
    cols = 4096
    rows_per = (256 << 20) // (cols * dtype.itemsize)
    total_rows = max(WORLD, int(gb * 1e9) // (cols * dtype.itemsize))
    out, i = [], 0
    while total_rows > 0:
        r = max(WORLD, min(rows_per, total_rows))
        out.append((f"layers.{i}.w", (r, cols)))
        total_rows -= r
        i += 1
    return out


def _fill(key: str, rows: tuple[int, int], cols: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    return torch.randn(rows[1] - rows[0], cols, generator=g).to(dtype)


def _write_rank(rank: int, world: int, root: str, gb: float, dtype_name: str) -> None:
    """One CPU rank saves its row shards with ckptfs and with DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    dtype = DTYPES[dtype_name]
    mesh = init_device_mesh("cpu", (world,))
    state = {}
    for key, (n, cols) in _shape(gb, dtype):
        per = -(-n // world)
        lo, hi = min(rank * per, n), min(rank * per + per, n)
        full = _fill(key, (0, n), cols, dtype)
        state[key] = DTensor.from_local(full[lo:hi].clone(), mesh, [Shard(0)], run_check=False,
                                        shape=torch.Size((n, cols)), stride=(cols, 1))
    ckptfs.save(state, f"{root}/ckptfs")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(f"{root}/dcp", sync_files=True))


def _expected(gb: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: _fill(k, (0, n), c, dtype) for k, (n, c) in _shape(gb, dtype)}


def _files_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def page_cache_read(path: str) -> float:
    """GB/s reading every file under ``path`` (warm: read once first) into one buffer."""
    files = [p for p in Path(path).rglob("*") if p.is_file()]
    buf = bytearray(64 << 20)

    def read_all() -> int:
        n = 0
        for p in files:
            with open(p, "rb", buffering=0) as f:
                while k := f.readinto(buf):
                    n += k
        return n

    read_all()
    t = time.perf_counter()
    n = read_all()
    return n / (time.perf_counter() - t) / 1e9


def h2d_floor(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s of one ``copy_`` of a pinned host buffer to the device (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _pinned_peak_reset(device: str) -> Callable[[], int | None]:
    """Starts measuring pinned memory in use; returns a function giving the rise of its peak."""
    if device != "cuda":
        return lambda: None
    torch.cuda.reset_peak_host_memory_stats()
    before = torch.cuda.host_memory_stats()["active_bytes.current"]
    return lambda: torch.cuda.host_memory_stats()["active_bytes.peak"] - before


def _time(fn: Callable[[], None], device: str) -> float:
    _sync(device)
    t = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t


def run_dtype(name: str, gb: float, repeats: int, device: str, root: str) -> list[str]:
    """Rows of the table for one dtype."""
    import torch.distributed.checkpoint as dcp

    from ckptfs.testing.ranks import run_ranks

    dtype = DTYPES[name]
    work = tempfile.mkdtemp(prefix=f"bench-gpu-{name}-", dir=root)
    try:
        run_ranks(WORLD, _write_rank, work, gb, name)
        nbytes = sum(n * c * dtype.itemsize for _, (n, c) in _shape(gb, dtype))
        expected = _expected(gb, dtype)
        target = {k: torch.empty_like(v, device=device) for k, v in expected.items()}
        cache = page_cache_read(f"{work}/ckptfs")
        loads: dict[str, Callable[[], None]] = {
            "ckptfs": lambda: ckptfs.load(target, f"{work}/ckptfs"),
            "ckptfs verify=False": lambda: ckptfs.load(target, f"{work}/ckptfs", verify=False),
            "DCP": lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(f"{work}/dcp")),
        }
        try:
            import kvikio  # noqa: F401

            loads["ckptfs gds (kvikio)"] = lambda: ckptfs.load(
                target, f"{work}/ckptfs", verify=False, io_config=IOConfig(gds=True))
        except ImportError:
            pass
        times: dict[str, list[float]] = {k: [] for k in loads}
        pinned: dict[str, int | None] = {}
        for _ in range(repeats):  # alternating
            for k, fn in loads.items():
                for t in target.values():
                    t.zero_()
                peak = _pinned_peak_reset(device)
                times[k].append(_time(fn, device))
                pinned[k] = peak()
                bad = [key for key, v in expected.items() if not torch.equal(target[key].cpu(), v)]
                if bad:
                    raise SystemExit(f"bench.gpu: {k} loaded wrong bytes into {bad[:3]}")
        rows = [f"{name}: {nbytes / 1e9:.2f} GB, {len(expected)} tensors, sharded over "
                f"{WORLD} ranks; page cache read {cache:.2f} GB/s"]
        dcp_load = statistics.median(times["DCP"])
        for k, ts in times.items():
            m = statistics.median(ts)
            rows.append(f"  load {k:22s} {m:7.3f} s  {nbytes / m / 1e9:6.2f} GB/s  "
                        f"{dcp_load / m:5.2f}x DCP  pinned peak {_mb(pinned[k])}")
        source = {k: v.to(device) for k, v in expected.items()}
        saves: dict[str, Callable[[str], None]] = {
            "ckptfs": lambda p: ckptfs.save(source, p),
            "DCP": lambda p: dcp.save(source, storage_writer=dcp.FileSystemWriter(p, sync_files=True)),
        }
        stimes: dict[str, list[float]] = {k: [] for k in saves}
        for i in range(repeats):
            for k, fn in saves.items():
                out = f"{work}/save-{i}-{k.replace(' ', '_')}"
                peak = _pinned_peak_reset(device)
                stimes[k].append(_time(lambda fn=fn, out=out: fn(out), device))
                pinned[k] = peak()
                shutil.rmtree(out, ignore_errors=True)
        dcp_save = statistics.median(stimes["DCP"])
        for k, ts in stimes.items():
            m = statistics.median(ts)
            rows.append(f"  save {k:22s} {m:7.3f} s  {nbytes / m / 1e9:6.2f} GB/s  "
                        f"{dcp_save / m:5.2f}x DCP  pinned peak {_mb(pinned[k])}")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _mb(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=8.0, help="GB per state (default 8)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated: fp32, bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=os.environ.get("TMPDIR", "/tmp"),
                    help="where the checkpoints go (needs ~3x --gb free)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: run the harness on CPU targets (no GPU numbers)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # dcp, 1 process
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.gpu needs a CUDA GPU: torch.cuda.is_available() is False (this torch: "
              f"{torch.__version__}). Nothing was measured. `--device cpu` runs the harness "
              "on CPU targets.", file=sys.stderr)
        return 2
    print(f"bench.gpu: torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    if args.device == "cuda":
        print(f"pinned host-to-device copy_: {h2d_floor():.2f} GB/s")
    for name in args.dtypes.split(","):
        for row in run_dtype(name.strip(), args.gb, args.repeats, args.device, args.dir):
            print(row, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
