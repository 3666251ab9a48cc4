"""``python -m bench.python_bound``: an asynchronous save beside a Python-bound training loop,
``writer="thread"`` against ``writer="process"``.

The loop's step is mostly Python: 40 small ``Linear`` layers with forward hooks and an Adam step
with ``foreach=False`` on one torch thread. The state saved is ``--tensors`` tensors of 1 KiB.
Both writers are warmed up (plans cached, the writer process started), then each repetition
measures the loop alone for a second and each writer in turn: time to ``staged``, time to
``done``, and the loop's mean and median step while the save runs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

import ckptfs

WRITERS = ("thread", "process")


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


def beside(step: Callable[[], None], state: dict, url: str, writer: str
           ) -> tuple[float, float, list[float]]:
    """(time to staged, time to done, the loop's step times while the save ran)."""
    t0 = time.perf_counter()
    h = ckptfs.async_save(state, url, writer=writer)
    h.wait_staged()
    staged = time.perf_counter() - t0
    steps = []
    while not h.done.done():
        s = time.perf_counter()
        step()
        steps.append(time.perf_counter() - s)
    h.result()
    return staged, time.perf_counter() - t0, steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.python_bound", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", type=int, default=20000, help="tensors in the state (1 KiB each)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, writers alternating")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    step = python_bound_step()
    state = {f"p{i}": torch.randn(256) for i in range(a.tensors)}
    root = a.dir or tempfile.mkdtemp(prefix="ckptfs-bench-")
    for w in WRITERS:
        beside(step, state, f"{root}/{w}-warm", w)
    base: list[float] = []
    rows: dict[str, list[tuple[float, float, list[float]]]] = {w: [] for w in WRITERS}
    for k in range(a.reps):
        end = time.perf_counter() + 1.0
        while time.perf_counter() < end:
            s = time.perf_counter()
            step()
            base.append(time.perf_counter() - s)
        for w in WRITERS:
            rows[w].append(beside(step, state, f"{root}/{w}-{k}", w))
    ckptfs.close()
    mean = statistics.mean(base)
    print(f"{a.tensors} tensors; loop alone: mean step {mean * 1e3:.2f} ms, "
          f"median {statistics.median(base) * 1e3:.2f} ms\n")
    print("| writer | staged (s) | done (s) | mean step (ms) | median step (ms) |")
    print("|---|---|---|---|---|")
    for w, rs in rows.items():
        st = [s for r in rs for s in r[2]] or [float("nan")]
        print(f"| {w} | {statistics.median(r[0] for r in rs):.3f} | "
              f"{statistics.median(r[1] for r in rs):.3f} | "
              f"{statistics.mean(st) * 1e3:.2f} ({statistics.mean(st) / mean:.2f}x) | "
              f"{statistics.median(st) * 1e3:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
