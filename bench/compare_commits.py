"""``python -m bench.compare_commits``: the benches of two commits in the same run, alternating.

    python -m bench.compare_commits                         # 8d8e6e3 against HEAD, 3 rounds
    python -m bench.compare_commits --old 8d8e6e3 --new HEAD --rounds 5
    python -m bench.compare_commits --suites perf --perf-args "--gb 0.2 --reps 1 --warmup 0"

Each commit is checked out in a temporary ``git worktree`` (detached) and each bench runs as a
subprocess in it, with that tree first on ``PYTHONPATH`` and this interpreter (the same venv:
only ckptfs's own code differs). Round ``r`` runs every suite for the old commit then the new
one (odd rounds: the new one first), so a machine that drifts weighs on both alike. The suites:

- ``perf``: ``bench.perf`` at quick settings (``--perf-args``);
- ``async_save``: ``bench.async_save`` (``--async-args``);
- ``python_bound``: ``bench.python_bound`` (``--bound-args``).

Every numeric value of a suite's results JSON (records, config, host and report left out) is a
case. For each case and commit: the values over the rounds, their median and their spread
((max - min) / median); the new commit's median over the old one's, and whether the two
differ by more than the larger spread (``beyond_spread``: a difference the run-to-run noise
of this run does not explain; None with fewer than 2 rounds). Written to
``bench/results/compare-<stamp>.json`` with the load average before and after. Run it on a
quiet machine: the ratios are only as good as the spreads beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"

#: quick settings every commit since the pipeline's accepts
SUITES = {
    "perf": ("bench.perf", "--gb 0.2 --reps 1 --warmup 0 --backends safetensors_chunks "
                           "--peers DCP --no-plot"),
    "async_save": ("bench.async_save", "--mb 100 --reps 2 --libs ckptfs,ckptfs-proc,DCP-stager"),
    "python_bound": ("bench.python_bound", "--tensors 2000 --reps 1"),
}
#: parts of a results JSON that are not measurements
SKIP = {"records", "config", "host", "report", "failed_runners", "args"}


def _worktree(commit: str, where: Path) -> Path:
    """``commit`` checked out (detached) at ``where``."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(where),
                    commit], check=True, capture_output=True, text=True)
    return where


def _run_suite(tree: Path, module: str, args: str, out: Path, timeout: float) -> Path | None:
    """Run ``module`` in ``tree``; the results JSON it wrote (copied to ``out``), or None."""
    results = tree / "bench" / "results"
    results.mkdir(parents=True, exist_ok=True)
    before = set(results.glob("*.json"))
    extra = ["--results", str(results)] if module == "bench.perf" else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", module, *shlex.split(args), *extra]
    print(f"  {tree.name}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)
    (out.with_suffix(".log")).write_text(proc.stdout + proc.stderr)
    new = sorted(set(results.glob("*.json")) - before, key=lambda p: p.stat().st_mtime)
    if proc.returncode != 0 or not new:
        print(f"  failed (exit {proc.returncode}): see {out.with_suffix('.log')}", flush=True)
        return None
    shutil.copy(new[-1], out)
    return out


def _check_import(tree: Path) -> None:
    """ckptfs is imported from ``tree`` (not from an editable install elsewhere)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    got = subprocess.run([sys.executable, "-c", "import ckptfs; print(ckptfs.__file__)"],
                         cwd=tree, env=env, capture_output=True, text=True).stdout.strip()
    if not got.startswith(str(tree)):
        raise SystemExit(f"ckptfs is imported from {got or '?'}, not from {tree}")


def numbers(obj: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """(dotted path, value) of every number in a results JSON, the non-measurements left out."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not path and k in SKIP:
                continue
            yield from numbers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from numbers(v, f"{path}[{_label(v, i)}]")
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        yield path, float(obj)


def _label(item: Any, i: int) -> str:
    """A list item's name: its short text fields and its world (a case of ``bench.perf``, a row
    of ``bench.python_bound``), so that the same case of two commits is compared even where
    their lists differ; else its index."""
    if not isinstance(item, dict):
        return str(i)
    parts = [f"{k}={v}" for k, v in item.items()
             if (isinstance(v, str) and len(v) <= 40) or k == "world"]
    return ",".join(parts) or str(i)


def _stats(values: list[float]) -> dict[str, Any]:
    med = statistics.median(values)
    spread = (max(values) - min(values)) / abs(med) if med else 0.0
    return {"values": values, "median": med, "spread": spread}


def compare(runs: dict[str, dict[str, list[Path]]]) -> dict[str, dict[str, Any]]:
    """Per suite and case: each commit's values, median and spread; new/old and whether the
    difference exceeds the larger spread."""
    out: dict[str, dict[str, Any]] = {}
    for suite, by_commit in runs.items():
        values: dict[str, dict[str, list[float]]] = {}
        for side, paths in by_commit.items():
            for p in paths:
                for case, v in numbers(json.loads(p.read_text())):
                    values.setdefault(case, {}).setdefault(side, []).append(v)
        cases = {}
        for case, sides in sorted(values.items()):
            if set(sides) != {"old", "new"}:
                continue
            old, new = _stats(sides["old"]), _stats(sides["new"])
            ratio = new["median"] / old["median"] if old["median"] else None
            gap = abs(new["median"] - old["median"]) / abs(old["median"]) if old["median"] else 0.0
            # one value a side has no spread: nothing to judge against
            enough = min(len(sides["old"]), len(sides["new"])) >= 2
            cases[case] = {"old": old, "new": new, "new_over_old": ratio,
                           "beyond_spread": (gap > max(old["spread"], new["spread"])
                                             if enough else None)}
        out[suite] = cases
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare_commits", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default="8d8e6e3", help="the older commit (default 8d8e6e3)")
    p.add_argument("--new", default="HEAD", help="the newer commit (default HEAD)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--suites", default=",".join(SUITES), help=f"comma list of {list(SUITES)}")
    p.add_argument("--perf-args", default=SUITES["perf"][1])
    p.add_argument("--async-args", default=SUITES["async_save"][1])
    p.add_argument("--bound-args", default=SUITES["python_bound"][1])
    p.add_argument("--timeout", type=float, default=3600, help="seconds one bench may run")
    p.add_argument("--results", default=str(RESULTS), help="where compare-<stamp>.json goes")
    args = p.parse_args(argv)
    suites = [s for s in args.suites.split(",") if s]
    if unknown := set(suites) - set(SUITES):
        p.error(f"unknown suites {sorted(unknown)}; choose from {list(SUITES)}")
    extra = {"perf": args.perf_args, "async_save": args.async_args,
             "python_bound": args.bound_args}
    commits = {side: subprocess.run(["git", "-C", str(REPO), "rev-parse", c], check=True,
                                    capture_output=True, text=True).stdout.strip()
               for side, c in (("old", args.old), ("new", args.new))}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ckptfs-compare-") as tmp:
        trees = {side: _worktree(sha, Path(tmp) / f"{side}-{sha[:8]}")
                 for side, sha in commits.items()}
        try:
            for tree in trees.values():
                _check_import(tree)
            runs: dict[str, dict[str, list[Path]]] = {s: {"old": [], "new": []} for s in suites}
            for r in range(args.rounds):
                order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
                for suite in suites:
                    for side in order:
                        print(f"round {r}, {suite}, {side} ({commits[side][:8]})", flush=True)
                        got = _run_suite(trees[side], SUITES[suite][0], extra[suite],
                                         Path(tmp) / f"{suite}-{side}-{r}.json", args.timeout)
                        if got is not None:
                            runs[suite][side].append(got)
            result = compare(runs)
            logs = {p.name: p.read_text()[-4000:] for p in Path(tmp).glob("*.log")}
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(tree)], capture_output=True)
    out = Path(args.results) / f"compare-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "commits": commits, "rounds": args.rounds, "suites": {s: [SUITES[s][0], extra[s]]
                                                              for s in suites},
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(),
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": os.getloadavg()},
        "wall_seconds": time.perf_counter() - t0, "cases": result, "log_tails": logs}, indent=1))
    beyond = {s: [c for c, v in cases.items() if v["beyond_spread"]]
              for s, cases in result.items()}
    for s, cases in result.items():
        print(f"{s}: {len(cases)} cases, {len(beyond[s])} differ beyond the spread")
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
