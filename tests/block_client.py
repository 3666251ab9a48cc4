"""The client side of tests/block_runner.py: long-lived interpreters that run scripts as
``python script.py`` would (tests/test_docs_blocks.py runs the documentation's blocks on them,
tests/test_manager.py the manager page's example), one at a time each, several at once as the
ranks of a job started the way ``torchrun`` starts its processes."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from ckptfs.testing.ranks import free_port

ROOT = Path(__file__).resolve().parent.parent


def block_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(extra or {})}


class BlockRunner:
    """tests/block_runner.py in a subprocess, started on first use and again after a block that
    ended it (or ran past its time, which kills it)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _answer(self, deadline: float) -> dict:
        assert self.proc is not None and self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError("no answer in time")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"the block runner ended (exit status {self.proc.wait()})")
        return json.loads(line)

    def send(self, script: Path, env: dict[str, str], out: Path) -> None:
        """Start ``script`` in its own folder, its output to the file ``out``."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.block_runner"], cwd=ROOT,
                                         env=block_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True)
            self._answer(time.monotonic() + 120)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"script": str(script), "cwd": str(script.parent),
                                          "env": env, "out": str(out)}) + "\n")
        self.proc.stdin.flush()

    def result(self, out: Path, deadline: float) -> tuple[int | str, str]:
        """(exit status or what went wrong, output) of the script sent last."""
        try:
            got: int | str = self._answer(deadline)["rc"]
        except (TimeoutError, EOFError) as e:
            self.close()
            got = str(e)
        return got, out.read_text(errors="replace") if out.exists() else ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class BlockRunners:
    """As many ``BlockRunner`` as the widest block asked for; the first also runs plain blocks."""

    def __init__(self) -> None:
        self.runners: list[BlockRunner] = []

    def run(self, script: Path, envs: list[dict[str, str]], timeout: float) -> list[tuple[int | str, str]]:
        """``script`` on one runner per environment at once: (status, output) of each."""
        while len(self.runners) < len(envs):
            self.runners.append(BlockRunner())
        outs = [script.with_suffix(f".{i}.out") for i in range(len(envs))]
        for runner, env, out in zip(self.runners, envs, outs, strict=False):
            runner.send(script, env, out)
        deadline = time.monotonic() + timeout
        return [runner.result(out, deadline) for runner, out in zip(self.runners, outs, strict=False)]

    def close(self) -> None:
        for r in self.runners:
            r.close()


def torchrun_envs(env: dict[str, str], n: int) -> list[dict[str, str]]:
    """The variables ``torchrun --standalone --nproc-per-node N`` gives its N processes."""
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(n),
              "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(n), "TORCHELASTIC_RUN_ID": "none",
              "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
              "OMP_NUM_THREADS": "1"}
    return [{**env, **common, "RANK": str(r), "LOCAL_RANK": str(r), "ROLE_RANK": str(r)}
            for r in range(n)]
