"""CheckpointManager: restore from a valid local tier vs from the S3 endpoint (moto), and the
blocking time of a manager save vs plain ``ckptfs.async_save``, in one run.

    .venv/bin/python -m bench.manager [--mb 256] [--runs 3]

1. One process saves ~``--mb`` MiB (bench/s3_quick.py's state) through a manager with a local
   tier (``local_dir`` on local disk) to ``s3://bench/manager`` on a moto server in its own
   process.
2. Restore, alternating ``--runs`` times: the same manager (every local copy intact: the data
   is read once from the local tier, each chunk checked as it lands; only the index comes from
   S3) and a manager over the same URL without a local tier (everything from S3). Floor:
   reading the local files (page cache) once, in each round. "read locally" counts the bytes read only to
   check them too (none when every chunk is read whole).
3. Blocking time, alternating ``--runs`` times over the same state: ``mgr.save(step, sd)`` and
   ``ckptfs.async_save(sd, url)`` until ``staged`` resolves (the caller may then change its
   tensors), each waited for (``done``) before the next. Floor: ``copy_`` of the state into
   buffers that already exist.

Every restore is checked bit for bit. Medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from dataclasses import replace

import torch

import ckptfs
from bench.s3_quick import BUCKET, make_state, nbytes, same, start_moto, storage_options

warnings.filterwarnings("ignore")
MB = 1 << 20


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def read_all(root: str) -> int:
    n = 0
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                n += len(fh.read())
    return n


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    proc, endpoint = start_moto()
    work = tempfile.mkdtemp(prefix="ckptfs-bench-manager-")
    try:
        opts = storage_options(endpoint)
        state = make_state(args.mb)
        size = nbytes(state)
        print(f"# moto_server {endpoint}; torch {torch.__version__}; state {size / MB:.0f} MiB; "
              f"load average {os.getloadavg()[0]:.1f}")
        url, local = f"s3://{BUCKET}/manager", os.path.join(work, "local")
        policies = ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_last=2),
                                         preemption=ckptfs.PreemptionPolicy(signals=()))
        tiered = ckptfs.CheckpointManager(
            url, replace(policies, tiers=ckptfs.TierOptions(local_dir=local)), storage_options=opts)
        remote_only = ckptfs.CheckpointManager(url, policies, storage_options=opts)
        tiered.save_sync(1, state)

        def restore(mgr: ckptfs.CheckpointManager) -> float:
            sd = make_state(args.mb, fill=False)
            t = timed(lambda: mgr.restore(sd))
            assert same(sd, state)
            return t

        times: dict[str, list[float]] = {"local tier": [], "S3 (moto)": []}
        step_dir = os.path.join(local, "step-00000001")
        floor_bytes, floors = read_all(step_dir), []  # the size; and the page cache is warm
        remote_bytes, local_bytes = {}, {}
        for _ in range(args.runs):
            times["local tier"].append(restore(tiered))
            remote_bytes["local tier"] = tiered.last_restore.remote_bytes
            local_bytes["local tier"] = (tiered.last_restore.local_bytes
                                         + tiered.last_restore.checked_bytes)
            times["S3 (moto)"].append(restore(remote_only))
            remote_bytes["S3 (moto)"] = remote_only.last_restore.remote_bytes
            local_bytes["S3 (moto)"] = remote_only.last_restore.local_bytes
            floors.append(timed(lambda: read_all(step_dir)))
        floor = statistics.median(floors)
        loc, rem = statistics.median(times["local tier"]), statistics.median(times["S3 (moto)"])
        print(f"\n## restore, {size / MB:.0f} MiB, 1 process (median of {args.runs})\n")
        print("| from | seconds | data bytes read from S3 | read locally | x local tier |")
        print("|---|---|---|---|---|")
        print(f"| local tier (all copies intact; index from S3) | {loc:.3f} | "
              f"{remote_bytes['local tier']} | {local_bytes['local tier']} | 1.00x |")
        print(f"| S3 (moto), no local tier | {rem:.3f} | {remote_bytes['S3 (moto)']} | "
              f"{local_bytes['S3 (moto)']} | {rem / loc:.2f}x slower |")
        print(f"| floor: reading the local files once (page cache) | {floor:.3f} | | "
              f"{floor_bytes} | {floor / loc:.2f}x |")

        # blocking time: manager save vs plain async_save, until `staged`
        bufs = {k: {n: torch.empty_like(t) for n, t in v.items()}
                for k, v in state.items() if isinstance(v, dict)}

        def copy_floor() -> float:
            return timed(lambda: [bufs[k][n].copy_(t) for k, v in state.items()
                                  if isinstance(v, dict) for n, t in v.items()])

        blocking: dict[str, list[float]] = {"manager save": [], "async_save": [], "copy_": []}
        step = 2
        for _ in range(args.runs + 1):  # the first round allocates the staging buffers
            t0 = time.perf_counter()
            h = tiered.save(step, state)
            h.wait_staged()
            blocking["manager save"].append(time.perf_counter() - t0)
            h.result()
            step += 1
            t0 = time.perf_counter()
            h = ckptfs.async_save(state, f"s3://{BUCKET}/async", storage_options=opts,
                                  overwrite=True)
            h.wait_staged()
            blocking["async_save"].append(time.perf_counter() - t0)
            h.result()
            blocking["copy_"].append(copy_floor())
        med = {k: statistics.median(v[1:]) for k, v in blocking.items()}
        print(f"\n## blocking time of a save (call -> staged), {size / MB:.0f} MiB, median of "
              f"{args.runs} after a first round\n")
        print("| save | seconds | x async_save |")
        print("|---|---|---|")
        for k in ("manager save", "async_save", "copy_"):
            name = {"copy_": "floor: copy_ into existing buffers"}.get(k, k)
            print(f"| {name} | {med[k]:.3f} | {med[k] / med['async_save']:.2f}x |")
        print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")
        tiered.close()
        remote_only.close()
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
