"""What each spawned rank does: build the state once, then alternate the checkpointers.

One spawn per world size. In every repetition each checkpointer saves (if this world saves),
then each loads, cold (page cache dropped first) and then warm; the order of the checkpointers
flips every repetition. Unrecorded warm-up repetitions come first: on a 2-vCPU cloud VM the first writes
into never-touched memory (page cache included) cost several times more kernel time.
Rank 0 appends one JSON record per measurement to the results file.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from bench.libs import Checkpointer, checkpointers, dir_bytes
from bench.synthetic import check_state, make_state, state_specs
from ckptfs.testing.ranks import run_ranks

RESHARD_SOURCE = 2  #: resharded loads read the checkpoints saved by this world size


def proc_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def on_own_rank(fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
    """``fn(*args)`` on a spawned rank of its own (``run_ranks``, one rank: a process that
    holds nothing of the bench's, or a pooled one under ``pooled``); its result, which must be
    JSON, comes back through a file. ``fn`` is a module-level function (it is pickled)."""
    with tempfile.TemporaryDirectory(prefix="ckptfs-bench-") as tmp:
        report = os.path.join(tmp, "result.json")
        run_ranks(1, _reporting_rank, fn, args, report, timeout=timeout)
        with open(report) as f:
            return json.load(f)


def _reporting_rank(rank: int, world: int, fn: Callable[..., Any], args: tuple, report: str) -> None:
    with open(report, "w") as f:
        json.dump(fn(*args), f)


#: set (to anything but "") to keep the page cache: ``drop_caches`` then drops nothing and
#: returns False, as where it is not permitted. The test suite sets it: a drop there would evict
#: the files every other test's processes are reading, and a bench's smoke run measures nothing
KEEP_CACHES = "CKPTFS_BENCH_KEEP_CACHES"


def drop_caches() -> bool:
    """sync; echo 3 > /proc/sys/vm/drop_caches. False if not permitted (or ``$KEEP_CACHES``
    is set)."""
    if os.environ.get(KEEP_CACHES):
        return False
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes ({} where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            return {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f)}
    except OSError:
        return {}


def settle(below: int = 32 << 20, limit: float = 10.0) -> float:
    """Sync, then wait until the kernel's dirty and under-write-back page cache (Dirty +
    Writeback, /proc/meminfo, the whole host's) is below ``below`` bytes, at most ``limit``
    seconds: the save timed next pays for no earlier write (another process's included).
    Returns the seconds waited."""
    t0 = time.perf_counter()
    os.sync()
    while time.perf_counter() - t0 < limit:
        m = meminfo()
        if m.get("Dirty", 0) + m.get("Writeback", 0) < below:
            break
        time.sleep(0.05)
    return time.perf_counter() - t0


def ckpt_path(root: str, ck: Checkpointer, world: int) -> str:
    safe = ck.name.replace("[", "_").replace("]", "").replace("/", "_")
    return os.path.join(root, f"{safe}-w{world}")


class Recorder:
    def __init__(self, rank: int, out: str, base: dict[str, Any]) -> None:
        self.rank, self.out, self.base = rank, out, base

    def measure(self, fn: Callable[[], Any]) -> tuple[float, Any, int]:
        """Run ``fn`` on every rank between barriers; (seconds, result, storage bytes read)."""
        dist.barrier()
        io0 = proc_read_bytes()
        t0 = time.perf_counter()
        result = fn()
        dist.barrier()
        seconds = time.perf_counter() - t0
        return seconds, result, proc_read_bytes() - io0

    def emit(self, **fields: Any) -> None:
        """Sum the per-rank numeric fields named ``sum_*`` over ranks; rank 0 writes a record
        (warm-up runs, rep < 0, are not recorded)."""
        if fields["rep"] < 0:
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, fields)
        if self.rank != 0:
            return
        rec = dict(self.base)
        for k, v in fields.items():
            if k.startswith("sum_"):
                rec[k[4:]] = sum(g[k] for g in gathered)
            else:
                rec[k] = v
        with open(self.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"  {rec['case']:<14} {rec['lib']:<32} {rec['kind']:<5} rep {rec['rep']}: "
              f"{rec['seconds']:.2f} s", flush=True)


def run_world(rank: int, world: int, cfg: dict[str, Any]) -> None:
    specs = state_specs(cfg["gb"])
    cks = checkpointers([tuple(b) for b in cfg["backends"]])
    saves = world in cfg["worlds"]
    loads: list[tuple[str, int]] = []  # (case, world that saved the checkpoint)
    if saves:
        loads.append((f"load {world}", world))
    if world in cfg["reshard_targets"]:
        loads.append((f"reshard {RESHARD_SOURCE}->{world}", RESHARD_SOURCE))
    source = make_state(specs, rank, world, zeros=False) if saves else None
    target = make_state(specs, rank, world, zeros=True)
    total = sum(s.nbytes for s in specs)
    rec = Recorder(rank, cfg["out"], {"world": world, "state_bytes": total})
    cold = cfg["drop_caches"]
    for rep in range(-cfg["warmup"], cfg["reps"]):  # rep < 0: warm-up, not recorded
        order = cks if rep % 2 == 0 else cks[::-1]
        if saves:
            for ck in order:
                path = ckpt_path(cfg["root"], ck, world)
                if rank == 0:
                    ck.remove(path)
                dist.barrier()
                secs, _, _ = rec.measure(lambda ck=ck, path=path: ck.save(source, path))
                rec.emit(case=f"save {world}", lib=ck.name, kind="save", rep=rep, seconds=secs,
                         stored=dir_bytes(path) if rank == 0 else 0)
        for case, src_world in loads:
            for ck in order:
                path = ckpt_path(cfg["root"], ck, src_world)
                kinds = ["cold", "warm"] if cfg["warm"] and rep >= 0 else ["cold"]
                for kind in kinds:
                    check = cfg["verify"] and rep == 0 and kind == "cold"
                    if check:  # the previous run filled it: start from zeros
                        for t in target.values():
                            t.to_local().zero_()
                    dropped = False
                    if kind == "cold" and cold:
                        dist.barrier()
                        dropped = drop_caches() if rank == 0 else True
                    secs, nb, disk = rec.measure(lambda ck=ck, path=path: ck.load(target, path))
                    bad = check_state(specs, target, rank, world) if check else []
                    rec.emit(case=case, lib=ck.name, kind=kind, dropped=dropped, rep=rep,
                             seconds=secs, sum_read=nb.read, sum_needed=nb.needed,
                             sum_disk_read=disk, sum_bad=len(bad), bad_keys=bad[:5])


def spawn_world(world: int, cfg: dict[str, Any]) -> None:
    """Run ``run_world`` on ``world`` spawned gloo ranks."""
    run_ranks(world, run_world, cfg)
