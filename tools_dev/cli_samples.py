"""Regenerate the sample outputs of docs/guide/cli.md from real runs of the ``ckptfs`` command.

    python -m tools_dev.cli_samples            # rewrite the samples in place

A sample is a fenced block right after a ``<!-- sample -->`` line; its ``$ `` lines are the
commands. They run in order in one bash shell, in a temporary directory holding the checkpoints
the page talks about (``ckpt/step-100``: an MLP and its AdamW state saved on 2 ranks with
``save_model_and_optim_state``; ``ckpt/damaged``: a copy with one data file deleted and one bit
flipped in the other; ``ckpt/step-200``: a save that never committed), and each command's
output replaces the lines under it. Timings and dates change from run to run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "guide" / "cli.md"
MARK = "<!-- sample -->"

FIXTURES = """
import os, shutil, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.device_mesh import init_device_mesh
import ckptfs

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
model(torch.randn(4, 64)).sum().backward()
optim.step()
ckptfs.save_model_and_optim_state("ckpt/step-100", model, optim)
rank = dist.get_rank()
dist.barrier()
dist.destroy_process_group()
if rank == 0:  # one process from here on
    shutil.copytree("ckpt/step-100", "ckpt/damaged")
    files = sorted(ckptfs.load_metadata("ckpt/damaged").files)
    os.remove(os.path.join("ckpt/damaged", files[0]))
    last = os.path.join("ckpt/damaged", files[-1])
    data = bytearray(open(last, "rb").read())
    data[-100] ^= 1
    open(last, "wb").write(bytes(data))
    ckptfs.save({"w": torch.ones(10)}, "ckpt/step-200")
    os.remove(os.path.join("ckpt/step-200", ckptfs.INDEX_FILE))
"""


def make_fixtures(work: Path, env: dict[str, str]) -> None:
    (work / "fixtures.py").write_text(FIXTURES)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                    "fixtures.py"], cwd=work, env=env, check=True, capture_output=True)


def samples(page: str) -> list[tuple[int, int, list[str]]]:
    """(first line, end line, commands) of each sample block (line numbers of the fences)."""
    lines = page.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.strip() == MARK:
            start = i + 1
            end = next(j for j in range(start + 1, len(lines)) if lines[j].startswith("```"))
            out.append((start, end, [x[2:] for x in lines[start + 1:end] if x.startswith("$ ")]))
    return out


def run_block(commands: list[str], work: Path, env: dict[str, str]) -> list[str]:
    """The block's lines: each ``$ command`` followed by its output (stdout and stderr)."""
    script = ['ckptfs() { "$CKPTFS_PYTHON" -m ckptfs "$@"; }', "rc=0"]
    for n, cmd in enumerate(commands):  # the marker's echo must not hide the last exit status
        script += [f"echo '@@{n}'", "(exit $rc)", f"{cmd} 2>&1", "rc=$?"]
    res = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True)
    parts = re.split(r"^@@\d+\n", res.stdout, flags=re.M)[1:]
    out = []
    for cmd, text in zip(commands, parts):
        out.append(f"$ {cmd}")
        out += text.rstrip("\n").splitlines()
    return out


def regenerate(page: str) -> str:
    env = {**os.environ, "CKPTFS_PYTHON": sys.executable, "COLUMNS": "100",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    lines = page.splitlines()
    work = Path(tempfile.mkdtemp())
    try:
        make_fixtures(work, env)
        for start, end, commands in reversed(samples(page)):
            lines[start + 1:end] = run_block(commands, work, env)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args(argv)
    PAGE.write_text(regenerate(PAGE.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
