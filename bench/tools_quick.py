"""Peak memory and time of the offline tools vs DCP's own conversion, on the same state.

    python -m bench.tools_quick [--gb 1.0] [--tensor-mb 64] [--dir /tmp/ckptfs-bench-tools]

One state of ``--gb`` GB (fp32 and bf16 tensors of ``--tensor-mb`` MB) is saved once with ckptfs
(safetensors_chunks) and once with ``torch.distributed.checkpoint``. Then each job runs in a fresh
spawned process (``run_ranks``, one rank) that reports its peak resident-set rise over its own
baseline after imports (VmHWM, reset through /proc/self/clear_refs) and its wall time:

- ckptfs ``unshard --format torch`` (one file), ``unshard --format hf`` (5 GB shards, tensors
  only), ``convert`` to torch_dist and to zarr-3, ``verify``;
- DCP ``format_utils.dcp_to_torch_save`` (the same one-file ``torch.save`` output; it loads the
  whole state first) and ``torch.load`` + ``torch.save`` of the result as the floor of a naive
  conversion.

The expectation: ckptfs stays near one tensor plus its 64 MiB buffer, DCP near the checkpoint.
Default malloc settings (what a user gets). The machine may be shared: times are indicative.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from bench.worker import on_own_rank
from ckptfs.testing.ranks import RanksFailed

JOBS = ("ckptfs unshard torch", "ckptfs unshard hf", "ckptfs convert torch_dist-1",
        "ckptfs convert zarr-3", "ckptfs verify", "dcp_to_torch_save")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_job(job: str, root: str) -> dict:
    """In a fresh process: import, reset the peak, run, report."""
    import torch  # noqa: F401 - imported before the baseline
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import ckptfs
    import ckptfs.tools.convert
    import ckptfs.tools.unshard
    import ckptfs.tools.verify

    src, dcp_src, out = f"{root}/ckptfs", f"{root}/dcp", f"{root}/out-{job.replace(' ', '-')}"
    shutil.rmtree(out, ignore_errors=True)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    t0 = time.perf_counter()
    if job == "ckptfs unshard torch":
        ckptfs.unshard(src, out, format="torch")
    elif job == "ckptfs unshard hf":
        ckptfs.unshard(src, out, format="hf", strategy="chunks", chunk_size=5 * 10**9, keys=["model"])
    elif job.startswith("ckptfs convert"):
        name, _, version = job.split()[-1].partition("-")
        ckptfs.convert(src, out, backend=name, backend_version=int(version))
    elif job == "ckptfs verify":
        assert ckptfs.verify(src).ok
    else:
        os.makedirs(out)
        dcp_to_torch_save(dcp_src, f"{out}/checkpoint.pt")
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM") - before
    shutil.rmtree(out, ignore_errors=True)
    return {"job": job, "peak_rise": peak, "seconds": seconds}


def build(root: Path, gb: float, tensor_mb: int) -> int:
    import torch
    import torch.distributed.checkpoint as dcp

    import ckptfs

    n = max(1, int(gb * 1000 / tensor_mb))
    numel = tensor_mb * 10**6 // 4
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layers.{i}.weight": (torch.randn(numel // 1024, 1024, generator=g) if i % 4
                                              else torch.randn(numel // 512, 1024, generator=g).bfloat16())
                       for i in range(n)},
             "step": 100}
    ckptfs.save(state, root / "ckptfs", overwrite=True)
    shutil.rmtree(root / "dcp", ignore_errors=True)
    dcp.save(state, checkpoint_id=str(root / "dcp"), no_dist=True)
    return sum(t.nbytes for t in state["model"].values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools_quick", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--tensor-mb", type=int, default=64)
    ap.add_argument("--dir", default="/tmp/ckptfs-bench-tools")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    size = build(root, args.gb, args.tensor_mb)
    print(f"state: {size / 1e9:.2f} GB of tensors, largest {args.tensor_mb} MB\n")
    print(f"{'job':<28}{'peak RSS rise':>16}{'x checkpoint':>14}{'seconds':>10}")
    for job in JOBS:
        try:
            r = on_own_rank(run_job, job, args.dir)
        except RanksFailed as e:
            print(f"{job:<28} failed: {str(e).strip().splitlines()[-1:]}")
            continue
        rise = r["peak_rise"]
        print(f"{job:<28}{rise / 2**20:>12.0f} MiB{rise / size:>14.2f}{r['seconds']:>10.2f}")
    shutil.rmtree(root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
