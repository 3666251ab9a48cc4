"""``ckptfs.lightning``: a real Lightning ``Trainer`` on CPU (2 ranks) checkpointing through
ckptfs: a run is killed after an epoch's checkpoint, a new run resumes from
``ckpt_path="last"`` (strategy ``ddp_spawn``) and ends bit-exact where an unbroken run ends, and
so does a resume with the plug-in under ``AsyncCheckpointIO`` (on strategy ``ddp``). Each run is
its own process (tests/lightning_train.py); the unbroken run and the killed one run once for
both resumes, on strategy ``ddp`` (its main process is rank 0: each run starts one Lightning
process fewer, and a checkpoint is the same whichever strategy wrote it)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

import ckptfs
from ckptfs.testing.ranks import free_port

# not imported here: the runs import it in their own processes
pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="lightning is not installed (the `test` extra)")


def train(mode: str, root, out, *extra: str) -> subprocess.Popen:
    """Start one run (the test waits on it with ``finish``)."""
    # Lightning's own pick of a free port is the kernel's ephemeral one, which the connections
    # of the tests beside it may take before the run listens there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "MASTER_PORT": str(free_port())}
    return subprocess.Popen([sys.executable, "-m", "tests.lightning_train", mode, str(root),
                             str(out), *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(*runs: subprocess.Popen) -> list[tuple[int, str]]:
    """Wait for runs started side by side: (return code, stderr) of each."""
    got = []
    try:
        for run in runs:
            _, err = run.communicate(timeout=600)
            got.append((run.returncode, err))
    finally:
        for run in runs:
            if run.poll() is None:  # one timed out: none is left behind
                run.kill()
                run.wait()
    return got


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """An unbroken run and a run killed after epoch 1's checkpoint, side by side, once for the
    module: (the unbroken run's final model, the killed run's directory, a copy of it as the
    kill left it)."""
    tmp = tmp_path_factory.mktemp("lightning")
    (full, err), (code, _) = finish(train("full", tmp / "full", tmp / "full.pt", "--ddp"),
                                    train("killed", tmp / "run", tmp / "never.pt", "--ddp"))
    assert full == 0, err[-3000:]
    assert code != 0 and not (tmp / "never.pt").exists()
    last = ckptfs.load_metadata(tmp / "run" / "last.ckpt")
    assert last.values["epoch"] == 1  # epoch 1's checkpoint, committed before the kill
    shutil.copytree(tmp / "run", tmp / "killed")
    return torch.load(tmp / "full.pt")["model"], tmp / "run", tmp / "killed"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("resume", ["plain", "async"])  # async: the plug-in under AsyncCheckpointIO
def test_killed_run_resumes_from_last_bit_exact(killed, tmp_path, resume):
    want, run, as_killed = killed
    # the killed run resumes from its own directory (ModelCheckpoint keeps its state only where
    # it was saved), put back as the kill left it for each way of resuming
    shutil.rmtree(run)
    shutil.copytree(as_killed, run)
    extra = ("--async",) if resume == "async" else ()
    [(code, err)] = finish(train("resume", run, tmp_path / "resumed.pt", *extra))
    assert code == 0, err[-3000:]
    got = torch.load(tmp_path / "resumed.pt")["model"]
    assert want.keys() == got.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the last checkpoint is the final epoch's, same weights
    final = ckptfs.load_keys(run / "last.ckpt")
    assert final["epoch"] == 3 and final["global_step"] == 16
    for k, v in want.items():
        assert torch.equal(final["state_dict"][k], v), k
    if resume == "async":
        # a removal under AsyncCheckpointIO is not ordered after the saves still queued, and
        # these epochs last milliseconds: the listing is checked without it
        return
    # ModelCheckpoint kept its latest checkpoint and last, removing the others through the
    # plug-in (directories included)
    assert sorted(os.listdir(run)) == ["epoch=3-step=16.ckpt", "last.ckpt"]
    state = ckptfs.load_keys(run / "last.ckpt")
    assert set(state["optimizer_states"][0]["state"]) == {0, 1}  # int keys stay ints


@pytest.mark.slow
def test_without_lightning_the_import_names_the_extra():
    code = ("import sys; sys.modules['lightning'] = None\n"
            "try:\n    import ckptfs.lightning\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=120)
    assert out.stdout.startswith("ConfigError") and "ckptfs[lightning]" in out.stdout, out
