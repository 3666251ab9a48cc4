"""``python -m bench.python_bound``: an asynchronous save beside a Python-bound training loop,
``writer="thread"`` against ``writer="process"`` and DCP's ``async_save`` in thread and process
mode (``--writers``; ``process-nice0``: the process writer with ``background_nice=0``).

The loop's step is mostly Python: 40 small ``Linear`` layers with forward hooks and an Adam step
with ``foreach=False`` on one torch thread. The state saved is ``--tensors`` tensors of 1 KiB.
Both writers are warmed up (plans cached, the writer process started), then each repetition
measures the loop alone for a second and each writer in turn: time to ``staged``, time to
``done``, and the loop's mean and median step while the save runs. DCP runs over a gloo group
of one (its process mode starts its own writer process); its ``staged`` is the stager's
completion (process mode) or the call's return (thread mode). Results go to
``bench/results/python_bound-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

import ckptfs
from bench.libs import group_of_one

WRITERS = ("thread", "process", "DCP-thread", "DCP-proc")
CHOICES = (*WRITERS, "process-nice0")
RESULTS = Path(__file__).resolve().parent / "results"


def python_bound_step() -> Callable[[], None]:
    layers = [torch.nn.Linear(32, 32) for _ in range(40)]
    model = torch.nn.Sequential(*layers)
    for m in layers:
        m.register_forward_hook(lambda mod, i, o: None)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    x = torch.randn(4, 32)

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return step


def start(writer: str, state: dict, url: str, dcp: dict[str, Any]
          ) -> tuple[Callable[[], None], Callable[[], bool], Callable[[], Any]]:
    """Start one save: (wait for staged, is it done, its result)."""
    if writer.startswith("DCP-"):
        from bench.async_save import Dcp

        ck = dcp.get(writer) or dcp.setdefault(writer, Dcp(writer.removeprefix("DCP-")))
        staged, result = ck.start(state, url)
        finished: Future[Any] = Future()

        def wait() -> None:  # DCP's futures differ by mode: waited for in a thread
            try:
                finished.set_result(result())
            except BaseException as e:
                finished.set_exception(e)

        threading.Thread(target=wait, daemon=True).start()
        return staged, finished.done, finished.result
    opts = ckptfs.SaveOptions(background_nice=0) if writer == "process-nice0" else None
    h = ckptfs.async_save(state, url, writer=writer.removesuffix("-nice0"), options=opts)
    return h.wait_staged, h.done.done, h.result


def beside(step: Callable[[], None], state: dict, url: str, writer: str,
           dcp: dict[str, Any]) -> tuple[float, float, list[float]]:
    """(time to staged, time to done, the loop's step times while the save ran)."""
    t0 = time.perf_counter()
    wait_staged, done, result = start(writer, state, url, dcp)
    wait_staged()
    staged = time.perf_counter() - t0
    steps = []
    while not done():
        s = time.perf_counter()
        step()
        steps.append(time.perf_counter() - s)
    result()
    return staged, time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.python_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=20000, help="tensors in the state (1 KiB each)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, writers alternating")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--writers", nargs="+", default=list(WRITERS), choices=CHOICES,
                   help="what saves beside the loop, in turn")
    p.add_argument("--no-save", action="store_true", help="print only, write no results file")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the results file goes (default bench/results/)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if any(w.startswith("DCP-") for w in a.writers):
        group_of_one()
    step = python_bound_step()
    state = {f"p{i}": torch.randn(256) for i in range(a.tensors)}
    root = a.dir or tempfile.mkdtemp(prefix="ckptfs-bench-")
    dcp: dict[str, Any] = {}
    for w in a.writers:
        beside(step, state, f"{root}/{w}-warm", w, dcp)
    base: list[float] = []
    rows: dict[str, list[tuple[float, float, list[float]]]] = {w: [] for w in a.writers}
    for k in range(a.reps):
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            s = time.perf_counter()
            step()
            base.append(time.perf_counter() - s)
        order = a.writers[k % len(a.writers):] + a.writers[:k % len(a.writers)]
        for w in order:  # rotating, so no writer always follows the same one
            rows[w].append(beside(step, state, f"{root}/{w}-{k}", w, dcp))
    ckptfs.close()
    for ck in dcp.values():
        ck.close()
    report(a, base, rows)
    return 0


def report(a: argparse.Namespace, base: list[float],
           rows: dict[str, list[tuple[float, float, list[float]]]]) -> None:
    mean = statistics.mean(base)
    print(f"{a.tensors} tensors; loop alone: mean step {mean * 1e3:.2f} ms, "
          f"median {statistics.median(base) * 1e3:.2f} ms\n")
    print("| writer | staged (s) min / median | done (s) min / median | mean step (ms) | "
          "median step (ms) |")
    print("|---|---|---|---|---|")
    out = []
    for w, rs in rows.items():
        st = [s for r in rs for s in r[2]] or [float("nan")]
        staged, done = [r[0] for r in rs], [r[1] for r in rs]
        out.append({"writer": w, "staged_s": staged, "done_s": done,
                    "mean_step_s": statistics.mean(st), "median_step_s": statistics.median(st),
                    "slowdown_mean": statistics.mean(st) / mean,
                    "per_rep_slowdown_mean": [statistics.mean(r[2] or [float("nan")]) / mean
                                              for r in rs]})
        print(f"| {w} | {min(staged):.3f} / {statistics.median(staged):.3f} | "
              f"{min(done):.3f} / {statistics.median(done):.3f} | "
              f"{statistics.mean(st) * 1e3:.2f} ({statistics.mean(st) / mean:.2f}x) | "
              f"{statistics.median(st) * 1e3:.2f} |")
    if not a.no_save:
        a.results.mkdir(parents=True, exist_ok=True)
        path = a.results / f"python_bound-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "tensors": a.tensors, "reps": a.reps, "loop_mean_step_s": mean,
            "loop_median_step_s": statistics.median(base), "rows": out}, indent=1) + "\n")
        print(f"results: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
