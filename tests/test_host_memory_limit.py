"""``host_memory_limit``: an asynchronous save's staging holds at most the bound. The RSS growth
of a process saving a state several times the bound is measured in a subprocess (its peak
RSS), with and without the bound; the bounded checkpoint loads bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ckptfs

MiB = 1 << 20
LIMIT_MIB = 24
STATE_MIB = 128  #: four tensors of 32 MiB, and small ones

SAVER = textwrap.dedent("""
    import json, os, sys, torch, ckptfs
    MiB = 1 << 20
    root, limit = sys.argv[1], (int(sys.argv[2]) * MiB if sys.argv[2] != "none" else None)
    g = torch.Generator().manual_seed(0)
    state = {f"t{i}": torch.randn(8 * MiB, generator=g) for i in range(4)}
    state["small"] = [torch.arange(i + 1) for i in range(50)]
    def status(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    # the peak of this process's own memory from here on: VmHWM reset to the current RSS (the
    # lifetime ru_maxrss would also hold the launching process's peak, carried across exec)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS")
    h = ckptfs.async_save(state, root, host_memory_limit=limit)
    h.wait_staged(60)
    h.result(60)
    peak = status("VmHWM")
    ckptfs.close()
    print(json.dumps({"growth": peak - before}))
""")


def saved(root: str, limit: str) -> int:
    """Peak RSS growth (bytes) of a process saving the state to ``root`` under ``limit``."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", SAVER, root, limit], env=env, cwd=repo,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["growth"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_staging_stays_within_the_limit_and_the_checkpoint_is_exact(tmp_path):
    bounded = saved(str(tmp_path / "bounded"), str(LIMIT_MIB))
    assert bounded <= (LIMIT_MIB + 64) * MiB, bounded / MiB
    unbounded = saved(str(tmp_path / "unbounded"), "none")  # the measure tells them apart
    assert unbounded >= STATE_MIB * MiB * 0.9, unbounded / MiB
    g = torch.Generator().manual_seed(0)
    want = {f"t{i}": torch.randn(8 * MiB, generator=g) for i in range(4)}
    got = {k: torch.empty_like(v) for k, v in want.items()}
    got["small"] = [torch.empty(i + 1, dtype=torch.int64) for i in range(50)]
    ckptfs.load(got, str(tmp_path / "bounded"))
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert all(torch.equal(t, torch.arange(i + 1)) for i, t in enumerate(got["small"]))


def test_the_limit_is_checked(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="host_memory_limit"):
        ckptfs.SaveOptions(host_memory_limit=0)
    with pytest.raises(ckptfs.ConfigError, match="writer='process'"):
        ckptfs.async_save({"w": torch.ones(4)}, str(tmp_path / "p"), writer="process",
                          host_memory_limit=MiB)
    ckptfs.close()
