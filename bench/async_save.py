"""``python -m bench.async_save`` (``make bench-async``): asynchronous save, ckptfs vs DCP.

One spawned gloo rank (``--world`` for more) holds a state of fp32 DTensors (``--mb``, default
500 MB) and saves it over and over with each checkpointer in turn, the order rotating every
repetition, all in the same process:

- ``ckptfs``: ``ckptfs.async_save`` (background thread, reused staging buffers, the default
  ``SaveOptions.background_nice`` of 10: checksums and writes at nice 10 once staged);
- ``ckptfs-nice0``: the same with ``background_nice=0`` (the caller's priority throughout);
- ``ckptfs-copy1``: the default, but staging copies on one thread (``copy_threads=1``; the
  default cuts large copies into pieces over min(4, CPUs) threads);
- ``ckptfs-gil``: ``background_nice=0`` and the chunk checksums computed as before this option
  existed (google_crc32c in 1 MiB pieces holding the GIL, ``time.sleep(0)`` between them)
  instead of libcrc32c without the GIL;
- ``ckptfs-proc``: ``ckptfs.async_save(writer="process")``: the same stage into shared
  memory, the write, checksums and commit in a persistent writer process per rank;
- ``DCP-stager``: ``dcp.async_save`` with one ``DefaultStager(use_async_staging=True)`` reused
  by every save (its staging storages are cached across saves; on torch 2.11, which cannot
  reuse one, a new stager per save: ``bench.libs.DcpStager``);
- ``DCP-thread``: ``dcp.async_save`` without a stager (the call stages, then returns);
- ``DCP-proc``: ``dcp.async_save(async_checkpointer_type=PROCESS)`` with a reused shared-memory
  ``DefaultStager``;
- ``plain-write``: no checkpointer, the floor of the background write: a thread at nice 10 (as
  ckptfs's writers) writes the tensors' bytes into one file with ``os.write`` and fsyncs it
  (staged at once: it copies nothing). Its slowdown is what writing these bytes through the
  page cache costs the loop by itself (kernel copies, write-back, memory bandwidth).

Each repetition first measures the floor three times: ``copy_`` of every local tensor into
buffers allocated beforehand, with 1 torch thread and with all of them (median over all); and
the write floor once: plain ``os.write`` of every local tensor into one file, then ``fsync``
(what a save must at least do to be durable; time-to-done is also shown as a multiple of it). Then
each checkpointer saves twice: once idle (time-to-staged, time-to-done), once with a training
loop running (a CPU matmul step on 1 torch thread). The slowdown compares the loop's median step
time while the save writes in the background (from ``staged`` to ``done``) with its median step
time in the windows just before and just after that save ("slowdown"), and the mean step times
likewise ("slowdown mean": the loop's throughput; a median does not see one long stall, such as
a checksum holding the GIL for a whole chunk). RSS growth per checkpointer adds up
the RSS change across each of its saves after its first (child processes not counted); after
each save glibc's free memory is returned to the OS (``malloc_trim``), so what one checkpointer
leaves behind does not weigh on the next. Steady
state = the 3rd save of a checkpointer onward; its first save is reported apart. All data is
fsynced (ckptfs ``StoreOptions.fsync``, DCP ``sync_files=True``).
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
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ckptfs
from bench.floors import write_fsync
from bench.libs import DcpStager
from bench.run import table
from ckptfs.testing.ranks import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
TENSOR_MB = 25
TARGETS = {"staged_vs_dcp": 0.5, "staged_vs_floor": 1.3, "done_vs_dcp": 0.5, "slowdown": 0.10,
           "rss_growth": 0.05}


# -- the state and the stand-in training step -----------------------------------------------------
def make_state(mb: int, world: int, plain: bool = False) -> dict[str, Any]:
    """``mb`` MB of fp32 in tensors of 25 MB (rows x 1024), row-sharded DTensors over ``world``
    (``plain``: plain tensors, world 1)."""
    if plain:
        rows = TENSOR_MB * 10**6 // (4 * 1024)
        return {f"layers.{i}.weight": torch.randn(rows, 1024)
                for i in range(max(1, mb // TENSOR_MB))}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    rows = TENSOR_MB * 10**6 // (4 * 1024)
    out = {}
    for i in range(max(1, mb // TENSOR_MB)):
        rank = mesh.get_local_rank()
        per = -(-rows // world)
        lo, hi = min(rank * per, rows), min(rank * per + per, rows)
        local = torch.randn(hi - lo, 1024)
        out[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                       shape=torch.Size((rows, 1024)),
                                                       stride=(1024, 1))
    return out


class Trainer:
    """A training step on 1 torch thread: 4 matmuls of 256x256 (compute) and 100 small ones
    (Python and dispatcher bound, like a GPU step's kernel launches)."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(256, 256, generator=g) / 16
        self.s = torch.randn(32, 32, generator=g) / 6

    def step(self) -> None:
        x = self.a
        for _ in range(4):
            x = torch.tanh(x @ self.a)
        y = self.s
        for _ in range(100):
            y = torch.tanh(y @ self.s)

    def run(self, until: Callable[[], bool], min_steps: int = 0) -> list[float]:
        times = []
        while len(times) < min_steps or not until():
            t0 = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - t0)
        return times


def trim() -> None:
    """Give glibc's free heap memory back to the OS (``malloc_trim``), so one checkpointer's
    leftovers (DCP's thread mode frees a full copy per save) do not slow the next one."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def local_tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    return [t.to_local() if hasattr(t, "to_local") else t for t in sd.values()]


# -- the checkpointers ----------------------------------------------------------------------------
Waits = tuple[Callable[[], None], Callable[[], None]]  #: (wait staged, wait done)


class Ckptfs:
    def __init__(self, name: str = "ckptfs") -> None:
        from ckptfs.layout import checksum

        self.name = name
        self.nogil = checksum._extend_nogil if name != "ckptfs-gil" else None
        self.options = {"ckptfs": None, "ckptfs-proc": None,
                        "ckptfs-copy1": ckptfs.SaveOptions(copy_threads=1)}.get(
            name, ckptfs.SaveOptions(background_nice=0))
        self.writer = "process" if name == "ckptfs-proc" else "thread"

    def start(self, sd: dict[str, Any], path: str) -> Waits:
        from ckptfs.layout import checksum

        checksum._extend_nogil = self.nogil  # saves run one at a time: this one's setting
        h = ckptfs.async_save(sd, path, options=self.options, writer=self.writer)
        return h.wait_staged, lambda: h.result()

    def close(self) -> None:
        ckptfs.close()


class Dcp:
    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.name = f"DCP-{mode}"
        self.stager = None
        if mode in ("stager", "proc"):
            # pinned memory and non-blocking copies need CUDA; shared memory only for the process
            self.stager = DcpStager(use_pinned_memory=False, use_shared_memory=mode == "proc",
                                    use_async_staging=True, use_non_blocking_copy=False)

    def start(self, sd: dict[str, Any], path: str) -> Waits:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        writer = dcp.FileSystemWriter(path, sync_files=True)
        kind = AsyncCheckpointerType.PROCESS if self.mode == "proc" else AsyncCheckpointerType.THREAD
        r = dcp.async_save(sd, storage_writer=writer,
                           async_stager=None if self.stager is None else self.stager.get(),
                           async_checkpointer_type=kind)
        if self.stager is None:  # thread mode: the call staged; a plain future
            return (lambda: None), (lambda: r.result())
        return (lambda: r.staging_completion.result()), (lambda: r.upload_completion.result())

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


class PlainWrite:
    """The write floor as a background job (see the module docstring)."""

    name = "plain-write"

    def __init__(self, srcs: list[torch.Tensor]) -> None:
        self.srcs = srcs

    def start(self, sd: dict[str, Any], path: str) -> Waits:
        from ckptfs.io.local_store import lower_priority

        def go() -> None:
            lower_priority(ckptfs.SaveOptions().background_nice)
            os.makedirs(path, exist_ok=True)
            write_floor(self.srcs, os.path.join(path, "plain.bin"))

        t = threading.Thread(target=go, name="plainWrite")
        t.start()
        return (lambda: None), t.join

    def close(self) -> None:
        pass


def make_checkpointers(names: list[str], world: int, srcs: list[torch.Tensor]) -> list[Any]:
    out: list[Any] = []
    for n in names:
        if n in ("ckptfs", "ckptfs-gil", "ckptfs-nice0", "ckptfs-copy1", "ckptfs-proc"):
            out.append(Ckptfs(n))
        elif n == "plain-write":
            out.append(PlainWrite(srcs))
        else:
            out.append(Dcp(n.removeprefix("DCP-")))
    return out


# -- one rank -------------------------------------------------------------------------------------
def floor(srcs: list[torch.Tensor], bufs: list[torch.Tensor], threads: int) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        t0 = time.perf_counter()
        for s, b in zip(srcs, bufs, strict=True):
            b.copy_(s)
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(before)


def write_floor(srcs: list[torch.Tensor], path: str) -> float:
    """Seconds to write every tensor's bytes into one new file with ``os.write``, then fsync."""
    t0 = time.perf_counter()
    write_fsync(path, srcs)
    took = time.perf_counter() - t0
    os.unlink(path)
    return took


def rank_main(rank: int, world: int, cfg: dict[str, Any]) -> None:
    import torch.distributed as dist

    threads = torch.get_num_threads()
    sd = make_state(cfg["mb"], world, cfg.get("plain", False))
    srcs = local_tensors(sd)
    bufs = [torch.empty_like(t) for t in srcs]
    floor(srcs, bufs, 1)  # fault the floor's buffers in
    cks = make_checkpointers(cfg["libs"], world, srcs)
    trainer = Trainer()
    torch.set_num_threads(1)  # the training loop's setting, for every checkpointer alike
    trainer.run(lambda: True, 20)  # warm
    records: list[dict[str, Any]] = []
    saves: dict[str, int] = defaultdict(int)

    def record(**kw: Any) -> None:
        records.append({"rank": rank, **kw})

    def one_save(ck: Any, rep: int, train: bool) -> None:
        path = os.path.join(cfg["root"], ck.name)
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        base: list[float] = []
        if train:
            end = time.perf_counter() + cfg["train_s"] / 2
            base = trainer.run(lambda: time.perf_counter() > end, 5)
        r0 = rss()
        t0 = time.perf_counter()
        wait_staged, wait_done = ck.start(sd, path)
        t_call = time.perf_counter() - t0
        wait_staged()
        t_staged = time.perf_counter() - t0
        during: list[float] = []
        if train:
            box: list[float] = []
            failed: list[BaseException] = []

            def waiter_main() -> None:
                try:
                    wait_done()
                except BaseException as e:  # raised below: a failed save must not hang the loop
                    failed.append(e)
                box.append(time.perf_counter())

            waiter = threading.Thread(target=waiter_main)
            waiter.start()
            during = trainer.run(lambda: bool(box))
            waiter.join()
            if failed:
                raise RuntimeError(f"{ck.name}: the save failed in the background") from failed[0]
            t_done = box[0] - t0
            end = time.perf_counter() + cfg["train_s"] / 2
            base += trainer.run(lambda: time.perf_counter() > end, 5)
        else:
            wait_done()
            t_done = time.perf_counter() - t0
        n = saves[ck.name]
        saves[ck.name] += 1
        record(lib=ck.name, rep=rep, save=n, train=train, call=t_call, staged=t_staged,
               done=t_done, rss_delta=rss() - r0,
               base_step=statistics.median(base) if base else None,
               during_step=statistics.median(during) if during else None,
               base_mean=statistics.fmean(base) if base else None,
               during_mean=statistics.fmean(during) if during else None,
               during_steps=len(during))
        trim()
        dist.barrier()

    for rep in range(cfg["reps"]):
        for _ in range(3):
            record(lib="floor", rep=rep, floor_1=floor(srcs, bufs, 1),
                   floor_n=floor(srcs, bufs, threads), threads=threads)
        dist.barrier()
        record(lib="write_floor", rep=rep,
               write=write_floor(srcs, os.path.join(cfg["root"], f"floor-{rank}.bin")))
        trim()
        dist.barrier()
        k = rep % len(cks)
        for ck in cks[k:] + cks[:k]:
            one_save(ck, rep, train=False)
            one_save(ck, rep, train=True)
        if rank == 0:
            print(f"  rep {rep + 1}/{cfg['reps']} done", flush=True)
    for ck in cks:
        ck.close()
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump(records, f)


# -- the report -----------------------------------------------------------------------------------
def summarize(records: list[dict[str, Any]], state_bytes: int) -> dict[str, Any]:
    floors = [r for r in records if r["lib"] == "floor"]
    writes = [r["write"] for r in records if r["lib"] == "write_floor"]
    out: dict[str, Any] = {
        "floor_1": statistics.median(r["floor_1"] for r in floors),
        "floor_n": statistics.median(r["floor_n"] for r in floors),
        "write_floor": statistics.median(writes) if writes else None,
        "write_floor_range": [min(writes), max(writes)] if writes else None,
        "threads": floors[0]["threads"], "libs": {}}
    by_lib: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["lib"] not in ("floor", "write_floor"):
            by_lib[r["lib"]].append(r)
    for lib, rs in by_lib.items():
        rs.sort(key=lambda r: r["save"])
        idle = [r for r in rs if not r["train"]]
        steady = [r for r in idle if r["save"] >= 2]
        trained = [r for r in rs if r["train"] and r["save"] >= 2 and r["during_steps"]]
        med = statistics.median
        out["libs"][lib] = {
            "first": {k: rs[0][k] for k in ("call", "staged", "done")},
            "staged": med(r["staged"] for r in steady),
            "staged_range": [min(r["staged"] for r in steady), max(r["staged"] for r in steady)],
            "call": med(r["call"] for r in steady),
            "done": med(r["done"] for r in steady),
            "done_range": [min(r["done"] for r in steady), max(r["done"] for r in steady)],
            "slowdown": med(r["during_step"] / r["base_step"] - 1 for r in trained) if trained else None,
            "slowdown_mean": med(r["during_mean"] / r["base_mean"] - 1 for r in trained)
            if trained else None,
            "slowdown_all": [round(r["during_step"] / r["base_step"] - 1, 3) for r in trained],
            "rss_growth": sum(r["rss_delta"] for r in rs[1:]),
            "saves": len(rs),
            "state_bytes": state_bytes,
        }
    return out


def render(s: dict[str, Any], state_bytes: int, load: tuple[float, ...]) -> str:
    libs = s["libs"]
    f1, fn = s["floor_1"], s["floor_n"]
    lines = ["", f"state {state_bytes / 1e6:.0f} MB fp32 per rank; load average at start "
             f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}",
             f"copy_ floor (buffers allocated beforehand): {f1:.3f} s on 1 thread, "
             f"{fn:.3f} s on {s['threads']} threads"]
    wf = s.get("write_floor")
    if wf:
        lines.append(f"write floor (os.write of the same bytes into one file + fsync): {wf:.2f} s "
                     f"(range {s['write_floor_range'][0]:.2f}-{s['write_floor_range'][1]:.2f})")
    lines.append("")
    head = ["checkpointer", "first staged", "first done", "call", "staged", "staged range",
            "done", "done range", "done/write floor", "slowdown", "slowdown mean", "RSS added"]
    rows = []
    for lib, m in libs.items():
        rows.append([lib, f"{m['first']['staged']:.3f}", f"{m['first']['done']:.2f}",
                     f"{m['call']:.3f}", f"{m['staged']:.3f}",
                     f"{m['staged_range'][0]:.3f}-{m['staged_range'][1]:.3f}",
                     f"{m['done']:.2f}", f"{m['done_range'][0]:.2f}-{m['done_range'][1]:.2f}",
                     f"{m['done'] / wf:.2f}x" if wf else "-",
                     "-" if m["slowdown"] is None else f"{100 * m['slowdown']:+.1f}%",
                     "-" if m["slowdown_mean"] is None else f"{100 * m['slowdown_mean']:+.1f}%",
                     f"{m['rss_growth'] / 2**20:+.1f} MiB ({m['saves'] - 1} saves)"])
    lines += ["seconds; steady state = median from the 3rd save on; slowdown = training step time "
              "during the background write vs just before", *table(head, rows)]
    ours, dcp = libs.get("ckptfs"), libs.get("DCP-stager")
    if ours:
        lines += ["", "targets (ckptfs):"]

        def line(what: str, value: float, target: float, fmt: str = "{:.2f}x") -> str:
            ok = "met" if value <= target else "NOT met"
            return f"  {what}: {fmt.format(value)} (target <= {fmt.format(target)}) {ok}"

        if dcp:
            lines.append(line("time-to-staged / DCP-stager's", ours["staged"] / dcp["staged"],
                              TARGETS["staged_vs_dcp"]))
        lines.append(line("time-to-staged / 1-thread copy_ floor", ours["staged"] / f1,
                          TARGETS["staged_vs_floor"]))
        lines.append(f"  (time-to-staged / {s['threads']}-thread copy_ floor: "
                     f"{ours['staged'] / fn:.2f}x)")
        if dcp:
            lines.append(line("time-to-done / DCP-stager's", ours["done"] / dcp["done"],
                              TARGETS["done_vs_dcp"]))
        if wf:
            lines.append(f"  (time-to-done / write floor: {ours['done'] / wf:.2f}x; "
                         f"DCP-stager's: {dcp['done'] / wf:.2f}x)" if dcp else
                         f"  (time-to-done / write floor: {ours['done'] / wf:.2f}x)")
        if ours["slowdown"] is not None:
            lines.append(line("training-loop slowdown (median step)", ours["slowdown"],
                              TARGETS["slowdown"], "{:.1%}"))
            lines.append(line("training-loop slowdown (mean step: throughput)",
                              ours["slowdown_mean"], TARGETS["slowdown"], "{:.1%}"))
        lines.append(line("RSS growth / state", ours["rss_growth"] / state_bytes,
                          TARGETS["rss_growth"], "{:.2%}"))
    return "\n".join(lines)




ALL_LIBS = ["ckptfs", "ckptfs-nice0", "ckptfs-copy1", "ckptfs-gil", "ckptfs-proc", "DCP-stager",
            "DCP-thread", "DCP-proc", "plain-write"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.async_save", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=500, help="state size in MB per rank (default 500)")
    p.add_argument("--reps", type=int, default=6,
                   help="repetitions (2 saves per checkpointer each; default 6 -> 12 saves)")
    p.add_argument("--world", type=int, default=1, help="spawned gloo ranks (default 1)")
    p.add_argument("--libs", default=",".join(ALL_LIBS), help=f"comma list of {ALL_LIBS}")
    p.add_argument("--train-s", type=float, default=1.0,
                   help="seconds of baseline training steps around each trained save (default 1)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--plain", action="store_true",
                   help="plain tensors instead of DTensors (world 1)")
    p.add_argument("--results", type=Path, default=RESULTS,
                   help="where the results file goes (default bench/results/)")
    args = p.parse_args(argv)
    if args.plain and args.world != 1:
        sys.exit("--plain needs --world 1")
    if args.reps < 2:
        sys.exit("--reps needs at least 2 (the steady state is the median from the 3rd save on)")
    libs = [x for x in args.libs.split(",") if x]
    if unknown := set(libs) - set(ALL_LIBS):
        sys.exit(f"unknown checkpointers {sorted(unknown)}; choose from {ALL_LIBS}")
    root = tempfile.mkdtemp(prefix="ckptfs-async-", dir=args.dir)
    out = os.path.join(root, "records.json")
    cfg = {"mb": args.mb, "reps": args.reps, "libs": libs, "train_s": args.train_s,
           "root": root, "out": out, "plain": args.plain}
    load = os.getloadavg()
    state_bytes = max(1, args.mb // TENSOR_MB) * (TENSOR_MB * 10**6 // (4 * 1024)) * 4096
    print(f"bench.async_save: {state_bytes / 1e6:.0f} MB fp32 per rank, world {args.world}, "
          f"{args.reps} reps, {libs}; load average {load[0]:.2f}; dir {root}", flush=True)
    t0 = time.perf_counter()
    try:
        run_ranks(args.world, rank_main, cfg)
        records = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_rank = max(1, args.mb // TENSOR_MB) * (-(-(TENSOR_MB * 10**6 // (4 * 1024)) // args.world)) * 4096
    summary = summarize(records, per_rank)
    report = render(summary, per_rank, load)
    report += f"\nload average at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}"
    print(report)
    args.results.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = args.results / f"{stamp}-async-{args.mb}mb.json"
    path.write_text(json.dumps({
        "config": {k: v for k, v in cfg.items() if k not in ("root", "out")} | {"world": args.world},
        "host": {"cpus": os.cpu_count(), "load_average_start": load,
                 "load_average_end": os.getloadavg(), "platform": platform.platform(),
                 "python": platform.python_version(), "torch": torch.__version__,
                 "ckptfs": ckptfs.__version__},
        "wall_seconds": time.perf_counter() - t0, "summary": summary, "records": records,
        "report": report}, indent=1))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
