"""Save and load throughput of the zarr backends vs safetensors_chunks and torch DCP.

    .venv/bin/python -m bench.zarr_quick [--gb 1.0] [--runs 3] [--dir /tmp/ckptfs-bench-zarr]

World size 1, local disk, ~``--gb`` GB of state: fp32 and bf16 4096x8192 matrices (3/4 and 1/4
of the bytes) plus 64 small fp32 tensors. For every run and every writer, in turn:
save (fsync'ed: ckptfs's local store fsyncs, DCP gets ``FileSystemWriter(sync_files=True)``),
``sync; echo 3 > /proc/sys/vm/drop_caches``, load into preallocated tensors, check the bytes,
delete. The writers' order is shuffled (seeded) per run; each gets one untimed warm-up first.
Writers: ckptfs zarr-2, zarr-3, zarr-3 with sharding, safetensors_chunks, DCP, and zarr-python's
own array API (v3, same chunking) as the reference for "chunks through zarr".

The machine may be shared: the table shows medians of ``--runs`` runs; treat differences
under ~20% as noise.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import time
import warnings

import torch

import ckptfs
from bench.worker import drop_caches

warnings.filterwarnings("ignore", category=UserWarning)
ROWS, COLS = 4096, 8192
MB = 1 << 20


def make_state(gb: float, fill: bool = True) -> dict:
    n32 = max(1, round(gb * 1024 * 0.75 / (ROWS * COLS * 4 / MB)))
    n16 = max(1, round(gb * 1024 * 0.25 / (ROWS * COLS * 2 / MB)))
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype):
        return torch.randn(shape, generator=g).to(dtype) if fill else torch.empty(shape, dtype=dtype)

    return {"fp32": {f"w{i}": t((ROWS, COLS), torch.float32) for i in range(n32)},
            "bf16": {f"w{i}": t((ROWS, COLS), torch.bfloat16) for i in range(n16)},
            "small": {f"b{i}": t((4096,), torch.float32) for i in range(64)}}


def tensors(sd: dict):
    return [(g, k, v) for g in sd for k, v in sd[g].items()]


def nbytes(sd: dict) -> int:
    return sum(v.numel() * v.element_size() for _, _, v in tensors(sd))



# -- writers: (save(sd, path), load(sd, path)) ----------------------------------------------
def _ckptfs(backend: str, version: int | None = None, options: dict | None = None):
    def save(sd, path):
        ckptfs.save(sd, path, backend=backend, backend_version=version, backend_options=options)

    def load(sd, path):
        ckptfs.load(sd, path)

    return save, load


def _dcp():
    import torch.distributed.checkpoint as dcp

    def save(sd, path):
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(path, sync_files=True))

    def load(sd, path):
        dcp.load(sd, storage_reader=dcp.FileSystemReader(path))

    return save, load


def _zarr_python():
    """zarr-python's own array API (v3, one chunk per tensor as ckptfs uses at world size 1).
    bf16 goes through the ckptfs zarr_dtypes registration."""
    import ml_dtypes
    import zarr

    from ckptfs.layout.backends import zarr_dtypes

    zarr_dtypes.register()

    def as_np(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def save(sd, path):
        g = zarr.open_group(path, mode="w", zarr_format=3)
        for grp, k, v in tensors(sd):
            a = as_np(v)
            arr = g.create_array(f"{grp}/{k}", shape=a.shape, dtype=a.dtype, chunks=a.shape,
                                 compressors=None, fill_value=0)
            arr[...] = a
        for d, _, files in os.walk(path):  # zarr-python does not fsync: do it for fairness
            for f in files:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

    def load(sd, path):
        g = zarr.open_group(path, mode="r")
        for grp, k, v in tensors(sd):
            as_np(v)[...] = g[f"{grp}/{k}"][...]

    return save, load


WRITERS = {
    "ckptfs zarr-2": lambda: _ckptfs("zarr", 2),
    "ckptfs zarr-3": lambda: _ckptfs("zarr", 3),
    "ckptfs zarr-3 sharded": lambda: _ckptfs("zarr", 3, {"sharding": True}),
    "ckptfs safetensors_chunks": lambda: _ckptfs("safetensors_chunks", 1),
    "torch DCP": _dcp,
    "zarr-python array API (v3)": _zarr_python,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-zarr")
    ap.add_argument("--only", nargs="*", help="writers to run (default: all)")
    args = ap.parse_args()
    names = args.only or list(WRITERS)
    ref = make_state(args.gb)
    size = nbytes(ref)
    fns = {n: WRITERS[n]() for n in names}
    times: dict[str, dict[str, list[float]]] = {n: {"save": [], "load": []} for n in names}
    cold = True
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    tiny = {"fp32": {"w": torch.ones(8, 8)}, "bf16": {"w": torch.ones(8, 8, dtype=torch.bfloat16)},
            "small": {}}
    for n in names:  # warm-up, untimed: imports, thread pools
        save, load = fns[n]
        path = os.path.join(args.dir, "warmup")
        save(tiny, path)
        load({g: {k: torch.empty_like(v) for k, v in d.items()} for g, d in tiny.items()}, path)
        shutil.rmtree(path)
    for run in range(args.runs):
        order = random.Random(run).sample(names, len(names))  # no writer always follows another
        for n in order:
            save, load = fns[n]
            path = os.path.join(args.dir, n.replace(" ", "_"))
            os.sync()
            t0 = time.perf_counter()
            save(ref, path)
            times[n]["save"].append(time.perf_counter() - t0)
            sd = make_state(args.gb, fill=False)
            cold = drop_caches() and cold
            t0 = time.perf_counter()
            load(sd, path)
            times[n]["load"].append(time.perf_counter() - t0)
            assert all(torch.equal(sd[g][k].view(torch.uint8), ref[g][k].view(torch.uint8))
                       for g, k, _ in tensors(ref)), f"{n}: loaded bytes differ"
            shutil.rmtree(path)
            print(f"run {run + 1}/{args.runs} {n}: save {times[n]['save'][-1]:.2f}s "
                  f"load {times[n]['load'][-1]:.2f}s", flush=True)
    gb = size / 1e9
    dcp = times.get("torch DCP")
    how = "cold (page cache dropped)" if cold else "WARM (could not drop caches)"
    print(f"\n{gb:.2f} GB ({len(tensors(ref))} tensors), world size 1, local disk, medians of "
          f"{args.runs} runs, loads {how}")
    print(f"{'writer':30s} {'save GB/s':>10s} {'load GB/s':>10s} {'save vs DCP':>12s} {'load vs DCP':>12s}")
    for n in names:
        s, ld = statistics.median(times[n]["save"]), statistics.median(times[n]["load"])
        rs = f"{statistics.median(dcp['save']) / s:.2f}x" if dcp else "-"
        rl = f"{statistics.median(dcp['load']) / ld:.2f}x" if dcp else "-"
        print(f"{n:30s} {gb / s:10.2f} {gb / ld:10.2f} {rs:>12s} {rl:>12s}")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
