"""Delta checkpoints (docs/guide/delta.md), one process, every number from the same run:

- ``save``: a fine-tuning-shaped state (``--mb`` MiB of frozen bf16 weights, tensors of
  ``--tensor-mb`` MiB, plus trainable fp32 adapters holding ``--trainable`` of the parameters
  with their two Adam moments). The whole state is saved once with hashes (the base); then,
  alternating, ``--reps`` times each after the adapters and moments changed: (1) the delta save
  of the whole state on that base, (2) a plain save of the changed tensors alone (the adapters
  and moments: what a delta cannot avoid writing), (3) the fsync floor of those bytes
  (bench/floors.py ``write_fsync``: one file, plain ``os.write`` calls, one ``fsync``). Targets:
  the delta writes <= 1.05x the changed bytes, and takes <= 1.5x the time of (2).
- ``load``: the delta checkpoint against a self-contained checkpoint of the same state,
  alternating, page cache dropped before each where the machine allows it (else warm);
  target <= 1.1x.
- ``manager``: ``--steps`` manager saves with ``SaveOptions(delta=True)`` and
  ``Retention(keep_last=3)``, the adapters changed at every step: the bytes on disk at the end
  against base + 3 x changed + the indexes.

    python -m bench.delta [--mb 1024] [--reps 5] [--steps 50] [--manager-mb 128]

Results: bench/results/delta-<time>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

import ckptfs
from bench.floors import write_fsync
from bench.worker import drop_caches

MiB = 1 << 20


def make_state(mb: float, tensor_mb: int, trainable: float) -> dict[str, Any]:
    """Frozen bf16 weights of ``mb`` MiB and fp32 adapters of ``trainable`` of the parameters
    (about; at least one row of 1024) with Adam's ``exp_avg`` and ``exp_avg_sq``."""
    g = torch.Generator().manual_seed(0)
    rows = max(1, int(mb * MiB) // 2048)
    per = max(1, tensor_mb * MiB // 2048)
    state: dict[str, Any] = {
        f"base.{i}.weight": torch.randn(min(per, rows - s), 1024, generator=g).bfloat16()
        for i, s in enumerate(range(0, rows, per))}
    a_rows = max(1, int(rows * trainable))
    for name in ("adapter", "exp_avg", "exp_avg_sq"):
        state[f"lora.{name}"] = torch.randn(a_rows, 1024, generator=g)
    state["step"] = 0
    return state


def changed_of(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k.startswith("lora.")}


def train_step(state: dict[str, Any]) -> None:
    """What a step changes: the adapters and their moments, in place."""
    for v in changed_of(state).values():
        v.add_(1e-3)
    state["step"] += 1


def nbytes(state: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def data_bytes(path: str) -> int:
    """Bytes of the files the checkpoint's index lists (its data files)."""
    return sum(ckptfs.load_metadata(path).files.values())


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_save(state: dict[str, Any], root: str, reps: int, reuse: bool,
               threads: int | None = None) -> dict[str, Any]:
    """Delta save / changed tensors alone / fsync floor, alternating (see the module doc);
    ``reuse``: the delta saves reuse the hashes of unchanged tensors (``reuse_hashes``);
    ``threads``: ``SaveOptions.copy_threads``, the threads hashing the chunks."""
    base = os.path.join(root, "base")
    opts = ckptfs.SaveOptions(hashes=True, reuse_hashes=reuse, copy_threads=threads)
    ckptfs.save(state, base, options=opts)
    changed = changed_of(state)
    rows: dict[str, list[float]] = {"delta": [], "changed_alone": [], "fsync_floor": []}
    written: list[int] = []
    for i in range(reps):
        train_step(state)
        d, c = os.path.join(root, f"delta-{i}"), os.path.join(root, f"changed-{i}")
        floor = os.path.join(root, f"floor-{i}.bin")
        order: list[tuple[str, Callable[[], Any]]] = [
            ("delta", functools.partial(ckptfs.save, state, d, base=base, options=opts)),
            ("changed_alone", functools.partial(ckptfs.save, changed, c)),
            ("fsync_floor", functools.partial(write_fsync, floor, list(changed.values())))]
        for name, fn in order if i % 2 == 0 else order[::-1]:
            os.sync()
            rows[name].append(timed(fn))
        written.append(data_bytes(d))
        for p in (c, floor) if i < reps - 1 else (floor,):
            shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else os.remove(p)
    med = {k: statistics.median(v) for k, v in rows.items()}
    changed_bytes = nbytes(changed)
    return {"seconds": rows, "median": med, "changed_bytes": changed_bytes, "reuse_hashes": reuse,
            "copy_threads": threads,
            "frozen_bytes": nbytes(state) - changed_bytes, "delta_written": written,
            "written_x_changed": max(written) / changed_bytes,
            "time_x_changed_alone": med["delta"] / med["changed_alone"],
            "time_x_fsync_floor": med["delta"] / med["fsync_floor"],
            "changed_alone_written": data_bytes(c), "delta": d}


def bench_load(state: dict[str, Any], delta: str, root: str, reps: int) -> dict[str, Any]:
    """The delta checkpoint against a self-contained one of the same state, alternating."""
    whole = os.path.join(root, "whole")
    ckptfs.save(state, whole)
    target = {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v
              for k, v in state.items()}
    rows: dict[str, list[float]] = {"delta": [], "self_contained": []}
    cold = True
    for i in range(reps):
        order = [("delta", delta), ("self_contained", whole)]
        for name, url in order if i % 2 == 0 else order[::-1]:
            cold = drop_caches() and cold
            rows[name].append(timed(lambda url=url: ckptfs.load(target, url)))
    assert all(torch.equal(target[k], v) for k, v in state.items()
               if isinstance(v, torch.Tensor))
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"seconds": rows, "median": med, "cold": cold,
            "time_x_self_contained": med["delta"] / med["self_contained"]}


def bench_manager(mb: float, tensor_mb: int, trainable: float, steps: int, root: str,
                  reuse: bool) -> dict[str, Any]:
    """``steps`` delta manager saves, keep_last=3: the bytes on disk against the bound."""
    state = make_state(mb, tensor_mb, trainable)
    url = os.path.join(root, "run")
    t0 = time.perf_counter()
    with ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(
            retention=ckptfs.Retention(keep_last=3), save=ckptfs.SaveOptions(delta=True, reuse_hashes=reuse),
            preemption=ckptfs.PreemptionPolicy(signals=()))) as mgr:
        for step in range(1, steps + 1):
            train_step(state)
            mgr.save_sync(step, state)
        kept = mgr.steps()
    seconds = time.perf_counter() - t0
    steps_dirs = [os.path.join(url, d) for d in sorted(os.listdir(url))]
    indexes = sum(os.path.getsize(os.path.join(d, ckptfs.INDEX_FILE)) for d in steps_dirs
                  if os.path.exists(os.path.join(d, ckptfs.INDEX_FILE)))
    changed = nbytes(changed_of(state))
    frozen = nbytes(state) - changed
    headers = sum(_headers(d) for d in steps_dirs)
    bound = frozen + changed + 3 * changed + indexes  # the first step holds its adapters too
    on_disk = disk_bytes(url)
    return {"steps": steps, "kept": kept, "on_disk": on_disk, "frozen_bytes": frozen,
            "changed_bytes": changed, "indexes": indexes, "file_headers": headers,
            "bound": bound, "on_disk_x_bound": on_disk / bound,
            "within_bound_plus_headers": on_disk <= bound + headers, "seconds": seconds,
            "whole_steps_would_be": len(kept) * (frozen + changed)}


def _headers(step: str) -> int:
    """Bytes of a step's data files that are not tensor bytes (the safetensors headers)."""
    index = ckptfs.load_metadata(step)
    own = sum(c.byte_length or 0 for t in index.tensors.values() for c in t.chunks
              if c.base is None and c.file is not None)
    return sum(index.files.values()) - own


def report(r: dict[str, Any]) -> None:
    s, ld, m = r.get("save"), r.get("load"), r.get("manager")
    if s:
        med = s["median"]
        print(f"save{' (reuse_hashes)' if s['reuse_hashes'] else ''}: changed "
              f"{s['changed_bytes'] / MiB:.1f} MiB of "
              f"{(s['changed_bytes'] + s['frozen_bytes']) / MiB:.1f} MiB; delta wrote "
              f"{s['written_x_changed']:.4f}x the changed bytes; delta {med['delta']:.3f} s, "
              f"changed alone {med['changed_alone']:.3f} s, fsync floor {med['fsync_floor']:.3f} s:"
              f" {s['time_x_changed_alone']:.2f}x changed alone (target <= 1.5x), "
              f"{s['time_x_fsync_floor']:.2f}x the floor")
    if ld:
        med = ld["median"]
        print(f"load ({'cold' if ld['cold'] else 'warm'}): delta {med['delta']:.3f} s, "
              f"self-contained {med['self_contained']:.3f} s: {ld['time_x_self_contained']:.2f}x "
              f"(target <= 1.1x)")
    if m:
        print(f"manager: {m['steps']} steps, kept {m['kept']}: {m['on_disk'] / MiB:.1f} MiB on "
              f"disk, bound {m['bound'] / MiB:.1f} MiB ({m['on_disk_x_bound']:.5f}x; within it "
              f"with the {m['file_headers']} B of file headers: {m['within_bound_plus_headers']});"
              f" whole "
              f"steps would hold {m['whole_steps_would_be'] / MiB:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1024, help="frozen MiB (default 1024)")
    ap.add_argument("--tensor-mb", type=int, default=64, help="MiB per frozen tensor")
    ap.add_argument("--trainable", type=float, default=0.02, help="share of trainable params")
    ap.add_argument("--reps", type=int, default=5, help="runs of each case (medians)")
    ap.add_argument("--steps", type=int, default=50, help="manager saves")
    ap.add_argument("--manager-mb", type=float, default=128, help="frozen MiB of the manager run")
    ap.add_argument("--reuse-hashes", action="store_true",
                    help="SaveOptions(reuse_hashes=True): unchanged tensors are not hashed again")
    ap.add_argument("--copy-threads", type=int, default=None,
                    help="SaveOptions.copy_threads: the threads hashing the chunks (default: "
                         "min(4, CPUs))")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temp dir)")
    ap.add_argument("--out", default=None, help="results file (default bench/results/delta-*.json)")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ckptfs-delta-", dir=args.dir)
    result: dict[str, Any] = {"mb": args.mb, "reps": args.reps, "trainable": args.trainable,
                              "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                              "date": time.strftime("%Y-%m-%d")}
    try:
        state = make_state(args.mb, args.tensor_mb, args.trainable)
        result["save"] = bench_save(state, root, args.reps, args.reuse_hashes, args.copy_threads)
        result["load"] = bench_load(state, result["save"].pop("delta"), root, args.reps)
        del state
        result["manager"] = bench_manager(args.manager_mb, args.tensor_mb, args.trainable,
                                          args.steps, root, args.reuse_hashes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["load_average_after"] = os.getloadavg()
    report(result)
    out = args.out or os.path.join(os.path.dirname(__file__), "results",
                                   f"delta-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"# results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
