"""Hugging Face export spread over the ranks: ckptfs vs DCP's consolidation, same ranks and bytes.

    python -m bench.hf_export [--mb 1500] [--tensor-mb 32] [--files 8] [--reps 3] [--dir /tmp/ckptfs-bench-hf]

A state of ``--mb`` MB (fp32 tensors of ``--tensor-mb`` MB, FSDP-style DTensors sharded by rows
over 2 gloo ranks) is saved twice by those 2 ranks: as a ckptfs checkpoint, and with DCP's
``HuggingFaceStorageWriter(save_distributed=True)`` (its per-rank sharded safetensors, the input
of DCP's consolidation). Then each export runs in a fresh world of 1 and of 2 ranks into
``--files`` ``model-0000i-of-0000N.safetensors`` files holding the same tensors:

- ckptfs ``unshard(ckpt, out, format="hf", strategy="chunks")``, every rank writing its files;
- ckptfs ``export_hf(state, out, max_shard_size=...)`` from the live DTensors (loaded from the
  checkpoint before the clock starts): the route without a save and a read;
- DCP ``consolidate_safetensors_files_on_every_rank`` (the mapping sends the same tensors to
  the same files).

The plain copy beside them: each rank copies its share of the checkpoint's data files (dealt by
bytes) into new files with plain ``readinto`` and ``write`` through one reused buffer, one
thread reading then writing: the same bytes read from the page cache and written, with no
header, checksum or placement. It is a reference for what those bytes cost with plain calls,
not a lower bound (the exports overlap their reads and writes; it does not). The runs
alternate: each repetition runs every export and the plain copy at 1 and 2 ranks in turn, so a
change in the machine's load falls on all of them; the table gives each one's median.

Each rank reports its wall time and its peak resident-set rise over its baseline after imports
and joining the group (VmHWM, reset through /proc/self/clear_refs; for ``export_hf``, after the
live state is loaded), against the target of the largest tensor plus 256 MiB. The outputs are
checked: ckptfs's files are the same bytes from 1 and 2 ranks and from both routes, and hold the
same tensors as DCP's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

JOBS = ("plain copy (reference)", "ckptfs unshard", "ckptfs export_hf", "dcp consolidate")
COPY_PIECE = 32 << 20  #: bytes per read and write of the plain copy


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def names(n: int) -> list[str]:
    return [f"layers.{i:03d}.weight" for i in range(n)]


def _build(rank: int, world: int, root: str, n: int, rows: int, per_file: int) -> None:
    """The 2 ranks save the state both ways."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfs

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state = {k: distribute_tensor(torch.randn(rows, 1024, generator=g), mesh, [Shard(0)])
             for k in names(n)}
    ckptfs.save({"model": state}, f"{root}/ckpt", overwrite=True)
    mapping = {k: 1 + i // per_file for i, k in enumerate(names(n))}
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        path=f"{root}/dcp-in", fqn_to_index_mapping=mapping, save_distributed=True))


def _live(world: int, root: str, n: int, rows: int) -> dict:
    """The state as a training job holds it: DTensors sharded by rows, filled from the checkpoint."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptfs

    mesh = init_device_mesh("cpu", (world,))
    state = {k: distribute_tensor(torch.zeros(rows, 1024), mesh, [Shard(0)]) for k in names(n)}
    ckptfs.load({"model": state}, f"{root}/ckpt")
    return state


def _out(root: str, job: str, world: int) -> str:
    return f"{root}/out-{job.split()[1]}-{world}"


def _copy_share(root: str, out: str, rank: int, world: int) -> None:
    """The plain copy: this rank's share of the checkpoint's data files copied with plain calls."""
    from ckptfs.tools.unshard import assign_files

    files = sorted(p for p in Path(root, "ckpt").rglob("*") if p.is_file()
                   and p.name != "ckptfs.index.json")
    owner = assign_files([f.stat().st_size for f in files], world)
    os.makedirs(out, exist_ok=True)
    buf = bytearray(COPY_PIECE)
    view = memoryview(buf)
    for f, r in zip(files, owner, strict=True):
        if r != rank:
            continue
        with open(f, "rb", buffering=0) as src, open(f"{out}/{f.name}", "wb", buffering=0) as dst:
            while n := src.readinto(view):
                dst.write(view[:n])


def _job(rank: int, world: int, root: str, job: str, n: int, per_file: int, chunk: int,
         rows: int) -> None:
    """One export in a fresh world; each rank writes its numbers to a JSON file."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank,
    )

    import ckptfs
    import ckptfs.tools.unshard
    from ckptfs.dist import Comm

    out = _out(root, job, world)
    state = _live(world, root, n, rows) if job == "ckptfs export_hf" else None
    Comm(None).barrier()  # ckptfs's group joined before the baseline
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    t0 = time.perf_counter()
    if job == "plain copy (reference)":
        _copy_share(root, out, rank, world)
    elif job == "ckptfs unshard":
        ckptfs.unshard(f"{root}/ckpt", out, format="hf", strategy="chunks", chunk_size=chunk,
                       keys=["model"], overwrite=True)
    elif state is not None:
        ckptfs.export_hf(state, out, max_shard_size=chunk, overwrite=True)
    else:
        mapping = {k: 1 + i // per_file for i, k in enumerate(names(n))}
        os.makedirs(out, exist_ok=True)
        consolidate_safetensors_files_on_every_rank(f"{root}/dcp-in", out, mapping)
    Comm(None).barrier()  # the export ends when its last rank is done
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    Path(f"{out}.rank{rank}.json").write_text(json.dumps({"seconds": seconds, "peak_rise": peak}))


def _same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    for f in sorted(a.glob("model-*.safetensors")):
        x, y = load_file(str(f)), load_file(str(b / f.name))
        if x.keys() != y.keys() or any(not x[k].equal(y[k]) for k in x):
            return False
    return True


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob("model*"))}


def _run_all(root: Path, reps: int, n: int, per_file: int, chunk: int, rows: int
             ) -> tuple[list[dict], list[list[float]]]:
    """Every job at 1 and 2 ranks, ``reps`` times, alternating; the load average before each
    repetition."""
    from ckptfs.testing.ranks import run_ranks

    runs: list[dict] = []
    loads = []
    for rep in range(reps):
        loads.append(list(os.getloadavg()))
        for job in JOBS:
            for world in (1, 2):
                out = _out(str(root), job, world)
                shutil.rmtree(out, ignore_errors=True)
                run_ranks(world, _job, str(root), job, n, per_file, chunk, rows, timeout=1800)
                got = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
                runs.append({"job": job, "ranks": world, "rep": rep,
                             "seconds": max(g["seconds"] for g in got),
                             "peak_rise_per_rank": [g["peak_rise"] for g in got]})
    return runs, loads


def _medians(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (job, ranks): the median seconds, every run's seconds and the highest peak rise."""
    out: dict[tuple[str, int], dict] = {}
    for r in runs:
        row = out.setdefault((r["job"], r["ranks"]), {"seconds_all": [], "peak": [0] * r["ranks"]})
        row["seconds_all"].append(r["seconds"])
        row["peak"] = [max(a, b) for a, b in zip(row["peak"], r["peak_rise_per_rank"], strict=True)]
    for row in out.values():
        row["seconds"] = statistics.median(row["seconds_all"])
    return out


def _report(by: dict[tuple[str, int], dict], n: int, tensor: int, files: int,
            loads: list[list[float]]) -> dict[str, float]:
    print(f"state: {n * tensor / 1e6:.0f} MB in {n} fp32 tensors of {tensor / 1e6:.1f} MB, "
          f"{files} files; load average (1 min) before each repetition: "
          f"{', '.join(f'{x[0]:.2f}' for x in loads)}, after: {os.getloadavg()[0]:.2f}\n")
    print("| export | ranks | median seconds | runs | peak RSS rise per rank (MiB) |")
    print("|---|---|---|---|---|")
    for (job, world), row in by.items():
        rise = " / ".join(f"{p / 2**20:.0f}" for p in row["peak"])
        runs = " ".join(f"{x:.2f}" for x in row["seconds_all"])
        print(f"| {job} | {world} | {row['seconds']:.2f} | {runs} | {rise} |")
    sec = {k: v["seconds"] for k, v in by.items()}
    ratios = {
        "unshard_1_over_2": sec[("ckptfs unshard", 1)] / sec[("ckptfs unshard", 2)],
        "dcp_over_unshard_1": sec[("dcp consolidate", 1)] / sec[("ckptfs unshard", 1)],
        "dcp_over_unshard_2": sec[("dcp consolidate", 2)] / sec[("ckptfs unshard", 2)],
        "copy_over_unshard_1": sec[("plain copy (reference)", 1)] / sec[("ckptfs unshard", 1)],
        "copy_over_unshard_2": sec[("plain copy (reference)", 2)] / sec[("ckptfs unshard", 2)],
        "copy_1_over_2": sec[("plain copy (reference)", 1)] / sec[("plain copy (reference)", 2)],
        "export_hf_2_over_unshard_2": sec[("ckptfs export_hf", 2)] / sec[("ckptfs unshard", 2)],
    }
    print(f"\nckptfs unshard 1 rank / 2 ranks: {ratios['unshard_1_over_2']:.2f}x (plain copy "
          f"{ratios['copy_1_over_2']:.2f}x); DCP / ckptfs unshard: 1 rank "
          f"{ratios['dcp_over_unshard_1']:.2f}x, 2 ranks {ratios['dcp_over_unshard_2']:.2f}x; "
          f"plain copy / unshard: 1 rank {ratios['copy_over_unshard_1']:.2f}, 2 ranks "
          f"{ratios['copy_over_unshard_2']:.2f}; export_hf 2 ranks / unshard 2 ranks: "
          f"{ratios['export_hf_2_over_unshard_2']:.2f}x")
    return ratios


def main(argv: list[str] | None = None) -> int:
    from ckptfs.testing.ranks import run_ranks

    ap = argparse.ArgumentParser(prog="python -m bench.hf_export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1500)
    ap.add_argument("--tensor-mb", type=float, default=32)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-hf")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = max(2, int(args.tensor_mb * 1e6 / 4096) // 2 * 2)
    n = max(args.files, int(args.mb / args.tensor_mb))
    per_file = -(-n // args.files)
    tensor = rows * 4096
    run_ranks(2, _build, str(root), n, rows, per_file, timeout=1800)
    runs, loads = _run_all(root, args.reps, n, per_file, per_file * tensor, rows)
    ref = _files(root / "out-unshard-1")
    same = all(_files(root / f"out-{d}") == ref for d in ("unshard-2", "export_hf-1", "export_hf-2"))
    same_dcp = _same_tensors(root / "out-unshard-2", root / "out-consolidate-2")
    by = _medians(runs)
    ratios = _report(by, n, tensor, args.files, loads)
    print(f"target per rank (largest tensor + 256 MiB): {(tensor + (256 << 20)) / 2**20:.0f} MiB; "
          f"ckptfs files the same bytes from 1 and 2 ranks and both routes: {same}; "
          f"same tensors as DCP's: {same_dcp}")
    doc = {"bench": "hf_export", "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core, CPU",
           "cpus": os.cpu_count(), "load_average_before_each_rep": loads,
           "load_average_after": os.getloadavg(), "mb": n * tensor / 1e6, "tensor_bytes": tensor,
           "files": args.files, "reps": args.reps, "runs": runs,
           "median_seconds": {f"{j} / {w}": v["seconds"] for (j, w), v in by.items()},
           "ratios": ratios, "same_bytes_1_vs_2_ranks": same, "same_tensors_as_dcp": same_dcp}
    Path(args.results).mkdir(parents=True, exist_ok=True)
    Path(args.results, f"hf_export-{int(doc['mb'])}mb.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(root)
    return 0 if same and same_dcp else 1


if __name__ == "__main__":
    sys.exit(main())
