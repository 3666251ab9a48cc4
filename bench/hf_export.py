"""Hugging Face export spread over the ranks: ckptfs vs DCP's consolidation, same ranks and bytes.

    python -m bench.hf_export [--mb 1500] [--tensor-mb 32] [--files 8] [--reps 3] [--dir /tmp/ckptfs-bench-hf]
                              [--jobs floor,unshard,export_hf,dcp] [--phases] [--live-reps 3]

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

- ``unshard`` again with every batch read into new tensors (``read_regions(reuse=False)``, as
  before its batch buffers were reused): the memory and time of that change in the same run.

The floor beside them, a plain parallel copy: each rank copies the same bytes ``unshard``'s
rank reads, split the same way (the files dealt to the ranks by bytes, ``assign_files``): each
of its tensors' stored chunks, read from the checkpoint's data files with ``preadv`` through
one reused buffer and written with ``write`` into one file per output file, one thread, no
header, checksum or placement. Its 2-rank against 1-rank speed-up is what a second rank can
gain on this machine for these bytes; the export's speed-up is printed beside it (a floor
below the 1.6x target on this machine says the target needs more cores). Its time is not a
lower bound for the export's (the exports overlap their reads and writes with more threads;
it does not). The runs alternate: each repetition runs every job at 1 and 2 ranks in turn, so
a change in the machine's load falls on all of them; the table gives each one's median.

Each rank also reports its CPU seconds (every thread): CPU over wall seconds is the cores the
rank kept busy; a 1-rank export that already keeps most of the cores busy cannot gain the
floor's speed-up from a second rank. ``--phases`` prints ``unshard``'s phases per rank
(``UnshardResult.phases``, medians over the repetitions); ``--jobs`` runs some jobs only.

Last (``--live-reps``, 0 to skip), the live export against the checkpoint route inside one
world of 1 and then 2 ranks that holds the live state, as the training job that exports does:
``export_hf``, the route's ``ckptfs.save`` and its ``unshard``, and a floor (each rank's own
shard bytes written with plain calls), alternating; the target is the live export no slower
than the route without its save and read, which the floor bounds from below.

Each rank reports its wall time and its peak resident-set rise over its baseline after imports
and joining the group (VmHWM, reset through /proc/self/clear_refs; for ``export_hf``, after the
live state is loaded), against the target of the largest tensor plus 256 MiB. Each run's
output is checked as soon as it ends, then removed (``_Outputs``): ckptfs's files are the same
bytes from 1 and 2 ranks and from both routes, and hold the same tensors as DCP's. So every run
writes while ``--dir`` holds the same bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

FLOOR = "plain copy (floor)"
FRESH = "ckptfs unshard, fresh batches"
JOBS = (FLOOR, "ckptfs unshard", FRESH, "ckptfs export_hf", "dcp consolidate")
SHORT = {"floor": FLOOR, "unshard": "ckptfs unshard", "fresh": FRESH,
         "export_hf": "ckptfs export_hf", "dcp": "dcp consolidate"}
COPY_PIECE = 32 << 20  #: bytes per read and write of the plain copy
TARGET = 1.6  #: the 2-rank export's target speed-up over 1 rank


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
    return f"{root}/out-{job.split()[1].rstrip(',')}{'-fresh' if job == FRESH else ''}-{world}"


def _ranges(root: str, chunk: int, rank: int, world: int) -> list[list[tuple[str, int, int]]]:
    """The (data file, offset, length) of every stored chunk of this rank's output files, as
    ``unshard(..., strategy="chunks")`` packs the tensors (key order, at most ``chunk`` bytes
    a file) and deals the files (``assign_files``)."""
    from ckptfs.tools.source import nbytes, open_checkpoint
    from ckptfs.tools.unshard import assign_files

    with open_checkpoint(f"{root}/ckpt") as src:
        tensors = sorted(k for k in src.index.tensors if k.startswith("model/"))
        files: list[list[str]] = [[]]
        size = 0
        for k in tensors:
            n = nbytes(src.index.tensors[k])
            if files[-1] and size + n > chunk:
                files.append([])
                size = 0
            files[-1].append(k)
            size += n
        sizes = [sum(nbytes(src.index.tensors[k]) for k in f) for f in files]
        owner = assign_files(sizes, world)
        return [[(str(c.file), int(c.byte_offset or 0), int(c.byte_length or 0))
                 for k in f for c in sorted(src.index.tensors[k].chunks, key=lambda c: c.offsets)]
                for f, r in zip(files, owner, strict=True) if r == rank]


def _copy_share(root: str, out: str, ranges: list[list[tuple[str, int, int]]]) -> None:
    """The floor: this rank's byte ranges copied with plain calls through one buffer."""
    os.makedirs(out, exist_ok=True)
    view = memoryview(bytearray(COPY_PIECE))
    fds: dict[str, int] = {}
    try:
        for i, file in enumerate(ranges):
            with open(f"{out}/{i:05d}.bin", "wb", buffering=0) as dst:
                for name, offset, length in file:
                    fd = fds.get(name) or fds.setdefault(name, os.open(f"{root}/ckpt/{name}", os.O_RDONLY))
                    end = offset + length
                    while offset < end:
                        n = os.preadv(fd, [view[:min(COPY_PIECE, end - offset)]], offset)
                        dst.write(view[:n])
                        offset += n
    finally:
        for fd in fds.values():
            os.close(fd)


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
    ranges = _ranges(root, chunk, rank, world) if job == FLOOR else []
    Comm(None).barrier()  # ckptfs's group joined before the baseline
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    phases: list = []
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    if job == FLOOR:
        _copy_share(root, out, ranges)
    elif job in ("ckptfs unshard", FRESH):
        # FRESH: each batch in tensors of its own, as before the buffers were reused
        with _fresh_batches() if job == FRESH else contextlib.nullcontext():
            got = ckptfs.unshard(f"{root}/ckpt", out, format="hf", strategy="chunks",
                                 chunk_size=chunk, keys=["model"], overwrite=True)
        phases = [*got.phases.phases, ("cpu", got.phases.cpu_seconds)]
    elif state is not None:
        ckptfs.export_hf(state, out, max_shard_size=chunk, overwrite=True)
    else:
        mapping = {k: 1 + i // per_file for i, k in enumerate(names(n))}
        os.makedirs(out, exist_ok=True)
        consolidate_safetensors_files_on_every_rank(f"{root}/dcp-in", out, mapping)
    own = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    Comm(None).barrier()  # the export ends when its last rank is done
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(
        {"seconds": seconds, "own_seconds": own, "cpu_seconds": cpu, "peak_rise": peak,
         "phases": phases}))


@contextlib.contextmanager
def _fresh_batches() -> Iterator[None]:
    """Within the block, this process's unshard reads every batch into new tensors
    (``reuse=False``); after it, into its reused buffers again (a pooled rank outlives the job)."""
    import ckptfs.tools.unshard as unshard

    read = unshard.read_regions
    unshard.read_regions = lambda *a, **k: read(*a, **{**k, "reuse": False})  # type: ignore[assignment]
    try:
        yield
    finally:
        unshard.read_regions = read


def _same_tensors(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    for f in sorted(a.glob("model-*.safetensors")):
        x, y = load_file(str(f)), load_file(str(b / f.name))
        if x.keys() != y.keys() or any(not x[k].equal(y[k]) for k in x):
            return False
    return True


def _same_files(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` hold the same ``model*`` files, byte for byte."""
    names = sorted(p.name for p in a.glob("model*"))
    return names == sorted(p.name for p in b.glob("model*")) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


class _Outputs:
    """Each run's files checked as soon as it ends, then removed: the first ckptfs output is
    kept as the reference, the others must be the same bytes, DCP's the same tensors. So every
    run writes while the folder holds the same bytes (the checkpoint, DCP's input, the
    reference): on a tmpfs a new run's pages would otherwise come from memory untouched for
    longer and longer, which a virtual machine may back lazily (the performance page has the
    measurement)."""

    def __init__(self, root: Path) -> None:
        self.reference = root / "reference"
        self.same: list[bool] = []
        self.same_dcp: list[bool] = []

    def check(self, job: str, out: Path) -> None:
        if job.startswith("ckptfs"):
            if not self.reference.exists():
                out.rename(self.reference)
                return
            self.same.append(_same_files(out, self.reference))
        elif job == "dcp consolidate" and self.reference.exists():
            self.same_dcp.append(_same_tensors(self.reference, out))
        shutil.rmtree(out, ignore_errors=True)

    def verdicts(self) -> tuple[bool | None, bool | None]:
        """(ckptfs's files the same bytes from 1 and 2 ranks and both routes, the same tensors
        as DCP's); None where the runs to compare did not happen."""
        return (all(self.same) if self.same else None,
                all(self.same_dcp) if self.same_dcp else None)


def _run_all(root: Path, jobs: list[str], reps: int, n: int, per_file: int, chunk: int,
             rows: int, outputs: _Outputs) -> tuple[list[dict], list[list[float]]]:
    """Every job at 1 and 2 ranks, ``reps`` times, alternating; the load average before each
    repetition. Each run's output is checked and removed by ``outputs``."""
    from ckptfs.testing.ranks import run_ranks

    runs: list[dict] = []
    loads = []
    for rep in range(reps):
        loads.append(list(os.getloadavg()))
        for job in jobs:
            for world in (1, 2):
                out = _out(str(root), job, world)
                run_ranks(world, _job, str(root), job, n, per_file, chunk, rows, timeout=1800)
                got = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]
                outputs.check(job, Path(out))
                runs.append({"job": job, "ranks": world, "rep": rep,
                             "seconds": max(g["seconds"] for g in got),
                             "peak_rise_per_rank": [g["peak_rise"] for g in got],
                             "cores_per_rank": [g["cpu_seconds"] / max(g["own_seconds"], 1e-9)
                                                for g in got],
                             "phases_per_rank": [g["phases"] for g in got]})
    return runs, loads


def _medians(runs: list[dict]) -> dict[tuple[str, int], dict]:
    """Per (job, ranks): the median seconds, every run's seconds, the highest peak rise, the
    median cores kept busy per rank and (unshard) the median seconds of each phase per rank."""
    out: dict[tuple[str, int], dict] = {}
    for r in runs:
        row = out.setdefault((r["job"], r["ranks"]), {"seconds_all": [], "peak": [0] * r["ranks"],
                                                       "cores": [], "phases": []})
        row["seconds_all"].append(r["seconds"])
        row["peak"] = [max(a, b) for a, b in zip(row["peak"], r["peak_rise_per_rank"], strict=True)]
        row["cores"].append(r["cores_per_rank"])
        row["phases"].append(r["phases_per_rank"])
    for row in out.values():
        row["seconds"] = statistics.median(row["seconds_all"])
        row["cores"] = [statistics.median(c) for c in zip(*row["cores"], strict=True)]
        row["phases"] = [_phase_medians(p) for p in zip(*row["phases"], strict=True)]
    return out


def _phase_medians(per_rep: tuple[list, ...]) -> dict[str, float]:
    """One rank's phases over the repetitions: the median seconds of each."""
    names = list(dict.fromkeys(name for rep in per_rep for name, _ in rep))
    return {n: statistics.median(dict(rep).get(n, 0.0) for rep in per_rep) for n in names}


def _ratio(sec: dict[tuple[str, int], float], a: tuple[str, int], b: tuple[str, int]) -> float | None:
    return sec[a] / sec[b] if a in sec and b in sec else None


def _ratios(by: dict[tuple[str, int], dict]) -> dict[str, float | None]:
    sec = {k: v["seconds"] for k, v in by.items()}
    u, e, d, f = "ckptfs unshard", "ckptfs export_hf", "dcp consolidate", FLOOR
    return {
        "unshard_1_over_2": _ratio(sec, (u, 1), (u, 2)),
        "fresh_1_over_2": _ratio(sec, (FRESH, 1), (FRESH, 2)),
        "fresh_over_unshard_1": _ratio(sec, (FRESH, 1), (u, 1)),
        "fresh_over_unshard_2": _ratio(sec, (FRESH, 2), (u, 2)),
        "export_hf_1_over_2": _ratio(sec, (e, 1), (e, 2)),
        "floor_1_over_2": _ratio(sec, (f, 1), (f, 2)),
        "dcp_over_unshard_1": _ratio(sec, (d, 1), (u, 1)),
        "dcp_over_unshard_2": _ratio(sec, (d, 2), (u, 2)),
        "floor_over_unshard_1": _ratio(sec, (f, 1), (u, 1)),
        "floor_over_unshard_2": _ratio(sec, (f, 2), (u, 2)),
        "export_hf_2_over_unshard_2": _ratio(sec, (e, 2), (u, 2)),
    }


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _report(by: dict[tuple[str, int], dict], n: int, tensor: int, files: int,
            loads: list[list[float]], phases: bool) -> dict[str, float | None]:
    print(f"state: {n * tensor / 1e6:.0f} MB in {n} fp32 tensors of {tensor / 1e6:.1f} MB, "
          f"{files} files, {os.cpu_count()} cores; load average (1 min) before each repetition: "
          f"{', '.join(f'{x[0]:.2f}' for x in loads)}, after: {os.getloadavg()[0]:.2f}\n")
    print("| job | ranks | median seconds | runs | cores busy per rank | peak RSS rise per rank (MiB) |")
    print("|---|---|---|---|---|---|")
    for (job, world), row in by.items():
        rise = " / ".join(f"{p / 2**20:.0f}" for p in row["peak"])
        runs = " ".join(f"{x:.2f}" for x in row["seconds_all"])
        cores = " / ".join(f"{c:.2f}" for c in row["cores"])
        print(f"| {job} | {world} | {row['seconds']:.2f} | {runs} | {cores} | {rise} |")
    ratios = _ratios(by)
    floor = ratios["floor_1_over_2"]
    print(f"\n2 ranks against 1: ckptfs unshard {_x(ratios['unshard_1_over_2'])}, ckptfs export_hf "
          f"{_x(ratios['export_hf_1_over_2'])}, the floor (plain parallel copy) {_x(floor)}; "
          f"target {TARGET}x")
    if floor is not None and floor < TARGET:
        print(f"the floor itself gains {floor:.2f}x < {TARGET}x from a second rank on this machine "
              f"({os.cpu_count()} cores, shared): the {TARGET}x target needs a machine with more "
              f"cores than this one")
    print(f"DCP / ckptfs unshard: 1 rank {_x(ratios['dcp_over_unshard_1'])}, 2 ranks "
          f"{_x(ratios['dcp_over_unshard_2'])}; floor / unshard: 1 rank "
          f"{_x(ratios['floor_over_unshard_1'])}, 2 ranks {_x(ratios['floor_over_unshard_2'])}; "
          f"export_hf 2 ranks / unshard 2 ranks: {_x(ratios['export_hf_2_over_unshard_2'])}")
    print(f"unshard with fresh batches / with reused buffers: 1 rank "
          f"{_x(ratios['fresh_over_unshard_1'])}, 2 ranks {_x(ratios['fresh_over_unshard_2'])}")
    if phases:
        _print_phases(by)
    return ratios


def _print_phases(by: dict[tuple[str, int], dict]) -> None:
    """unshard's phases per rank (median seconds over the repetitions)."""
    rows = [(w, r, p) for (job, w), row in by.items() if job == "ckptfs unshard"
            for r, p in enumerate(row["phases"])]
    if not rows:
        return
    names = list(dict.fromkeys(n for _, _, p in rows for n in p))
    print("\nckptfs unshard, median seconds per phase:\n")
    print(f"| ranks | rank | {' | '.join(names)} |")
    print(f"|---|---|{'---|' * len(names)}")
    for w, r, p in rows:
        print(f"| {w} | {r} | {' | '.join(f'{p.get(n, 0.0):.3f}' for n in names)} |")


LIVE = ("ckptfs export_hf", "ckptfs.save", "ckptfs unshard", "plain write (floor)")


def _live_rank(rank: int, world: int, root: str, n: int, rows: int, chunk: int, reps: int) -> None:
    """The live export against the checkpoint route inside one job that holds the state, as a
    training job does (so every job writes while the same memory is in use): each repetition
    runs the export, the route's save and its unshard, and the floor (each rank's own shard
    bytes written with plain calls), the order reversed every other repetition; each output is
    removed after it. The seconds of each job (to its last rank) go to a JSON file per rank."""
    import ckptfs
    from ckptfs.dist import Comm

    state = _live(world, root, n, rows)
    comm, got = Comm(None), []
    for rep in range(reps):
        for job in (LIVE if rep % 2 == 0 else (LIVE[3], LIVE[1], LIVE[2], LIVE[0])):
            out = f"{root}/live-{('export', 'save', 'unshard', 'floor')[LIVE.index(job)]}-{world}"
            comm.barrier()
            t0 = time.perf_counter()
            if job == LIVE[0]:
                ckptfs.export_hf(state, out, max_shard_size=chunk, overwrite=True)
            elif job == LIVE[1]:
                ckptfs.save({"model": state}, out, overwrite=True)
            elif job == LIVE[2]:
                ckptfs.unshard(f"{root}/live-save-{world}", out, format="hf", strategy="chunks",
                               chunk_size=chunk, keys=["model"], overwrite=True)
            else:
                _write_shards(state, out, rank)
            comm.barrier()
            got.append({"job": job, "rep": rep, "seconds": time.perf_counter() - t0})
            if rank == 0 and job != LIVE[1]:
                shutil.rmtree(out, ignore_errors=True)
                if job == LIVE[2]:
                    shutil.rmtree(f"{root}/live-save-{world}", ignore_errors=True)
    Path(f"{root}/live-{world}.rank{rank}.json").write_text(json.dumps(got))


def _write_shards(state: dict, out: str, rank: int) -> None:
    """The floor: this rank's shard of every tensor written with one plain ``write`` each."""
    os.makedirs(out, exist_ok=True)
    for i, t in enumerate(state.values()):
        with open(f"{out}/{i:05d}.rank{rank}.bin", "wb", buffering=0) as f:
            f.write(memoryview(t.to_local().numpy()).cast("B"))


def _run_live(root: Path, reps: int, n: int, rows: int, chunk: int) -> dict:
    """``_live_rank`` at 1 and 2 ranks: per world, each job's median and every run's seconds."""
    from ckptfs.testing.ranks import run_ranks

    out: dict = {}
    for world in (1, 2):
        run_ranks(world, _live_rank, str(root), n, rows, chunk, reps, timeout=1800)
        runs = json.loads(Path(f"{root}/live-{world}.rank0.json").read_text())
        out[str(world)] = {job: {"median": statistics.median(r["seconds"] for r in runs if r["job"] == job),
                                 "all": [r["seconds"] for r in runs if r["job"] == job]} for job in LIVE}
    _report_live(out)
    return out


def _report_live(out: dict) -> None:
    print("\nFrom live state, inside the job that holds it (the route: ckptfs.save, then unshard):\n")
    print(f"| ranks | {' | '.join(LIVE)} | export_hf / unshard | export_hf / floor |")
    print(f"|---|{'---|' * (len(LIVE) + 2)}")
    for world, row in out.items():
        m = {job: row[job]["median"] for job in LIVE}
        cells = " | ".join(f"{m[j]:.2f} ({' '.join(f'{x:.2f}' for x in row[j]['all'])})" for j in LIVE)
        print(f"| {world} | {cells} | {m[LIVE[0]] / m[LIVE[2]]:.2f}x | {m[LIVE[0]] / m[LIVE[3]]:.2f}x |")


def _jobs(arg: str) -> list[str]:
    picked = [SHORT[j.strip()] for j in arg.split(",") if j.strip()]
    return [j for j in JOBS if j in picked]


def main(argv: list[str] | None = None) -> int:
    from ckptfs.testing.ranks import run_ranks

    ap = argparse.ArgumentParser(prog="python -m bench.hf_export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1500)
    ap.add_argument("--tensor-mb", type=float, default=32)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--jobs", default=",".join(SHORT), help=f"some of {', '.join(SHORT)}")
    ap.add_argument("--phases", action="store_true", help="print unshard's phases per rank")
    ap.add_argument("--live-reps", type=int, default=3,
                    help="repetitions of the live export against the checkpoint route inside "
                         "one job holding the state (0: none)")
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-hf")
    ap.add_argument("--results", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    jobs = _jobs(args.jobs)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    rows = max(2, int(args.tensor_mb * 1e6 / 4096) // 2 * 2)
    n = max(args.files, int(args.mb / args.tensor_mb))
    per_file = -(-n // args.files)
    tensor = rows * 4096
    run_ranks(2, _build, str(root), n, rows, per_file, timeout=1800)
    outputs = _Outputs(root)
    runs, loads = _run_all(root, jobs, args.reps, n, per_file, per_file * tensor, rows, outputs)
    same, same_dcp = outputs.verdicts()
    by = _medians(runs)
    ratios = _report(by, n, tensor, args.files, loads, args.phases)
    live = _run_live(root, args.live_reps, n, rows, per_file * tensor) if args.live_reps else None
    print(f"target per rank (largest tensor + 256 MiB): {(tensor + (256 << 20)) / 2**20:.0f} MiB; "
          f"ckptfs files the same bytes from 1 and 2 ranks and both routes: {same}; "
          f"same tensors as DCP's: {same_dcp}")
    doc = {"bench": "hf_export", "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()}-core, CPU",
           "cpus": os.cpu_count(), "load_average_before_each_rep": loads,
           "load_average_after": os.getloadavg(), "mb": n * tensor / 1e6, "tensor_bytes": tensor,
           "files": args.files, "reps": args.reps, "jobs": jobs, "runs": runs,
           "median_seconds": {f"{j} / {w}": v["seconds"] for (j, w), v in by.items()},
           "ratios": ratios, "same_bytes_1_vs_2_ranks": same, "same_tensors_as_dcp": same_dcp,
           "live_in_one_job": live}
    Path(args.results).mkdir(parents=True, exist_ok=True)
    Path(args.results, f"hf_export-{int(doc['mb'])}mb.json").write_text(json.dumps(doc, indent=2) + "\n")
    shutil.rmtree(root)
    return 0 if same is not False and same_dcp is not False else 1


if __name__ == "__main__":
    sys.exit(main())
