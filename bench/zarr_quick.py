"""Save and load throughput of the zarr backends vs safetensors_chunks and torch DCP.

    .venv/bin/python -m bench.zarr_quick [--gb 1.0] [--runs 3] [--dir /tmp/ckptfs-bench-zarr]

World size 1, local disk, ~``--gb`` GB of state: fp32 and bf16 4096x8192 matrices (3/4 and 1/4
of the bytes; below 192 MiB one of each, with fewer columns) plus 64 small fp32 tensors. For
every run and every writer, in turn: save (fsync'ed: ckptfs's local store fsyncs, DCP gets
``FileSystemWriter(sync_files=True)``), ``sync; echo 3 > /proc/sys/vm/drop_caches``, load into
preallocated tensors, check the bytes, delete. The writers' order is shuffled (seeded) per run;
each gets one untimed warm-up first.
Writers: ckptfs zarr-2, zarr-3, zarr-3 with sharding, safetensors_chunks, DCP, and zarr-python's
own array API (v3, same chunking) as the reference for "chunks through zarr".

The machine may be shared: the table shows medians of ``--runs`` runs; treat differences
under ~20% as noise.

``--reshard``: the warm resharded load instead. Two spawned ranks save a state of mid-size
row-sharded DTensors (per layer fp32 (4096, 1024), (1024, 4096), (3072, 1024) and bf16
(4096, 1024), 12-16 MiB each; ``--gb`` in all) with every writer that loads through its own
library (ckptfs zarr-2, zarr-3, safetensors_chunks, DCP); then, ``--runs`` times, each writer
in turn (the order reversed every run) loads it into one rank, in a fresh spawned world of its
own, with the page cache warm (its files read whole right before: another job on a shared
machine may have dropped the cache): the first load in that process (what a restarted job
meets: the library imported, nothing else done yet) and the same load again. Every load is checked
bit for bit. Results: bench/results/zarr-reshard-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import time
import warnings
from pathlib import Path

import torch

import ckptfs
from bench.worker import drop_caches

warnings.filterwarnings("ignore", category=UserWarning)
ROWS, COLS = 4096, 8192
MB = 1 << 20


def make_state(gb: float, fill: bool = True) -> dict:
    cols = min(COLS, max(8, int(gb * 1024 * MB / (ROWS * 6))))  # fewer below 192 MiB
    n32 = max(1, round(gb * 1024 * 0.75 / (ROWS * cols * 4 / MB)))
    n16 = max(1, round(gb * 1024 * 0.25 / (ROWS * cols * 2 / MB)))
    g = torch.Generator().manual_seed(0)

    def t(shape, dtype):
        return torch.randn(shape, generator=g).to(dtype) if fill else torch.empty(shape, dtype=dtype)

    return {"fp32": {f"w{i}": t((ROWS, cols), torch.float32) for i in range(n32)},
            "bf16": {f"w{i}": t((ROWS, cols), torch.bfloat16) for i in range(n16)},
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


# -- the warm resharded load (--reshard) ----------------------------------------------------
RESHARD_WRITERS = ("ckptfs zarr-2", "ckptfs zarr-3", "ckptfs safetensors_chunks", "torch DCP")


def mid_specs(gb: float) -> list:
    """Layers of mid-size tensors (12-16 MiB) until the state holds ``gb`` GB (one at least)."""
    from bench.synthetic import TensorSpec

    out: list[TensorSpec] = []
    while not out or sum(s.nbytes for s in out) < gb * 1e9:
        i = len(out) // 4
        p, base = f"layers.{i}.", 16 * i
        out += [TensorSpec(p + "wq", torch.float32, (4096, 1024), base + 1),
                TensorSpec(p + "wo", torch.float32, (1024, 4096), base + 2),
                TensorSpec(p + "w1", torch.float32, (3072, 1024), base + 3),
                TensorSpec(p + "w2", torch.bfloat16, (4096, 1024), base + 4)]
    return out


def _reshard_io(name: str):
    """(save, load) of one writer for DTensor states (a process group is up)."""
    if name == "torch DCP":
        import torch.distributed.checkpoint as dcp

        return (lambda sd, p: dcp.save(sd, storage_writer=dcp.FileSystemWriter(p, sync_files=True)),
                lambda sd, p: dcp.load(sd, storage_reader=dcp.FileSystemReader(p)))
    backend, _, version = name.removeprefix("ckptfs ").partition("-")
    return (lambda sd, p: ckptfs.save(sd, p, backend=backend, backend_version=int(version or 1)),
            lambda sd, p: ckptfs.load(sd, p))


def _reshard_save(rank: int, world: int, root: str, gb: float, names: list[str]) -> None:
    import torch.distributed as dist

    from bench.synthetic import make_state

    state = make_state(mid_specs(gb), rank, world, zeros=False)
    for n in names:
        path = os.path.join(root, n.replace(" ", "_"))
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        _reshard_io(n)[0](state, path)
        dist.barrier()


def _reshard_load(rank: int, world: int, root: str, gb: float, name: str, out: str) -> None:
    """A fresh one-rank world: the first load of ``name``'s checkpoint, then the same again."""
    from bench.synthetic import check_state, make_state

    specs = mid_specs(gb)
    target = make_state(specs, rank, world, zeros=True)
    load = _reshard_io(name)[1]
    path = os.path.join(root, name.replace(" ", "_"))
    secs = []
    for _ in range(2):
        for t in target.values():
            t.to_local().zero_()
        _warm(path)
        t0 = time.perf_counter()
        load(target, path)
        secs.append(time.perf_counter() - t0)
        bad = check_state(specs, target, rank, world)
        assert not bad, f"{name}: loaded bytes differ in {bad[:3]}"
    Path(out).write_text(json.dumps(secs))


def _warm(path: str) -> None:
    """Read every file under ``path`` whole (into the page cache)."""
    buf = bytearray(16 << 20)
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def reshard_main(args: argparse.Namespace) -> None:
    """``--reshard``: save on 2 ranks, load 2->1 warm, each load in a fresh world."""
    from ckptfs.testing.ranks import run_ranks

    names = args.only or list(RESHARD_WRITERS)
    nbytes = sum(s.nbytes for s in mid_specs(args.gb))
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    run_ranks(2, _reshard_save, args.dir, args.gb, names, timeout=1800)
    out = os.path.join(args.dir, "secs.json")
    times: dict[str, list[list[float]]] = {n: [] for n in names}
    for run in range(args.runs + 1):  # run 0 reads every file once: the page cache is warm
        for n in names if run % 2 == 0 else names[::-1]:
            run_ranks(1, _reshard_load, args.dir, args.gb, n, out, timeout=600)
            if run:
                times[n].append(json.loads(Path(out).read_text()))
                print(f"run {run}/{args.runs} {n}: first load {times[n][-1][0]:.3f} s, "
                      f"again {times[n][-1][1]:.3f} s", flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    report_reshard(times, nbytes, args)


def report_reshard(times: dict[str, list[list[float]]], nbytes: int, args: argparse.Namespace) -> None:
    med = {n: [statistics.median(r[i] for r in v) for i in (0, 1)] for n, v in times.items()}
    dcp = med.get("torch DCP")
    print(f"\n{nbytes / 1e9:.2f} GB of 12-16 MiB row-sharded DTensors saved by 2 ranks, loaded "
          f"by 1 (resharded), page cache warm, medians of {args.runs} runs (min in brackets)")
    print(f"{'writer':28s} {'first load':>16s} {'again':>16s} {'DCP/this first':>15s} "
          f"{'DCP/this again':>15s}")
    for n, (first, again) in med.items():
        lo = [min(r[i] for r in times[n]) for i in (0, 1)]
        ratios = [f"{dcp[i] / x:.2f}x" if dcp else "-" for i, x in enumerate((first, again))]
        print(f"{n:28s} {first:9.3f} ({lo[0]:.3f}) {again:9.3f} ({lo[1]:.3f}) {ratios[0]:>15s} "
              f"{ratios[1]:>15s}")
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    path = results / f"zarr-reshard-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"gb": nbytes / 1e9, "runs": args.runs, "seconds": times,
                                "medians": med, "threads": torch.get_num_threads()}, indent=1))
    print(f"# results: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-zarr")
    ap.add_argument("--only", nargs="*", help="writers to run (default: all)")
    ap.add_argument("--reshard", action="store_true", help="the warm 2->1 resharded load instead")
    args = ap.parse_args(argv)
    if args.reshard:
        reshard_main(args)
        return
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
