"""``python -m bench.save_phases``: where the time of a save goes, phase by phase, for ckptfs
and DCP with the same clock.

A state of mid-size row-sharded DTensors (``bench.synthetic.mid_specs``: 12-16 MiB tensors) is
saved on 1 and 2 spawned gloo ranks by ckptfs (defaults), ckptfs with ``fsync=False``, and DCP
(``FileSystemWriter(sync_files=True)``), alternating, with and without dropping the page cache
first (without: the file system is synced first, the page cache kept). While each save runs,
the functions of each phase are wrapped with ``time.perf_counter`` timers (a bench-only patch,
removed after the save; the library has no tracing code): stage (describe and agree, plan,
take the bytes), the save lock, each file's write (``writev``,
write-back requests, ``fsync``), the checksums of chunks and of whole files, the index build and
the commit; for DCP its planner steps, the plan's reduce-scatter, each item's serialisation and
write, ``fsync``, and ``finish``. Per phase: the seconds the phase's calls covered (the union of
their intervals, so threads running at once count once) and the calls, median over ``--reps``,
per rank. Results go to ``bench/results/save_phases.json`` under ``--label`` (a run with another
label keeps the earlier ones: the before and after of a change side by side).

Beside them, the save's physical floor (``fsync floor``): the files of ckptfs's last checkpoint
in that world (paths and sizes) written anew with plain ``os.write`` calls of each rank's own
local bytes and one ``fsync`` per file (``bench.floors.write_same``), timed the same way; the
report prints ckptfs's time over it. Before every timed save the host's dirty pages are
written first (``bench.worker.settle``).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench import floors
from bench.synthetic import make_state, mid_specs
from bench.worker import drop_caches, settle

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results" / "save_phases.json"
LIBS = ("ckptfs", "ckptfs fsync=False", "DCP", FLOOR := "fsync floor")


class Trace:
    """Intervals (phase, start, end) recorded from any thread while a save runs."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def add(self, name: str, t0: float, t1: float) -> None:
        with self._lock:
            self.spans.append((name, t0, t1))

    def summary(self, start: float) -> dict[str, dict[str, float]]:
        """Per phase: seconds covered (union of intervals), calls, first start and last end
        relative to ``start``."""
        by: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for name, t0, t1 in self.spans:
            by[name].append((t0, t1))
        out = {}
        for name, spans in by.items():
            spans.sort()
            covered, end = 0.0, float("-inf")
            for t0, t1 in spans:
                if t0 > end:
                    covered += t1 - t0
                    end = t1
                elif t1 > end:
                    covered += t1 - end
                    end = t1
            out[name] = {"seconds": covered, "calls": len(spans),
                         "from": spans[0][0] - start, "to": max(t for _, t in spans) - start}
        return out


class _TimedOs:
    """A module's ``os`` with ``fsync`` timed."""

    def __init__(self, real: Any, trace: Trace) -> None:
        self._real, self._trace = real, trace

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def fsync(self, fd: int) -> None:
        t0 = time.perf_counter()
        try:
            self._real.fsync(fd)
        finally:
            self._trace.add("io: fsync", t0, time.perf_counter())


def _timed(fn: Any, name: str, trace: Trace) -> Any:
    if inspect.iscoroutinefunction(fn):
        async def acall(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                trace.add(name, t0, time.perf_counter())
        return acall

    def call(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            trace.add(name, t0, time.perf_counter())
    return call


def ckptfs_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, phase) of every function timed in a ckptfs save."""
    import ckptfs.engine.save.commit as commit
    import ckptfs.engine.save.pipeline as save  # where the phases are composed
    import ckptfs.engine.save.stage as stage
    import ckptfs.engine.save.write as write
    import ckptfs.io.local_store as local

    return [
        (save, "stage", "stage"),
        (stage, "_describe_and_agree", "stage: describe + agree"),
        (stage, "_plan", "stage: plan"),
        (stage, "_index_content", "stage: index content"),
        (stage, "_take_agreed", "stage: take bytes"),
        (save, "open_store", "open store"),
        _claim_point(save, commit),
        (commit.Renewal, "stop", "lock: renewal stop"),
        (save, "write", "write phase"),
        (write, "write_rank", "write: this rank's files"),
        (write, "write_files", "write: files in flight"),
        (write, "crcs_of", "crc: chunks"),
        *((checked, "crc_of", "crc: chunks, in the writer threads") for checked in _checked_parts()),
        (write, "replica_sums", "crc: replicas"),
        (write, "file_sums", "crc: whole files"),
        (local.LocalStore, "_write_file", "io: one file, open to close"),
        (local, "_write_all", "io: writev"),
        (local, "_start_writeback", "io: write-back request"),
        (save, "commit", "commit phase"),
        (commit, "build_index", "commit: index build"),
        (commit, "commit_index", "commit: finalize + index write + unlock"),
        (commit, "release", "lock: release"),
        (local.LocalStore, "put_if_absent", "io: put_if_absent"),
    ]


def _claim_point(save: Any, commit: Any) -> tuple[Any, str, str]:
    """The claim's coroutine, awaited by the pipeline in the trip that opens the store (older
    versions of ckptfs: ``claim_target``, its own step)."""
    if hasattr(save, "take_claim"):
        return (save, "take_claim", "lock: take + check target")
    return (commit, "claim_target", "lock: take + check target")


def _checked_parts() -> list[Any]:
    """engine/save/checked_parts.py, where this version of ckptfs has it (a before/after comparison
    runs this bench on older code too)."""
    try:
        import ckptfs.engine.save.checked_parts as checked
    except ImportError:
        return []
    return [checked]


def dcp_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, phase) of every function timed in a DCP save."""
    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.utils import _DistWrapper

    return [
        (DefaultSavePlanner, "create_local_plan", "stage: local plan"),
        (DefaultSavePlanner, "create_global_plan", "stage: global plan (coordinator)"),
        (_DistWrapper, "reduce_scatter", "stage: plan agreement (reduce_scatter)"),
        (DefaultSavePlanner, "finish_plan", "stage: finish plan"),
        (fs._FileSystemWriter, "write_data", "write phase"),
        (fs, "_write_item", "io: one item, serialise + write"),
        (fs._FileSystemWriter, "finish", "commit: metadata write"),
        (_DistWrapper, "all_reduce", "write + commit (all_reduce)"),
    ]


@contextlib.contextmanager
def traced(points: list[tuple[Any, str, str]], os_modules: list[Any], trace: Trace) -> Iterator[None]:
    """The functions of ``points`` timed into ``trace`` (and ``fsync`` in ``os_modules``)."""
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in points]
    saved += [(m, "os", m.os) for m in os_modules]
    try:
        for owner, attr, name in points:
            setattr(owner, attr, _timed(getattr(owner, attr), name, trace))
        for m in os_modules:
            m.os = _TimedOs(m.os, trace)
        yield
    finally:
        for owner, attr, orig in reversed(saved):
            setattr(owner, attr, orig)


def store_options(lib: str) -> Any:
    """The ``StoreOptions`` a library name gives: "ckptfs" the defaults, "ckptfs fsync=False
    max_concurrency=2" those fields (ints or booleans)."""
    import ckptfs

    fields = dict(kv.split("=", 1) for kv in lib.split()[1:])
    return ckptfs.StoreOptions(**{k: v == "True" if v in ("True", "False") else int(v)
                                  for k, v in fields.items()})


def floor_points() -> list[tuple[Any, str, str]]:
    """(owner, attribute, phase) timed in the fsync floor's writes."""
    return [(floors, "_write_new", "io: one file, open to close")]


def floor_save(state: dict, path: str, layout: tuple[list[str], list[tuple[str, int]]]) -> None:
    """The fsync floor: the files of ``layout`` (ckptfs's checkpoint of this world) written
    anew with plain ``os.write`` calls of this rank's local bytes and one ``fsync`` per file,
    the files dealt over the ranks (``floors.write_same``)."""
    dirs, files = layout
    rank, world = dist.get_rank(), dist.get_world_size()
    local = [t.to_local() if hasattr(t, "to_local") else t for t in state.values()]
    floors.write_same(dirs, files[rank::world], path, local)


def do_save(lib: str, state: dict, path: str, backend: str,
            layout: tuple[list[str], list[tuple[str, int]]] | None = None) -> None:
    if lib == FLOOR:
        assert layout is not None
        floor_save(state, path, layout)
    elif lib.startswith("ckptfs"):
        import ckptfs

        name, _, version = backend.partition("-")  # name or name-version (zarr-2)
        ckptfs.save(state, path, backend=name, backend_version=int(version) if version else None,
                    store_options=store_options(lib))
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=True))


def _os_modules(lib: str) -> list[Any]:
    if lib == FLOOR:
        return [floors]
    if lib.startswith("ckptfs"):
        import ckptfs.io.local_store as local

        return [local]
    import torch.distributed.checkpoint.filesystem as fs

    return [fs]


def lib_path(root: str, world: int, lib: str) -> str:
    return os.path.join(root, f"w{world}-{lib.replace(' ', '_').replace('=', '')}")


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    specs = mid_specs(cfg["gb"])
    state = make_state(specs, rank, world, zeros=False)
    root = cfg["root"]
    small = make_state(mid_specs(0.0)[:1], rank, world, zeros=False)
    libs = cfg["libs"]
    for lib in libs:  # imports and first-call set-up, untimed
        if lib != FLOOR:
            path = os.path.join(root, f"warm-{world}-{lib.replace(' ', '_')}")
            do_save(lib, small, path, cfg["backend"])
        dist.barrier()
    for rep in range(-cfg["warmup"], cfg["reps"]):
        for drop in cfg["drops"]:
            order = libs if rep % 2 == 0 else libs[::-1]
            for lib in order:
                path = lib_path(root, world, lib)
                layout = None
                if lib == FLOOR:  # the files ckptfs wrote last in this world, if it has yet
                    source = lib_path(root, world, "ckptfs")
                    layout = floors.layout_of(source) if os.path.isdir(source) else None
                dist.barrier()  # every rank looked before anything is removed
                if lib == FLOOR and layout is None:
                    continue
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
                    if drop:
                        drop_caches()
                    settle()  # the page cache kept or not, no earlier write-back charged
                dist.barrier()
                trace = Trace()
                points = {FLOOR: floor_points}.get(
                    lib, ckptfs_points if lib.startswith("ckptfs") else dcp_points)()
                with traced(points, _os_modules(lib), trace):
                    t0 = time.perf_counter()
                    do_save(lib, state, path, cfg["backend"], layout)
                    t1 = time.perf_counter()
                    dist.barrier()
                    t2 = time.perf_counter()
                phases = trace.summary(t0)
                phases["total (this rank)"] = {"seconds": t1 - t0, "calls": 1, "from": 0.0, "to": t1 - t0}
                got: list[Any] = [None] * world
                dist.all_gather_object(got, {"rank": rank, "phases": phases, "wall": t2 - t0})
                if rank == 0 and rep >= 0:
                    rec = {"world": world, "lib": lib, "drop": drop, "rep": rep,
                           "seconds": max(g["wall"] for g in got),
                           "ranks": [g["phases"] for g in got]}
                    with open(cfg["out"], "a") as f:
                        f.write(json.dumps(rec) + "\n")
                    print(f"  world {world} {'dropped' if drop else 'warm   '} {lib:<20} "
                          f"{rec['seconds']:.3f} s", flush=True)
                dist.barrier()


def summarize(records: list[dict[str, Any]], libs: list[str]) -> list[dict[str, Any]]:
    """Per (world, cache, lib): the median save time and, per rank and phase, the median seconds
    covered and calls."""
    groups: dict[tuple[int, bool, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["world"], r["drop"], r["lib"])].append(r)
    rows = []
    def order(g: tuple) -> tuple:
        (world, drop, lib), _ = g
        return world, not drop, libs.index(lib)

    for (world, drop, lib), rs in sorted(groups.items(), key=order):
        ranks = []
        for rank in range(world):
            got = [r["ranks"][rank] for r in rs]
            names = sorted({n for g in got for n in g},
                           key=lambda n: statistics.median(g.get(n, {"from": 1e9})["from"] for g in got))
            ranks.append({n: {"seconds": statistics.median(g.get(n, {"seconds": 0.0})["seconds"]
                                                           for g in got),
                              "calls": max(g.get(n, {"calls": 0})["calls"] for g in got)}
                          for n in names})
        rows.append({"world": world, "page_cache": "dropped" if drop else "warm", "lib": lib,
                     "seconds": statistics.median(r["seconds"] for r in rs),
                     "all_seconds": [round(r["seconds"], 4) for r in rs], "ranks": ranks})
    return rows


def render(rows: list[dict[str, Any]], label: str) -> str:
    lines = [f"save phases [{label}] (seconds covered by each phase's calls, median; rank 0 | rank 1)"]
    for row in rows:
        lines.append(f"\n{row['world']} rank(s), page cache {row['page_cache']}, {row['lib']}: "
                     f"{row['seconds']:.3f} s (runs {', '.join(f'{s:.3f}' for s in row['all_seconds'])})")
        names = list(row["ranks"][0])
        for n in (x for r in row["ranks"][1:] for x in r):
            if n not in names:
                names.append(n)
        for n in names:
            cells = []
            for r in row["ranks"]:
                p = r.get(n)
                cells.append(f"{p['seconds']:7.3f} s x{p['calls']:<4}" if p else f"{'-':>15}")
            lines.append(f"  {n:<42} " + " | ".join(cells))
    return "\n".join(lines + floor_lines(rows))


def floor_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each library's median time over the fsync floor's, per world size and page cache."""
    by = {(r["world"], r["page_cache"], r["lib"]): r["seconds"] for r in rows}
    out = []
    for (world, cache, lib), secs in by.items():
        floor = by.get((world, cache, FLOOR))
        if floor and lib != FLOOR:
            out.append(f"  {world} rank(s), page cache {cache}: {lib} / fsync floor = "
                       f"{secs:.3f} / {floor:.3f} s = {secs / floor:.2f}x")
    return ["", "time over the fsync floor (the same files, plain os.write + one fsync per file):",
            *out] if out else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.save_phases", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=0.4, help="state size in GB (1e9 bytes), default 0.4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--cache", default="dropped,warm", help="page cache states: dropped, warm or both")
    p.add_argument("--backend", default="safetensors_chunks", help="name or name-version (zarr-2)")
    p.add_argument("--libs", default=",".join(LIBS),
                   help="comma list: DCP, ckptfs, ckptfs with StoreOptions fields ('ckptfs fsync=False')")
    p.add_argument("--label", default="current", help="the key of this run in the results file")
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--dir", default=None)
    args = p.parse_args(argv)
    from ckptfs.testing.ranks import run_ranks

    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    drops = [c.strip() == "dropped" for c in args.cache.split(",") if c.strip()]
    if any(drops) and not drop_caches():
        sys.exit("cannot drop the page cache (needs root); pass --cache warm")
    root = args.dir or tempfile.mkdtemp(prefix="ckptfs-phases-")
    out = os.path.join(root, "records.jsonl")
    specs = mid_specs(args.gb)
    nbytes = sum(s.nbytes for s in specs)
    print(f"bench.save_phases: {len(specs)} tensors, {nbytes / 1e9:.3f} GB, backend {args.backend}, "
          f"{args.reps} reps + {args.warmup} warm-up, libraries alternate", flush=True)
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            cfg = {"libs": libs, "gb": args.gb, "reps": args.reps, "warmup": args.warmup, "drops": drops,
                   "backend": args.backend, "root": root, "out": out}
            run_ranks(world, rank_main, cfg, timeout=1200)
        records = [json.loads(line) for line in Path(out).read_text().splitlines()]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    rows = summarize(records, libs)
    report = render(rows, args.label)
    print(report)
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[args.label] = {
        "config": {"gb": args.gb, "state_bytes": nbytes, "tensors": len(specs), "reps": args.reps,
                   "warmup": args.warmup, "backend": args.backend, "libs": libs},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                 "loadavg": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "rows": rows, "report": report}
    path.write_text(json.dumps(old, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
