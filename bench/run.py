"""``python -m bench.run`` (``make bench``): ckptfs vs torch.distributed.checkpoint, same state.

Saves and loads a synthetic state (fp32 + bf16, row-sharded DTensors) with each checkpointer on
spawned gloo ranks: save and load at world sizes 1 and 2, and resharded loads of the 2-rank
checkpoints into 1 rank and into 3 ranks (a split that matches neither saved shard). The page
cache is dropped before every cold load. Prints medians, ratios and bytes read / bytes needed,
and writes every measurement to bench/results/<time>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

import ckptfs
from bench.synthetic import state_specs
from bench.worker import RESHARD_SOURCE, drop_caches, spawn_world

RESULTS = Path(__file__).resolve().parent / "results"
TARGET_SPEEDUP = 3.0
TARGET_READ_RATIO = 1.05


def importable_backends() -> list[tuple[str, int]]:
    """Built-in backends (classes inside ckptfs) whose modules import."""
    out = []
    for name, version in ckptfs.available_backends():
        try:
            cls = ckptfs.get_backend(name, version)
        except ImportError:
            continue
        if cls.__module__.startswith("ckptfs.") and cls.writable:
            out.append((name, version))
    return out


def parse_backends(args: argparse.Namespace) -> list[tuple[str, int]]:
    found = importable_backends()
    if args.backends == "all":
        return found
    names = args.backends.split(",") if args.backends else [args.backend]
    out = []
    for n in names:
        name, _, ver = n.partition("-")
        match = [b for b in found if b[0] == name and (not ver or b[1] == int(ver))]
        if not match:
            sys.exit(f"backend {n!r} is not importable; importable: {found}")
        out.append(max(match, key=lambda b: b[1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.5, help="state size in GB (1e9 bytes), default 1.5")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every measurement (median)")
    p.add_argument("--backend", default="safetensors_chunks", help="ckptfs backend (name or name-version)")
    p.add_argument("--backends", default=None,
                   help="'all' (every importable built-in) or a comma list; overrides --backend")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded repetitions first (default 1)")
    p.add_argument("--worlds", default="1,2", help="world sizes that save and load (default 1,2)")
    p.add_argument("--reshard", default="1,3",
                   help=f"world sizes that load the {RESHARD_SOURCE}-rank checkpoints (default 1,3)")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache before cold loads (needs root)")
    p.add_argument("--no-warm", dest="warm", action="store_false", help="skip the warm-cache loads")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip the bit-exact check")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the results file goes (default bench/results/)")
    args = p.parse_args(argv)

    backends = parse_backends(args)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    reshard = [int(w) for w in args.reshard.split(",") if w]
    save_worlds = sorted(set(worlds) | ({RESHARD_SOURCE} if reshard else set()))
    order = sorted(set(save_worlds) | set(reshard), key=lambda w: (w != RESHARD_SOURCE, w))
    if args.drop_caches and not drop_caches():
        print("warning: cannot drop the page cache (not root?): 'cold' loads are warm", file=sys.stderr)
        args.drop_caches = False

    specs = state_specs(args.gb)
    state_bytes = sum(s.nbytes for s in specs)
    args.results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    root = args.dir or tempfile.mkdtemp(prefix="ckptfs-bench-")
    os.makedirs(root, exist_ok=True)
    records_path = os.path.join(root, f"records-{stamp}.jsonl")
    cfg = {"gb": args.gb, "reps": args.reps, "warmup": args.warmup, "backends": backends,
           "worlds": save_worlds,
           "reshard_targets": reshard, "drop_caches": args.drop_caches, "warm": args.warm,
           "verify": args.verify, "root": root, "out": records_path}
    print(f"bench: {len(specs)} tensors, {state_bytes / 1e9:.2f} GB (fp32 + bf16, DTensor Shard(0)); "
          f"ckptfs backends {backends} vs DCP; worlds {save_worlds}, resharded loads "
          f"{RESHARD_SOURCE}->{reshard}; {args.reps} reps; page cache "
          f"{'dropped before cold loads' if args.drop_caches else 'NOT dropped'}; dir {root}")
    t0 = time.perf_counter()
    try:
        for w in order:
            print(f"world {w}:", flush=True)
            spawn_world(w, cfg)
        records = [json.loads(line) for line in Path(records_path).read_text().splitlines()]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarize(records)
    report = render(summary, state_bytes, args)
    print(report)
    out = args.results / f"{stamp}-{args.gb:g}gb.json"
    out.write_text(json.dumps({
        "config": {**{k: v for k, v in cfg.items() if k not in ("out", "root")},
                   "state_bytes": state_bytes, "tensors": len(specs)},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "ckptfs": ckptfs.__version__},
        "wall_seconds": time.perf_counter() - t0,
        "summary": summary, "records": records, "report": report}, indent=1))
    print(f"results: {out}")
    return exit_code(records)


def exit_code(records: list[dict[str, Any]]) -> int:
    """1 (after saying which) if any load was not bit-exact, else 0."""
    bad = [r for r in records if r.get("bad")]
    if bad:
        print(f"FAILED: {len(bad)} load(s) were not bit-exact: "
              f"{[(r['case'], r['lib'], r['bad_keys']) for r in bad]}", file=sys.stderr)
        return 1
    return 0


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """{kind: {case: {lib: medians}}} with seconds, read, needed, disk_read, stored."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        groups[(r["kind"], r["case"], r["lib"])].append(r)
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    for (kind, case, lib), rs in groups.items():
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("seconds", "read", "needed", "disk_read", "stored") if k in rs[0]}
        med["runs"] = len(rs)
        med["all_seconds"] = [round(r["seconds"], 3) for r in rs]
        out[kind][case][lib] = med
    return json.loads(json.dumps(out))


def _case_key(case: str) -> tuple:
    kind, _, w = case.partition(" ")
    return ({"save": 0, "load": 1, "reshard": 2}.get(kind, 3), w)


def render(summary: dict, state_bytes: int, args: argparse.Namespace) -> str:
    gb = state_bytes / 1e9
    save, cold, warm = (summary.get(k) or {} for k in ("save", "cold", "warm"))
    libs = sorted({lib for t in (save, cold, warm) for per in t.values() for lib in per},
                  key=lambda x: (x == "DCP", x))
    ours = [x for x in libs if x != "DCP"]

    def cells(table: dict, case: str, lib: str) -> list[str]:
        m = table.get(case, {}).get(lib)
        if not m:
            return ["-", "-", "-"]
        dcp = table[case].get("DCP")
        ratio = f"{dcp['seconds'] / m['seconds']:.2f}x" if dcp and lib != "DCP" else ""
        return [f"{m['seconds']:.2f} s", f"{gb / m['seconds']:.2f}", ratio]

    rows = []
    for case in sorted({*save, *cold, *warm}, key=_case_key):
        for lib in libs:
            first = save if case in save else cold
            if lib not in first.get(case, {}):
                continue
            m = first[case][lib]
            spread = f"{min(m['all_seconds']):.2f}-{max(m['all_seconds']):.2f}"
            rows.append([case, lib, *cells(first, case, lib), spread,
                         *(cells(warm, case, lib) if case in warm else ["", "", ""])])
    cold_title = "cold" if args.drop_caches else "cache NOT dropped"
    lines = ["", f"median of {args.reps} runs, {gb:.2f} GB state; 'x DCP' = DCP time / this time "
             f"(target {TARGET_SPEEDUP:g}x); loads: {cold_title}, then warm page cache",
             *table(["case", "library", "time", "GB/s", "x DCP", "min-max s",
                      "warm", "GB/s", "x DCP"], rows)]

    rows = []
    for case in sorted(cold, key=_case_key):
        for lib, m in sorted(cold[case].items(), key=lambda kv: (kv[0] == "DCP", kv[0])):
            need = m["needed"] or 1
            disk = f"{m['disk_read'] / need:.3f}" if m.get("disk_read", -1) >= 0 and args.drop_caches else "-"
            how = "estimated from DCP metadata" if lib == "DCP" else "counted by ckptfs I/O"
            rows.append([case, lib, f"{m['needed'] / 1e6:.0f} MB", f"{m['read'] / 1e6:.0f} MB",
                         f"{m['read'] / need:.3f}", disk, how])
    if rows:
        lines += ["", "bytes read / bytes needed, all ranks (target for resharded loads <= "
                  f"{TARGET_READ_RATIO}); 'disk' = /proc/self/io read_bytes after drop_caches "
                  "(page cache shared by ranks, readahead included)",
                  *table(["case", "library", "needed", "read", "read/needed", "disk/needed", "read counted"],
                          rows)]

    lines += ["", "targets:"]
    for lib in ours:
        def speedups(table: dict, prefix: tuple[str, ...], lib: str = lib) -> list[float]:
            return [per["DCP"]["seconds"] / per[lib]["seconds"] for case, per in table.items()
                    if case.startswith(prefix) and lib in per and "DCP" in per]
        sv, ld = speedups(save, ("save",)), speedups(cold, ("load", "reshard"))
        rd = [per[lib]["read"] / (per[lib]["needed"] or 1) for case, per in cold.items()
              if case.startswith("reshard") and lib in per]
        def verdict(ok: bool) -> str:
            return "met" if ok else "NOT met"
        if sv:
            lines.append(f"  {lib}: save >= {TARGET_SPEEDUP:g}x DCP: worst {min(sv):.2f}x "
                         f"({verdict(min(sv) >= TARGET_SPEEDUP)})")
        if ld:
            lines.append(f"  {lib}: load >= {TARGET_SPEEDUP:g}x DCP ({cold_title}): worst {min(ld):.2f}x "
                         f"({verdict(min(ld) >= TARGET_SPEEDUP)})")
        if rd:
            lines.append(f"  {lib}: resharded read/needed <= {TARGET_READ_RATIO}: worst {max(rd):.3f} "
                         f"({verdict(max(rd) <= TARGET_READ_RATIO)})")
    return "\n".join(lines)


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    """Aligned text rows: the first column left, the others right, a rule under the head."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    def fmt(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return [fmt(head), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


if __name__ == "__main__":
    sys.exit(main())
