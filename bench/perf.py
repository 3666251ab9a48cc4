"""``python -m bench.perf`` (``make bench-perf``): every performance case against its physical floor
and against every peer, in one run, one table.

Cases (synthetic fp32 + bf16 state, row-sharded DTensors, ``bench.synthetic``; ``--gb``):

- W1 save and load at 1 and 2 ranks; W2 resharded loads 2->1 and 2->3 (a split that matches
  neither saved shard); W3 a 2->2 load of 10% of the keys (every tenth); W4 save and load of
  ``--small`` (20,000) small fp32 tensors on 1 rank; W5 the peak extra RSS of every W1 sync save,
  per rank; W6 warm-cache loads 1->1 and 2->2 (the same load again right after the cold one);
  W7 the W1 saves again without dropping the page cache (what a training job's next save meets);
  W8 a state of mid-size tensors (``--mid-gb``; 12-16 MiB each, ``bench.synthetic.mid_specs``)
  saved with the page cache dropped and warm, and loaded cold and warm, at 1 and 2 ranks; W9 a
  few large matrices (``--large-gb``; fp32 and bf16 (4096, 8192), ``bench.synthetic.large_specs``)
  saved with the page cache warm by 2 ranks at once, each writing one large chunk per tensor.
- Beside every ckptfs save from a dropped page cache (W1, W8), the same save with
  ``fsync=False`` (column ``x no fsync`` = that time / the save's time): what durability costs;
  and its physical floor: the same files (paths and sizes) written anew with plain ``os.write``
  calls of the ranks' own bytes and one ``fsync`` per file, from the same page-cache state
  (``floors.write_same``; column ``x fsync floor`` = the save's time / the floor's time), so a
  gap to ``fsync=False`` that the disk itself imposes is told from one the library adds.
- Every cold load, and every save but the warm ones (W7, W8 warm, W9), runs after the page cache was dropped
  (``bench.worker.drop_caches``): measured on a 2-vCPU cloud VM, a page cache holding 8 GB of clean pages
  slowed a 1.1 GB save from 1.5-1.7 s to 2.6 s, so saves start from the same state too. Every
  load is verified bit-exact (the command fails if one is not). Medians over ``--reps``.
- W5: each rank resets its peak RSS (``/proc/self/clear_refs`` = 5 sets VmHWM to the current RSS)
  right before the save and reads ``VmHWM`` right after it; peak extra RSS = VmHWM - VmRSS before.
  The bound is 256 MiB + 10% of the rank's local state.

Floors (``bench.floors``) are measured in the same run, by the main venv's world of each size,
at the start of each repetition: write + fsync, cold read, warm read and ``copy_`` of the same
local shards (same ranks, same pieces), with ``--floor-threads`` files per rank; the floor of a
kind is its best rate over those thread counts. A case's fraction of floor is its rate over the
floor of its kind at the world size that ran it: saves -> write, cold loads -> cold read, warm
loads -> warm read.

Beside each cold W1/W2 load of every library (alternately right before and right after it) the
same checkpoint's files are read whole, cold, a thread per file, files dealt over the ranks
(``floors.read_whole``): column ``of own files`` = that time / the load's time. The targets use
the floors above; this column separates what the load costs from where its bytes lie on the disk
(files written moments before read back faster on a 2-vCPU cloud VM than older ones). W4's checkpoints
(up to 40,000 small files) get the same column from floors of their own files with plain calls,
dealt over ``floors.FILE_THREADS`` threads: beside each W4 load the files read whole, cold
(``floors.read_files``); right after each W4 save the same directories and files created anew,
each fsynced (``floors.write_like``). The W4 target lines print the ratio to DCP a library
would reach if it took only that long: what the layout itself allows on this disk.

Libraries: ckptfs with every writable built-in backend (``--backends``) and DCP run in this
venv; OLMo-core and Megatron-Core (default ``torch_dist`` strategy, and wrapped in
``FullyParallel{Save,Load}StrategyWrapper``) run in venvs of their own (``--olmo-venv``,
``--megatron-venv``; ``make bench-venvs``), from this repository (PYTHONPATH). A peer whose venv
is missing or cannot import the library is skipped with a printed line.

Ordering: one repetition runs world 2 (it saves the checkpoints the 2->1, 2->3 and 10% loads
read), then world 1, then world 3. In each world, each venv ("runner") spawns its own world of
gloo ranks in turn (``bench.perf_world``; the main venv's in this process); the order of the
runners and of the libraries within a runner reverses every repetition. So libraries alternate
within a venv at every step, and across venvs every repetition. ``--warmup`` unrecorded
repetitions come first (the first writes into never-touched memory cost more on a VM).

Output: the table (time, GB/s, fraction of floor, ratio to each peer = peer time / this time),
the floors, W5, the performance targets with met / NOT met, a JSON file and a plot (matplotlib,
the ``bench`` extra; skipped with a message without it) in ``bench/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import ckptfs
from bench.run import exit_code, importable_backends, table
from bench.synthetic import state_specs
from bench.worker import drop_caches

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PEER_NAMES = ("DCP", "OLMo-core", "Megatron", "Megatron-FP")
MIB = 2**20
TARGETS = {"cold_floor": 0.85, "save_floor": 0.95, "nofsync": 1.10, "w3_dcp": 5.0, "w4_dcp": 3.0,
           "rss_base": 256 * MIB,
           "rss_frac": 0.10, "warm_floor": 0.50}
NOTES = {"OLMo-core": "no fsync (library default)",
         "Megatron": "CUDA calls neutralised (CPU-only torch)",
         "Megatron-FP": "CUDA calls neutralised (CPU-only torch)"}


@dataclass(frozen=True)
class Runner:
    """One venv's share of the libraries: its python (None: this process) and library names."""

    name: str
    python: str | None
    libs: tuple[str, ...]
    floors: bool = False


def peer_runner(name: str, venv: str | None, module: str) -> Runner | None:
    """The runner of a peer library in its venv, or None (with a printed line) where it cannot run."""
    if not venv:
        print(f"skip {name}: no venv given")
        return None
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        print(f"skip {name}: no venv at {venv} (make bench-venvs builds it)")
        return None
    probe = subprocess.run([python, "-c", f"import {module}, ckptfs"], env=_env(), capture_output=True,
                           text=True)
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        print(f"skip {name}: {python} cannot import {module} and ckptfs ({last})")
        return None
    return Runner(name, python, (name,))


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "PYTHONWARNINGS": "ignore"}


def run_world(runner: Runner, cfg: dict[str, Any]) -> None:
    if runner.python is None:
        from bench.perf_world import rank_main
        from ckptfs.testing.ranks import run_ranks

        run_ranks(cfg["world"], rank_main, cfg, timeout=cfg["timeout"])
        return
    path = os.path.join(cfg["root"], f"cfg-{runner.name}.json")
    Path(path).write_text(json.dumps(cfg))
    subprocess.run([runner.python, "-m", "bench.perf_world", path], env=_env(), check=True, cwd=REPO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.5, help="state size in GB (1e9 bytes), default 1.5")
    p.add_argument("--reps", type=int, default=3, help="recorded repetitions (medians), default 3")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded repetitions first, default 1")
    p.add_argument("--backends", default="all", help="ckptfs backends: 'all' writable built-ins (default) "
                   "or a comma list of name or name-version")
    p.add_argument("--peers", default="DCP,OLMo-core,Megatron",
                   help="comma list of DCP, OLMo-core, Megatron (both strategies); default all")
    p.add_argument("--olmo-venv", default=os.environ.get("OLMO_VENV", str(REPO / ".venv-olmo")))
    p.add_argument("--megatron-venv", default=os.environ.get("MEGATRON_VENV", str(REPO / ".venv-megatron")))
    p.add_argument("--small", type=int, default=20_000, help="W4's count of small tensors (0: skip W4)")
    p.add_argument("--mid-gb", type=float, default=0.8,
                   help="W8's mid-size-tensor state in GB (0: skip W8), default 0.8")
    p.add_argument("--large-gb", type=float, default=1.2,
                   help="W9's state of a few large matrices in GB (0: skip W9), default 1.2")
    p.add_argument("--floor-threads", default="1,2,4,8", help="files (threads) per rank for the floors")
    p.add_argument("--no-drop-caches", dest="drop", action="store_false",
                   help="do not drop the page cache before cold loads (needs root)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--results", default=str(RESULTS), help="where the JSON and the plot go")
    p.add_argument("--no-plot", dest="plot", action="store_false")
    p.add_argument("--plot-from", default=None, metavar="JSON",
                   help="only draw the plot of a results JSON of an earlier run (next to it, .png)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one spawned world may run")
    args = p.parse_args(argv)
    if args.plot_from:
        plot(json.loads(Path(args.plot_from).read_text()), Path(args.plot_from).with_suffix(".png"))
        return 0

    backends = _backends(args.backends)
    peers = [x.strip() for x in args.peers.split(",") if x.strip()]
    runners = [Runner("main", None, (*(f"ckptfs:{n}:{v}" for n, v in backends),
                                     *(["DCP"] if "DCP" in peers else [])), floors=True)]
    from bench.peers import PEER_MODULES

    for name, venv in (("OLMo-core", args.olmo_venv), ("Megatron", args.megatron_venv)):
        if name in peers:
            r = peer_runner(name, venv, PEER_MODULES[name])
            if r:
                runners.append(r)
    if args.drop and not drop_caches():
        print("warning: cannot drop the page cache (not root?): 'cold' loads are warm", file=sys.stderr)
        args.drop = False

    specs = state_specs(args.gb)
    state_bytes = sum(s.nbytes for s in specs)
    root = args.dir or tempfile.mkdtemp(prefix="ckptfs-perf-")
    os.makedirs(root, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.join(root, f"records-{stamp}.jsonl")
    base = {"gb": args.gb, "small": args.small, "mid_gb": args.mid_gb, "large_gb": args.large_gb,
            "drop": args.drop, "root": root,
            "out": out,
            "floor_threads": [int(t) for t in args.floor_threads.split(",") if t], "timeout": args.timeout}
    print(f"bench.perf: {len(specs)} tensors, {state_bytes / 1e9:.3f} GB (fp32 + bf16 DTensor Shard(0)), "
          f"W4 {args.small} small tensors; runners {[(r.name, r.libs) for r in runners]}; "
          f"{args.reps} reps + {args.warmup} warm-up; page cache "
          f"{'dropped before cold loads' if args.drop else 'NOT dropped'}; dir {root}", flush=True)
    t0 = time.perf_counter()
    failed: dict[str, str] = {}
    try:
        for rep in range(-args.warmup, args.reps):
            for world in (2, 1, 3):
                live = [r for r in runners if r.name not in failed]
                for runner in live if rep % 2 == 0 else live[::-1]:
                    libs = list(runner.libs) if rep % 2 == 0 else list(runner.libs)[::-1]
                    print(f"rep {rep}{' (warm-up)' if rep < 0 else ''}, world {world}, {runner.name}: {libs}",
                          flush=True)
                    cfg = {**base, "rep": rep, "world": world, "runner": runner.name, "libs": libs,
                           "floors": runner.floors}
                    try:
                        run_world(runner, cfg)
                    except Exception as e:
                        if runner.python is None:
                            raise
                        failed[runner.name] = f"{type(e).__name__}: {e}"
                        print(f"skip {runner.name} from here on: its world failed ({failed[runner.name]})")
        records = [json.loads(line) for line in Path(out).read_text().splitlines()]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result = summarize(records, state_bytes, args)
    report = render(result, state_bytes, args, failed)
    print(report)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    json_path = results / f"perf-{stamp}-{args.gb:g}gb.json"
    json_path.write_text(json.dumps({
        "config": {**{k: v for k, v in base.items() if k not in ("out", "root")}, "reps": args.reps,
                   "warmup": args.warmup, "backends": backends, "runners": [r.__dict__ for r in runners],
                   "state_bytes": state_bytes, "tensors": len(specs)},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "torch": torch.__version__, "ckptfs": ckptfs.__version__,
                 "loadavg": os.getloadavg()},
        "wall_seconds": time.perf_counter() - t0, "failed_runners": failed,
        **result, "records": records, "report": report}, indent=1))
    print(f"results: {json_path}")
    if args.plot:
        plot(result, results / f"perf-{stamp}-{args.gb:g}gb.png")
    return exit_code(records)


def _backends(spec: str) -> list[tuple[str, int]]:
    found = importable_backends()
    if spec == "all":
        return found
    out = []
    for n in spec.split(","):
        name, _, ver = n.strip().partition("-")
        match = [b for b in found if b[0] == name and (not ver or b[1] == int(ver))]
        if not match:
            sys.exit(f"backend {n!r} is not importable; importable: {found}")
        out.append(max(match, key=lambda b: b[1]))
    return out


# -- summary ------------------------------------------------------------------------------------------

FLOOR_COLUMNS = ("write", "cold", "warm", "copy", "w3cold")


def floor_kind(case: str, kind: str) -> str:
    """The floor a case is measured against: saves -> write, cold loads -> cold, warm -> warm."""
    if case.startswith("W3"):
        return "w3cold"  # the cold read of only the bytes W3 loads
    return {"save": "write", "cold": "cold", "warm": "warm"}[kind]


def page_cache(case: str, kind: str) -> str:
    """The page cache a case starts from: "warm" (W6, W7 and the warm cases of W8 and W9 keep
    what the earlier cases left) or "dropped"."""
    return "warm" if kind == "warm" or case.startswith(("W6", "W7")) or " warm " in case else "dropped"


def save_case(case: str) -> bool:
    """A save the never-behind target covers: W1, W7, W8, W9 (W4's small tensors have their own)."""
    return " save" in case and not case.startswith("W4")


def summarize(records: list[dict[str, Any]], state_bytes: int, args: argparse.Namespace) -> dict[str, Any]:
    """Floors (GB/s per world and kind, best thread count), and per (case, lib) medians with the
    fraction of the floor."""
    fl: dict[tuple[int, str, int], list[float]] = defaultdict(list)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    beside: dict[tuple[str, str], list[float]] = defaultdict(list)
    nofsync: dict[tuple[str, str], list[float]] = defaultdict(list)
    fsync_floor: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in records:
        if r["kind"] == "floor-beside":  # the case's own files read whole, beside the load
            beside[(r["case"], r["lib"])].append(r["seconds"])
        elif r["kind"] == "save-nofsync":  # the same save without fsync, beside it
            nofsync[(r["case"], r["lib"])].append(r["seconds"])
        elif r["kind"] == "floor-fsync":  # the same files written and fsynced, plain calls
            fsync_floor[(r["case"], r["lib"])].append(r["seconds"])
        elif r["kind"].startswith("floor-"):
            fl[(r["world"], r["kind"][6:], r["threads"])].append(r["bytes"] / r["seconds"] / 1e9)
        else:
            groups[(r["case"], r["lib"])].append(r)
    floors_all = [{"world": w, "kind": k, "threads": t, "gbps": statistics.median(v), "runs": len(v)}
                  for (w, k, t), v in sorted(fl.items())]
    floors: dict[str, float] = {}
    for f in floors_all:
        key = f"{f['world']}:{f['kind']}"
        floors[key] = max(floors.get(key, 0.0), f["gbps"])
    cases = []
    for (case, lib), rs in groups.items():
        r0 = rs[0]
        secs = statistics.median(r["seconds"] for r in rs)
        row = {"case": case, "lib": lib, "kind": r0["kind"], "world": r0["world"], "bytes": r0["bytes"],
               "seconds": secs, "gbps": r0["bytes"] / secs / 1e9, "runs": len(rs),
               "all_seconds": [round(r["seconds"], 4) for r in rs],
               "bad": sum(r.get("bad", 0) for r in rs)}
        fk = floor_kind(case, r0["kind"])
        floor = floors.get(f"{r0['world']}:{fk}")
        row["floor_kind"], row["floor_gbps"] = fk, floor
        row["fraction"] = row["gbps"] / floor if floor else None
        row["page_cache"] = page_cache(case, r0["kind"])
        if (case, lib) in nofsync:  # time of the same save without fsync / time of the save
            row["nofsync_seconds"] = statistics.median(nofsync[(case, lib)])
            row["nofsync_fraction"] = row["nofsync_seconds"] / secs
        if (case, lib) in fsync_floor:  # time of the save / time of its fsync floor
            row["fsync_floor_seconds"] = statistics.median(fsync_floor[(case, lib)])
            row["over_fsync_floor"] = secs / row["fsync_floor_seconds"]
        if (case, lib) in beside:  # time of reading the same files whole / time of the load
            row["beside_seconds"] = statistics.median(beside[(case, lib)])
            row["beside_fraction"] = row["beside_seconds"] / secs
        if "peak_rss" in r0:
            row["peak_rss"] = statistics.median(r["peak_rss"] for r in rs)
            row["local_bytes"] = max(r["local_bytes"] for r in rs)
        cases.append(row)
    cases.sort(key=lambda c: (c["case"], _lib_key(c["lib"])))
    return {"floors": floors, "floors_all": floors_all, "cases": cases, "targets": targets(cases)}


def _lib_key(lib: str) -> tuple:
    return (lib in PEER_NAMES, PEER_NAMES.index(lib) if lib in PEER_NAMES else 0, lib)


def _ours(cases: list[dict]) -> list[str]:
    return sorted({c["lib"] for c in cases if c["lib"] not in PEER_NAMES})


def _by(cases: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["case"], c["lib"]): c for c in cases}


def rss_bound(local_bytes: int) -> float:
    return TARGETS["rss_base"] + TARGETS["rss_frac"] * local_bytes


def targets(cases: list[dict]) -> list[dict[str, Any]]:
    """The performance targets (``TARGETS``) per ckptfs backend: name, worst value, bound, met."""
    by = _by(cases)
    out = []

    def add(lib: str, name: str, values: list[float], bound: float, higher: bool, fmt: str) -> None:
        if not values:
            return
        worst = min(values) if higher else max(values)
        out.append({"lib": lib, "target": name, "worst": worst, "bound": bound, "fmt": fmt,
                    "met": worst >= bound if higher else worst <= bound})

    def ratio(case: str, peer: str, lib: str) -> float | None:
        a, b = by.get((case, peer)), by.get((case, lib))
        return a["seconds"] / b["seconds"] if a and b else None

    for lib in _ours(cases):
        mine = [c for c in cases if c["lib"] == lib]
        cold = [c["fraction"] for c in mine if c["case"].startswith(("W1 load", "W2")) and c["fraction"]]
        saves = [c for c in mine if c["case"].startswith("W1 save")]
        add(lib, "cold loads (W1, W2) >= 85% of the cold-read floor", cold, TARGETS["cold_floor"], True, "%")
        add(lib, "saves (W1) >= 95% of the write floor", [c["fraction"] for c in saves if c["fraction"]],
            TARGETS["save_floor"], True, "%")
        every = [c for c in mine if save_case(c["case"])]
        behind = [v for c in every for peer in PEER_NAMES if (v := ratio(c["case"], peer, lib)) is not None]
        add(lib, "saves (W1, W7, W8, W9; page cache dropped and warm) never behind any peer "
            "(peer time / ckptfs time >= 1)", behind, 1.0, True, "x")
        add(lib, "saves from a dropped page cache (W1, W8) within 10% of the same save without fsync "
            "(time / no-fsync time <= 1.10)",
            [1 / c["nofsync_fraction"] for c in every if c.get("nofsync_fraction")], TARGETS["nofsync"],
            False, "x")
        add(lib, "saves from a dropped page cache (W1, W8) within 10% of the same files written with "
            "plain os.write and one fsync per file (time / fsync-floor time <= 1.10)",
            [c["over_fsync_floor"] for c in every if c.get("over_fsync_floor")], TARGETS["nofsync"],
            False, "x")
        w3 = [v for c in mine if c["case"].startswith("W3") if (v := ratio(c["case"], "DCP", lib))]
        ceil = [d["floor_gbps"] / d["gbps"] for c in mine if c["case"].startswith("W3")
                if (d := by.get((c["case"], "DCP"))) and d["floor_gbps"]]
        add(lib, "W3 10%-of-keys load >= 5x DCP" + (
            f" (reading only its bytes at the cold-read floor would be {min(ceil):.2f}x DCP)"
            if ceil else ""), w3, TARGETS["w3_dcp"], True, "x")
        for what in ("save", "load"):
            w4 = [c for c in mine if c["case"].startswith(f"W4 {what}")]
            # the ratio to DCP if this library took only as long as its own files with plain calls
            plain = [d["seconds"] / c["beside_seconds"] for c in w4
                     if (d := by.get((c["case"], "DCP"))) and c.get("beside_seconds")]
            verb = "written" if what == "save" else "read cold"
            add(lib, f"W4 small tensors {what} >= 3x DCP" + (
                f" (its own files {verb} with plain calls would be {min(plain):.2f}x DCP)" if plain else ""),
                [v for c in w4 if (v := ratio(c["case"], "DCP", lib))], TARGETS["w4_dcp"], True, "x")
        over = [c["peak_rss"] - rss_bound(c["local_bytes"]) for c in saves if "peak_rss" in c]
        add(lib, "W5 sync-save peak extra RSS per rank <= 256 MiB + 10% of the rank's state "
            "(worst excess over the bound)", over, 0.0, False, "MiB")
        warm = [c["fraction"] for c in mine if c["case"].startswith("W6") and c["fraction"]]
        add(lib, "W6 warm loads >= 50% of the warm-read floor", warm, TARGETS["warm_floor"], True, "%")
    return out


# -- the report ---------------------------------------------------------------------------------------

def _case_order(case: str) -> tuple:
    return (case[:2], "load" in case and "save" not in case, case)


def render(result: dict[str, Any], state_bytes: int, args: argparse.Namespace, failed: dict[str, str]) -> str:
    cases = result["cases"]
    by = _by(cases)
    peers = [p for p in PEER_NAMES if any(c["lib"] == p for c in cases)]
    libs = sorted({c["lib"] for c in cases}, key=_lib_key)
    rows = []
    for case in sorted({c["case"] for c in cases}, key=_case_order):
        for lib in libs:
            c = by.get((case, lib))
            if not c:
                continue
            mark = {"OLMo-core": " +", "Megatron": " *", "Megatron-FP": " *"}.get(lib, "")
            ratios = []
            for peer in peers:
                o = by.get((case, peer))
                ratios.append(f"{o['seconds'] / c['seconds']:.2f}x" if o and lib not in PEER_NAMES else "")
            frac = f"{c['fraction']:.0%}" if c["fraction"] is not None else "-"
            near = f"{c['beside_fraction']:.0%}" if c.get("beside_fraction") is not None else ""
            floor = f"{c['floor_kind']} {c['floor_gbps']:.2f}" if c["floor_gbps"] else "-"
            plain = f"{c['nofsync_fraction']:.2f}x" if c.get("nofsync_fraction") else ""
            over = f"{c['over_fsync_floor']:.2f}x" if c.get("over_fsync_floor") else ""
            spread = f"{min(c['all_seconds']):.3f}-{max(c['all_seconds']):.3f}"
            rows.append([case, lib + mark, c["page_cache"], f"{c['seconds']:.3f} s", f"{c['gbps']:.2f}",
                         floor, frac, near, plain, over, *ratios, spread])
    cold = "cold = page cache dropped first" if args.drop else "page cache NOT dropped ('cold' is warm)"
    lines = ["", f"median of {args.reps} runs; state {state_bytes / 1e9:.3f} GB; {cold}; GB/s = 1e9 bytes/s; "
             "floor = GB/s of the floor of that kind at the same world size; "
             "'of own files' = time to read the case's own files whole, cold (loads), or to write the same "
             "files anew (W4 saves), with plain calls, beside it / its time; "
             "'x no fsync' = time of the same save with fsync=False beside it / its time; "
             "'x fsync floor' = its time / the time of the same files written with plain os.write and "
             "one fsync per file beside it; "
             "'x PEER' = peer time / this time (> 1: this is faster)",
             *table(["case", "library", "page cache", "time", "GB/s", "floor GB/s", "of floor",
                     "of own files", "x no fsync", "x fsync floor", *(f"x {p}" for p in peers),
                     "min-max s"], rows)]
    marks = [f"{m} {NOTES[p]}" for m, p in ((" +", "OLMo-core"), (" *", "Megatron")) if p in peers]
    if marks:
        lines.append("   " + ";  ".join(x.strip() for x in marks))
    frows = []
    fa = result["floors_all"]
    for w in sorted({f["world"] for f in fa}):
        for t in sorted({f["threads"] for f in fa if f["world"] == w}):
            got = {f["kind"]: f["gbps"] for f in fa if f["world"] == w and f["threads"] == t}
            frows.append([f"{w} rank(s) x {t} file(s)", *(f"{got[k]:.2f}" if k in got else "-"
                                                            for k in FLOOR_COLUMNS)])
    lines += ["", "floors (GB/s, median; each case uses the best thread count of its world): write + fsync, "
              "cold read, warm read, copy_ into existing tensors, cold read of W3's bytes only",
              *table(["world", "write", "cold", "warm", "copy", "W3 cold"], frows)]
    wrows = [[c["case"], c["lib"], f"{c['peak_rss'] / MIB:.0f} MiB", f"{c['local_bytes'] / MIB:.0f} MiB",
              f"{rss_bound(c['local_bytes']) / MIB:.0f} MiB",
              "met" if c["peak_rss"] <= rss_bound(c["local_bytes"]) else "NOT met"]
             for case in sorted({c["case"] for c in cases if c["case"].startswith("W1 save")})
             for lib in libs if (c := by.get((case, lib))) and "peak_rss" in c]
    lines += ["", "W5 sync-save peak extra RSS per rank (largest rank; VmHWM after the save - VmRSS before, "
              "peak reset by /proc/self/clear_refs)",
              *table(["case", "library", "peak extra", "rank's state", "bound", "bound met"], wrows)]
    lines += ["", "worst ratio to each peer over all cases (peer time / ckptfs time; < 1: behind):"]
    for lib in _ours(cases):
        for peer in peers:
            got = [(o["seconds"] / c["seconds"], c["case"]) for c in cases if c["lib"] == lib
                   if (o := by.get((c["case"], peer)))]
            if got:
                worst, case = min(got)
                lines.append(f"  worst, {lib} vs {peer}: {worst:.2f}x ({case}); saves only: "
                             + (f"{min(v for v, k in got if save_case(k)):.2f}x"
                                if any(save_case(k) for _, k in got) else "-"))
    lines += ["", "targets (worst case over the rows):"]
    for t in result["targets"]:
        v = (f"{t['worst']:.0%}" if t["fmt"] == "%" else f"{t['worst'] / MIB:+.0f} MiB" if t["fmt"] == "MiB"
             else f"{t['worst']:.2f}x")
        lines.append(f"  {t['lib']}: {t['target']}: {v} -> {'met' if t['met'] else 'NOT met'}")
    for lib in _ours(cases):
        for which, what in ((("W1", "W2"), "cold loads (W1, W2) against the same files read whole beside "
                             "each load (not a target; the disk as that checkpoint lies on it)"),
                            (("W4",), "small tensors (W4) against the same files written / read with plain "
                             "calls beside each case (not a target; what the layout costs on this disk)")):
            near = [c["beside_fraction"] for c in cases if c["lib"] == lib and c["case"].startswith(which)
                    and c.get("beside_fraction")]
            if near:
                lines.append(f"  beside, {lib}: {what}: {min(near):.0%}-{max(near):.0%}")
    for name, why in failed.items():
        lines.append(f"  {name}: failed and was dropped: {why}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Bars of fraction of floor per case and library."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e '.[bench]')")
        return
    cases = [c for c in result["cases"] if c["fraction"] is not None]
    names = sorted({c["case"] for c in cases}, key=_case_order)
    libs = sorted({c["lib"] for c in cases}, key=_lib_key)
    by = _by(cases)
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(names)), 5))
    width = 0.8 / max(1, len(libs))
    for i, lib in enumerate(libs):
        xs = [j + i * width for j, n in enumerate(names) if (n, lib) in by]
        ys = [by[(n, lib)]["fraction"] for n in names if (n, lib) in by]
        ax.bar(xs, ys, width, label=lib)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel("fraction of the physical floor (1 = the disk / memory)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.legend(fontsize=7)
    ax.set_title("ckptfs and peers against the floor (bench.perf)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
