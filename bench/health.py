"""Checkpoint health costs, one process, every number from the same run:

- ``check_finite``: the same save of ``--gb`` GB (float32 tensors of ``--tensor-mb`` MB) to
  the page cache (``StoreOptions(fsync=False)``: the disk's own time, and its noise, left out)
  with and without ``check_finite=True``, alternating, ``--reps`` times each, to a fresh
  target (the check folded into the write) and over a committed checkpoint (the check in a
  pass of its own first), to the page cache with one file written at a time (a core left to
  the checksum thread), and to a fresh target with the default options (every file fsynced:
  the save a training loop makes, its disk's time in it); the cost is the ratio of the medians
  (and of the fastest runs, of the lower quartiles, and the median of each run against the one
  beside it; the runs go without, with, with, without, ...), and
  the check alone (engine/save/health.py's ``non_finite`` over the same tensors) beside it. What
  bounds it: the CPU time of the check inside the checksum thread (every tensor streamed
  through engine/save/checked_parts.py's ``CheckedPart`` with no write, its crc32c alone and with the
  test of each block before it, alternating) against the save's CPU time, the user CPU time the
  save gains with the check (the kernel's time, and its slow spells, left out), and the cores
  the save keeps busy (its CPU time over its wall time): a save that keeps every core busy pays
  for the check's CPU time in wall time.
- ``diff`` from checksums: two saves of the same state in the same layout; ``ckptfs.diff``
  decides "equal" from the chunk checksums (no tensor byte read).
- ``diff`` across layouts: the safetensors_chunks checkpoint against a zarr-3 one of the same
  state in chunks of a quarter of a tensor (different chunk boxes: streamed), against the
  cold-read floor taken in the same run (bench/floors.py: every file of both checkpoints read
  whole with plain calls, page cache dropped first where the machine allows it), and its peak
  resident memory against ``DiffReport.memory_bound``.

    python -m bench.health [--gb 1.5] [--reps 3] [--dir DIR]

Results: bench/results/health-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptfs
from bench.floors import files_under, read_files, scratch_for
from bench.worker import drop_caches
from ckptfs.engine.save.checked_parts import CheckedPart
from ckptfs.engine.save.health import non_finite, slice_test
from ckptfs.io import StoreOptions
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.boxes import full_box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.tensor_bytes import tensor_bytes


def make_state(gb: float, tensor_mb: int) -> dict[str, torch.Tensor]:
    """float32 tensors of ``tensor_mb`` MiB (rows of 1024) holding ``gb`` GB in all."""
    rows = max(1, int(gb * 1e9) // 4096)
    per = max(1, tensor_mb * (1 << 20) // 4096)
    return {f"layers.{i}.weight": torch.empty(min(per, rows - start), 1024).uniform_(-1, 1)
            for i, start in enumerate(range(0, rows, per))}


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_seconds() -> float:
    """User and system CPU seconds of this process (every thread) so far: a cost that other
    jobs on a shared machine disturb less than they disturb the wall clock."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def user_seconds() -> float:
    """User CPU seconds of this process so far: the check's own CPU time shows here, apart
    from the kernel's time copying to storage (and its slow spells: paging memory in)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def measure_peak(a: str, b: str) -> None:
    """In a fresh process (``--peak A B``): a small diff first (imports, I/O loop), then the
    whole diff; prints its peak resident bytes above the resident size before it, and its
    bound. A process that diffed before keeps freed memory mapped: its peak says nothing."""
    key = next(iter(ckptfs.load_metadata(a).tensors))
    ckptfs.diff(a, b, keys=[key], buffer_bytes=1 << 20)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss("VmRSS")
    report = ckptfs.diff(a, b)
    print(json.dumps({"peak": _rss("VmHWM") - before, "bound": report.memory_bound}))


def peak_in_subprocess(a: str, b: str) -> dict[str, int]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "bench.health", "--peak", a, b], env=env,
                         capture_output=True, text=True, check=True, cwd=here)
    return json.loads(out.stdout.strip().splitlines()[-1])


def fold_cpu(state: dict[str, torch.Tensor], test: bool) -> float:
    """CPU seconds of this process while every tensor's bytes stream through the checksum
    thread of a write (``CheckedPart``) with nothing written: the crc32c of each slice alone,
    or with the check's test of each block right before its checksum (``test``)."""
    c0 = cpu_seconds()
    for t in state.values():
        part = CheckedPart(tensor_bytes(t), test=slice_test(t) if test else None)
        for _ in part.stream():
            pass
        assert not part.suspect
    return cpu_seconds() - c0


def fold_cost(state: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
    """The check's CPU time inside the checksum thread: medians of ``fold_cpu`` with and
    without the test, alternating, over ``reps`` runs of each."""
    runs: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * reps):
        runs[i % 2 == 1].append(fold_cpu(state, i % 2 == 1))
    crc, both = statistics.median(runs[False]), statistics.median(runs[True])
    nbytes = sum(t.nbytes for t in state.values())
    return {"fold_crc_cpu_s": crc, "fold_check_cpu_s": both - crc,
            "fold_check_gbps": nbytes / max(both - crc, 1e-9) / 1e9}


#: the saves ``bench_check_finite`` alternates, with their store options: to a fresh target
#: and over a committed checkpoint to the page cache; to the page cache with one file written
#: at a time (a core left to the checksum thread, which then runs the test beside the write
#: instead of taking CPU time from a second writer); and to a fresh target with the default
#: options (each file fsynced: the save a training loop makes)
CASES: dict[str, StoreOptions | None] = {
    "fresh": StoreOptions(fsync=False), "replacing": StoreOptions(fsync=False),
    "one-writer": StoreOptions(fsync=False, max_concurrency=1), "durable": None}


Runs = dict[tuple[str, bool], list[float]]  #: seconds per (case, with the check)


def alternate_saves(state: dict, root: str, reps: int) -> tuple[Runs, Runs, Runs]:
    """Wall, CPU and user CPU seconds of each ``CASES`` save without and with the check,
    ``reps`` times each after one warm-up round of each (a fresh target's folder removed and
    every dirty page written back first, untimed), in the order without, with, with, without,
    ... (``check_order``): a drift of the machine's speed during the run weighs on both alike."""
    times: Runs = {}
    cpu: Runs = {}
    user: Runs = {}
    for i, check in enumerate(check_order(2 * reps + 2)):  # the first two rounds warm up
        for case, options in CASES.items():
            url = os.path.join(root, f"cf-{case}-{check}")
            if case != "replacing":
                shutil.rmtree(url, ignore_errors=True)
            os.sync()  # no write-back of an earlier save's pages runs during this one
            c0, u0, t0 = cpu_seconds(), user_seconds(), time.perf_counter()
            ckptfs.save(state, url, overwrite=case == "replacing", check_finite=check,
                        store_options=options)
            if i >= 2:
                times.setdefault((case, check), []).append(time.perf_counter() - t0)
                cpu.setdefault((case, check), []).append(cpu_seconds() - c0)
                user.setdefault((case, check), []).append(user_seconds() - u0)
    return times, cpu, user


def check_order(rounds: int) -> list[bool]:
    """Without (False) and with (True) the check, ``rounds`` in all, in pairs of alternating
    order after the first (False, True): F T T F F T T F ..."""
    return [(i % 2 == 1) != (i // 2 % 2 == 1) for i in range(rounds)]


def paired_pct(on: list[float], off: list[float]) -> float:
    """Median over the runs of each run with the check against the run without it beside it
    (the same load), in percent."""
    return 100 * (statistics.median(a / b for a, b in zip(on, off, strict=True)) - 1)


def quartile_pct(on: list[float], off: list[float]) -> float:
    """The fastest quarter's edge (the lower quartile) of the runs with the check against
    that of the runs without it, in percent: the machine's slow spells (another job, the host
    paging memory in) lengthen some runs of either kind and never shorten one, so the lower
    quartile keeps the save's own time with less of their noise than the median."""
    return 100 * (lower_quartile(on) / lower_quartile(off) - 1)


def lower_quartile(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=4, method="inclusive")[0] if len(xs) > 1 else xs[0]


def bench_check_finite(state: dict, root: str, reps: int) -> dict[str, Any]:
    """Alternating saves with and without the check (``alternate_saves``, each of ``CASES``):
    to a fresh target the check runs while the files are written; over a committed checkpoint
    (``overwrite=True``) before the replaced checkpoint is touched, in a pass of its own."""
    times, cpu, user = alternate_saves(state, root, reps)
    chunks = [ChunkData(k, from_name("float32", k), tuple(t.shape), full_box(t.shape), t)
              for k, t in state.items()]
    alone = [timed(lambda: non_finite(chunks)) for _ in range(reps)]
    cpu_med = {k: statistics.median(v) for k, v in cpu.items()}
    off = statistics.median(times[("fresh", False)])
    fold = fold_cost(state, reps)
    costs = {k: v for case in CASES for k, v in case_costs(times, case).items()}
    return {**fold, **costs,
            "fold_check_cpu_pct": 100 * fold["fold_check_cpu_s"] / cpu_med[("fresh", False)],
            "save_cores_busy": cpu_med[("fresh", False)] / off, "cores": os.cpu_count(),
            "save_check_finite_s": statistics.median(times[("fresh", True)]),
            "cpu_s": cpu_med[("fresh", False)],
            "cpu_cost_pct": 100 * (cpu_med[("fresh", True)] / cpu_med[("fresh", False)] - 1),
            "replacing_cpu_cost_pct": 100 * (cpu_med[("replacing", True)]
                                             / cpu_med[("replacing", False)] - 1),
            "user_cpu_s": statistics.median(user[("fresh", False)]),
            "user_cpu_added_s": statistics.median(user[("fresh", True)])
            - statistics.median(user[("fresh", False)]),
            "check_alone_s": statistics.median(alone),
            "check_alone_pct": 100 * statistics.median(alone) / off,
            "load_average": os.getloadavg(),
            "runs": {f"{case}-{'on' if check else 'off'}": v for (case, check), v in times.items()}}


def case_costs(times: Runs, case: str) -> dict[str, float]:
    """One case's median save without the check and the check's cost, four ways: medians,
    fastest runs, lower quartiles, paired runs (keys prefixed by the case but for "fresh")."""
    on, off = times[(case, True)], times[(case, False)]
    prefix = "" if case == "fresh" else case.replace("-", "_") + "_"
    return {f"{prefix}save_s": statistics.median(off),
            f"{prefix}cost_pct": 100 * (statistics.median(on) / statistics.median(off) - 1),
            f"{prefix}cost_pct_fastest": 100 * (min(on) / min(off) - 1),
            f"{prefix}cost_pct_quartile": quartile_pct(on, off),
            f"{prefix}cost_pct_paired": paired_pct(on, off)}


def cold_floor(paths: list[str]) -> tuple[float, bool]:
    """Seconds to read every file whole (plain calls), after dropping the page cache."""
    scratch: list[torch.Tensor] = []
    bufs = scratch_for(paths, scratch)
    dropped = drop_caches()
    return timed(lambda: read_files(paths, bufs)), dropped


def bench_diff(state: dict, root: str, reps: int) -> dict[str, Any]:
    a, same, other = (os.path.join(root, n) for n in ("a", "a-same", "b-zarr3"))
    ckptfs.save(state, a)
    ckptfs.save(state, same)
    # zarr chunks a quarter of a tensor: chunk boxes differ, so the diff streams both sides
    quarter = max(t.nbytes for t in state.values()) // 4
    ckptfs.save(state, other, backend="zarr", backend_version=3,
                backend_options={"max_chunk_bytes": max(quarter, 4096)})
    by_sums = [timed(lambda: ckptfs.diff(a, same)) for _ in range(reps)]
    report = ckptfs.diff(a, same)
    assert report.equal and report.bytes_read == 0
    paths = files_under(a) + files_under(other)
    nbytes = sum(os.path.getsize(p) for p in paths)
    runs = []
    for _ in range(reps):
        floor, dropped = cold_floor(paths)
        drop_caches()
        t0 = time.perf_counter()
        streamed = ckptfs.diff(a, other)
        runs.append({"floor_s": floor, "diff_s": time.perf_counter() - t0,
                     "caches_dropped": dropped})
        assert streamed.equal and streamed.bytes_read == 2 * sum(t.nbytes for t in state.values())
    floor_s = statistics.median(r["floor_s"] for r in runs)
    diff_s = statistics.median(r["diff_s"] for r in runs)
    return {"from_checksums_s": statistics.median(by_sums), "files_bytes": nbytes,
            "floor_s": floor_s, "streamed_s": diff_s, "fraction_of_floor": floor_s / diff_s,
            **{f"{k}_bytes" if k == "peak" else "memory_bound_subprocess": v
               for k, v in peak_in_subprocess(a, other).items()},
            "memory_bound": streamed.memory_bound,
            "caches_dropped": all(r["caches_dropped"] for r in runs), "runs": runs}


def report(result: dict[str, Any]) -> None:
    """Print what ``main`` measured."""
    cf, d = result.get("check_finite"), result.get("diff")
    if cf is not None:
        print(f"check_finite: page-cache save {cf['save_s']:.3f} s, with the check "
              f"{cf['save_check_finite_s']:.3f} s ({cf['cost_pct']:+.1f}%; fastest runs "
              f"{cf['cost_pct_fastest']:+.1f}%; lower quartiles "
              f"{cf['cost_pct_quartile']:+.1f}%; median of paired runs "
              f"{cf['cost_pct_paired']:+.1f}%); the check alone {cf['check_alone_s']:.3f} s "
              f"({cf['check_alone_pct']:.1f}% of the save); replacing a checkpoint "
              f"{cf['replacing_cost_pct']:+.1f}%; CPU time {cf['cpu_s']:.3f} s, with the "
              f"check {cf['cpu_cost_pct']:+.1f}% (replacing "
              f"{cf['replacing_cpu_cost_pct']:+.1f}%); user CPU time {cf['user_cpu_s']:.3f} s, "
              f"with the check {cf['user_cpu_added_s']:+.3f} s; load average "
              f"{' '.join(f'{x:.1f}' for x in cf['load_average'])}")
        for case, what in (("durable", "default (fsynced) save"),
                           ("one_writer", "page-cache save, one file at a time")):
            print(f"check_finite: {what} {cf[case + '_save_s']:.3f} s, with the check "
                  f"{cf[case + '_cost_pct']:+.1f}% (lower quartiles "
                  f"{cf[case + '_cost_pct_quartile']:+.1f}%; median of paired runs "
                  f"{cf[case + '_cost_pct_paired']:+.1f}%)")
        print(f"check_finite's bound: the test in the checksum thread costs "
              f"{cf['fold_check_cpu_s']:.3f} s of CPU ({cf['fold_check_gbps']:.0f} GB/s; the "
              f"crc32c alone {cf['fold_crc_cpu_s']:.3f} s), {cf['fold_check_cpu_pct']:.1f}% of "
              f"the save's CPU time; the save keeps {cf['save_cores_busy']:.2f} of "
              f"{cf['cores']} cores busy")
    if d is not None:
        print(f"diff from checksums: {d['from_checksums_s']:.3f} s")
        print(f"diff across layouts: {d['streamed_s']:.3f} s, cold-read floor "
              f"{d['floor_s']:.3f} s ({100 * d['fraction_of_floor']:.0f}% of the floor's rate; "
              f"caches dropped: {d['caches_dropped']}); peak {d['peak_bytes'] / 2**20:.1f} "
              f"MiB, bound {d['memory_bound'] / 2**20:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.health", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.5, help="checkpoint size in GB (default 1.5)")
    ap.add_argument("--tensor-mb", type=int, default=64, help="MiB per tensor (default 64)")
    ap.add_argument("--reps", type=int, default=3, help="runs of each case (medians)")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/health-*.json)")
    ap.add_argument("--only", choices=("check_finite", "diff"), default=None,
                    help="measure one of the two (default: both)")
    ap.add_argument("--peak", nargs=2, metavar=("A", "B"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peak:
        measure_peak(*args.peak)
        return 0
    state = make_state(args.gb, args.tensor_mb)
    root = tempfile.mkdtemp(prefix="ckptfs-health-", dir=args.dir)
    result: dict[str, Any] = {"gb": args.gb, "reps": args.reps,
                              "threads": torch.get_num_threads()}
    try:
        if args.only in (None, "check_finite"):
            result["check_finite"] = bench_check_finite(state, root, args.reps)
        if args.only in (None, "diff"):
            result["diff"] = bench_diff(state, root, args.reps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(result)
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"health-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
