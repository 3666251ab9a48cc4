"""``python -m bench.host_memory``: the host memory a save takes under ``host_memory_limit``.

Each case runs in a fresh spawned process (``run_ranks``, one rank) holding a state of ``--gb``
GB of fp32 tensors of ``--tensor-mib`` MiB each (and 50 small ones), seeded, and saves it once:
``async_save`` with the thread writer, ``async_save`` with the process writer, or the synchronous
``save``. What is measured is the growth of resident memory during the save:

- the training process: its peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` just
  before the save) less its RSS before the save. Its staging buffers, shared memory included,
  are resident here (it writes every staged byte);
- the process writer's: its RSS without shared memory (``RssAnon + RssFile``, sampled every
  5 ms; shared memory is counted once, in the training process), less the same before the save
  (the writer is started by a small save first).

Their sum is reported against ``limit + 64 MiB``. The save's checkpoint is then loaded and
compared with the state, bit for bit. For the synchronous save the tensors are transposed views
(``--layout transposed``), which it must copy (it writes contiguous CPU tensors in place).
Results go to ``bench/results/host_memory-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from pathlib import Path

MiB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
#: the slack the target allows over the limit (interpreter, index, plans)
SLACK_MIB = 64


def _status(pid: int | str, *fields: str) -> int:
    """The sum of ``fields`` of ``/proc/<pid>/status``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return sum(int(line.split()[1]) * 1024 for line in f
                   if line.split(":")[0] in fields)


class Sampler:
    """The peak of a process's RSS without shared memory, sampled every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.005) -> None:
        self.pid, self.period = pid, period
        self.before = self._now()
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _now(self) -> int:
        return _status(self.pid, "RssAnon", "RssFile")

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self._now())

    def growth(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._now())
        return self.peak - self.before


def make_state(gb: float, tensor_mib: int, layout: str) -> dict:
    import torch

    g = torch.Generator().manual_seed(0)
    rows = tensor_mib * MiB // 4 // 1024
    state: dict = {}
    for i in range(max(1, int(gb * 1024 / tensor_mib))):
        t = torch.randn(rows, 1024, generator=g)
        state[f"t{i}"] = t.t() if layout == "transposed" else t
    state["small"] = [torch.arange(i + 1) for i in range(50)]
    return state


def child(a: argparse.Namespace) -> dict:
    """One save in this process; what it measured."""
    import torch

    import ckptfs
    from ckptfs.engine.background.defaults import default_saver

    limit = a.limit_mib * MiB if a.limit_mib else None
    state = make_state(a.gb, a.tensor_mib, a.layout)
    writer = None
    if a.mode == "process":  # the writer exists before the save measured
        ckptfs.async_save({"w": torch.ones(4)}, f"{a.root}/warm", writer="process").result(120)
        writer = default_saver("process").writer_pid
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS (ru_maxrss would carry the launcher's peak across exec)
    before = _status("self", "VmRSS")
    sampler = Sampler(writer) if writer is not None else None
    t0 = time.perf_counter()
    if a.mode == "sync":
        ckptfs.save(state, f"{a.root}/ck", host_memory_limit=limit)
        staged = done = time.perf_counter() - t0
    else:
        h = ckptfs.async_save(state, f"{a.root}/ck", writer=a.mode, host_memory_limit=limit)
        h.wait_staged(600)
        staged = time.perf_counter() - t0
        h.result(600)
        done = time.perf_counter() - t0
    train = _status("self", "VmHWM") - before
    side = sampler.growth() if sampler is not None else 0
    ckptfs.close()
    got: dict = {k: torch.empty(v.shape) for k, v in state.items() if k != "small"}
    got["small"] = [torch.empty(i + 1, dtype=torch.int64) for i in range(50)]
    ckptfs.load(got, f"{a.root}/ck")
    exact = all(torch.equal(got[k], v) for k, v in state.items() if k != "small") and all(
        torch.equal(t, torch.arange(i + 1)) for i, t in enumerate(got["small"]))
    return {"mode": a.mode, "limit_mib": a.limit_mib, "state_mib": round(
        sum(v.numel() * 4 for k, v in state.items() if k != "small") / MiB),
        "train_growth_mib": train / MiB, "writer_growth_mib": side / MiB,
        "growth_mib": (train + side) / MiB, "staged_s": staged, "done_s": done,
        "bit_exact": exact}


def measure(mode: str, limit_mib: int | None, root: str, *, gb: float, tensor_mib: int,
            layout: str = "contiguous", timeout: float = 900) -> dict:
    """Run one case in a fresh process (a spawned rank of its own); its measurements."""
    from bench.worker import on_own_rank

    case = argparse.Namespace(mode=mode, root=root, gb=gb, tensor_mib=tensor_mib, layout=layout,
                              limit_mib=limit_mib or 0)
    return on_own_rank(child, case, timeout=timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.host_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=2.0, help="state size (GB of fp32)")
    p.add_argument("--tensor-mib", type=int, default=32, help="MiB of each large tensor")
    p.add_argument("--limit-mib", type=int, default=256, help="host_memory_limit (0: none)")
    p.add_argument("--modes", nargs="+", default=["thread", "process", "sync"],
                   choices=["thread", "process", "sync"])
    p.add_argument("--layout", choices=["contiguous", "transposed"], default=None,
                   help="tensor layout (default: transposed for sync, contiguous otherwise)")
    p.add_argument("--root", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--no-save", action="store_true", help="print only, write no results file")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the results file goes (default bench/results/)")
    a = p.parse_args(argv)
    import tempfile

    rows = []
    for mode in a.modes:  # one case at a time: each holds the state in memory
        layout = a.layout or ("transposed" if mode == "sync" else "contiguous")
        with tempfile.TemporaryDirectory(prefix="ckptfs-hostmem-", dir=a.root) as root:
            r = measure(mode, a.limit_mib or None, root, gb=a.gb, tensor_mib=a.tensor_mib,
                        layout=layout)
        r["layout"] = layout
        r["within_target"] = r["growth_mib"] <= a.limit_mib + SLACK_MIB if a.limit_mib else None
        rows.append(r)
        print(f"{mode:8s} {layout:11s} limit {a.limit_mib} MiB, state {r['state_mib']} MiB: "
              f"growth {r['growth_mib']:.0f} MiB (training {r['train_growth_mib']:.0f}, "
              f"writer {r['writer_growth_mib']:.0f}), staged {r['staged_s']:.2f} s, "
              f"done {r['done_s']:.2f} s, bit-exact {r['bit_exact']}", flush=True)
    if not a.no_save:
        a.results.mkdir(parents=True, exist_ok=True)
        path = a.results / f"host_memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
        path.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "cpus": os.cpu_count(), "python": platform.python_version(),
                                    "gb": a.gb, "rows": rows},
                                   indent=1) + "\n")
        print(f"results: {path}")
    return 0 if all(r["bit_exact"] and r["within_target"] is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
