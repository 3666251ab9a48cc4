"""Bounded memory: convert, unshard and verify hold about the largest tensor plus their
buffer, not the checkpoint. A fresh subprocess (no heap left over from writing the checkpoint)
runs each tool on a checkpoint several times larger than that bound and reports the rise of its
peak resident set (VmHWM, reset through /proc/self/clear_refs before each tool).

glibc's dynamic mmap threshold keeps freed multi-MiB blocks in the heap (some tens of MiB,
whatever the checkpoint's size), which would hide what the tools hold; the subprocess fixes the
threshold (MALLOC_MMAP_THRESHOLD_) so that freed tensors leave the resident set at once."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs

pytestmark = pytest.mark.slow  # every test spawns ranks

MiB = 1 << 20
TENSOR = 4 * MiB  #: most tensors
LARGEST = 8 * MiB  #: one tensor twice as large
COUNT = 20  #: 19 x 4 MiB + 8 MiB = 84 MiB of tensors
BUFFER = 2 * MiB  #: the tools' buffer_bytes
SLACK = 12 * MiB  #: allocator, index, I/O threads, torch's own bookkeeping
ROOT = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(src: str, work: str) -> dict[str, int]:
    """Run every tool once on ``src``; returns each one's peak RSS rise in bytes."""
    from ckptfs.tools.convert import convert
    from ckptfs.tools.unshard import unshard
    from ckptfs.tools.verify import verify

    work_dir = Path(work)
    tiny = work_dir / "tiny"
    ckptfs.save({"a": torch.ones(4), "b": {"c": torch.zeros(2, dtype=torch.bfloat16)}}, tiny)
    runs = {
        "convert zarr-3": lambda d: convert(src, d, backend="zarr", backend_version=3, buffer_bytes=BUFFER),
        "convert torch_dist-1": lambda d: convert(src, d, backend="torch_dist", buffer_bytes=BUFFER),
        "unshard torch one_file": lambda d: unshard(src, d, format="torch", buffer_bytes=BUFFER),
        "unshard safetensors one_file": lambda d: unshard(src, d, format="safetensors", buffer_bytes=BUFFER),
        "unshard hf chunks": lambda d: unshard(src, d, format="hf", strategy="chunks",
                                               chunk_size=3 * TENSOR, buffer_bytes=BUFFER),
        "verify": lambda d: verify(src, buffer_bytes=BUFFER),
    }
    out = {}
    trim = ctypes.CDLL("libc.so.6").malloc_trim
    for i, (name, run) in enumerate(runs.items()):
        _warm(name, tiny, work_dir / f"warm{i}")
        trim(0)  # hand freed heap back, so that reusing it counts as new memory
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _status("VmRSS")
        run(work_dir / f"out{i}")
        out[name] = _status("VmHWM") - before
    return out


def _warm(name: str, tiny: Path, dst: Path) -> None:
    """The same tool on a tiny checkpoint first: imports, threads and caches are not counted."""
    from ckptfs.tools.convert import convert
    from ckptfs.tools.unshard import unshard
    from ckptfs.tools.verify import verify

    if name.startswith("convert"):
        convert(tiny, dst, backend=name.split()[1].split("-")[0], backend_version=int(name[-1]))
    elif name.startswith("unshard"):
        fmt, strategy = name.split()[1:]
        unshard(tiny, dst, format=fmt, strategy=strategy, chunk_size=10 if strategy == "chunks" else None)
    else:
        verify(tiny)


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_tools_hold_one_tensor_and_a_buffer_not_the_checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"layer{i}.w": torch.randn(TENSOR // 4, generator=g).reshape(-1, 256)
                       for i in range(COUNT - 1)},
             "big": torch.randint(0, 1 << 15, (LARGEST // 2,), generator=g, dtype=torch.int16)}
    src = tmp_path / "ckpt"
    ckptfs.save(state, src)
    size = ckptfs.load_metadata(src).total_bytes
    bound = LARGEST + BUFFER + SLACK
    assert size > 3 * bound, "the checkpoint must dwarf the bound for the test to mean anything"
    del state
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MALLOC_MMAP_THRESHOLD_": str(256 * 1024)}
    run = subprocess.run([sys.executable, "-m", "tests.test_memory_bound", str(src), str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    peaks = json.loads(run.stdout.strip().splitlines()[-1])
    report = ", ".join(f"{k}: {v / MiB:.1f} MiB" for k, v in peaks.items())
    print(f"checkpoint {size / MiB:.0f} MiB, bound {bound / MiB:.0f} MiB; peak RSS rise: {report}")
    assert set(peaks) == {"convert zarr-3", "convert torch_dist-1", "unshard torch one_file",
                          "unshard safetensors one_file", "unshard hf chunks", "verify"}
    over = {k: v for k, v in peaks.items() if v > bound}
    assert not over, f"peak RSS above {bound / MiB:.0f} MiB ({size / MiB:.0f} MiB checkpoint): {report}"
    # the results are whole and right, not just small
    whole = ckptfs.load_keys(src)
    assert torch.equal(ckptfs.load_keys(tmp_path / "out0")["big"], whole["big"])
    got = torch.load(tmp_path / "out2" / "checkpoint.pt", weights_only=True, mmap=True)
    assert all(torch.equal(got["model"][k], whole["model"][k]) for k in whole["model"])


if __name__ == "__main__":
    print(json.dumps(measure(sys.argv[1], sys.argv[2])))
