"""A real two-node job: two ``torchrun`` agents on one host, each a node (``--nnodes 2``, c10d
rendezvous on 127.0.0.1, 2 processes each) with a local directory of its own and its node
identity from the launcher's environment, running tests/two_node_job.py.

In ``make test``: one node's agent and processes are SIGKILLed mid-run and its local directory
wiped (a replaced node); both restart and restore the newest local step bit-exact, reading 0
bytes from the URL; the same launch then makes a plain ``ckptfs.save`` on the 4 ranks, loaded
bit-exact on 2 ranks, one per node. ``make test-two-node`` (``CKPTFS_TWO_NODE_FULL=1``) goes on: the job
restarts on one node (world 4 -> 2) from that node's tier alone, then with the last copy of one
of the other node's files spoiled it falls back to the persistent step and says why; a node
killed while receiving the other node's copy leaves no step restorable that is not; a SIGTERM
to one rank saves a local step copied to the other node, persisted at the URL after (or not:
then a replaced node restores it from the copy).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptfs.layout.index import INDEX_FILE
from ckptfs.manager.replicas import PEERS_DIR, TIER_FILE
from ckptfs.testing.ranks import free_port
from tests.test_manager import flip

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
FULL = os.environ.get("CKPTFS_TWO_NODE_FULL") == "1"


def agents(nodes: list[str], out: Path, *args: str,
           extra: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    """One torchrun agent per local directory of ``nodes``, as one job (``extra``: more
    arguments for the job on some of them, by index)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "CKPTFS_NODE_ID"}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", CKPTFS_COLLECTIVE_TIMEOUT="60")
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for i, local in enumerate(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)),
               "--node-rank", str(i), "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", out.name,
               "--rdzv-conf", f"is_host={'true' if i == 0 else 'false'}",
               "--local-addr", "127.0.0.1", "--max-restarts", "0",
               str(REPO / "tests" / "two_node_job.py"), *args, "--node-dir", local, "--out", str(out),
               *(extra or {}).get(i, [])]
        log = open(out / f"agent{i}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("agent*.log")))


def kill_node(procs: list[subprocess.Popen], i: int, local: str, out: Path) -> None:
    """SIGKILL agent ``i`` and every process of its node (they run in sessions of their own)."""
    for pid_file in (out / "pids").iterdir():
        pid, where = pid_file.read_text().split(" ", 1)
        if where == local:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    procs[i].kill()
    procs[i].wait()


def finish(procs: list[subprocess.Popen], out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert rc == 0, f"an agent exited {rc}\n{logs(out)}"
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the job did not finish in {timeout:g} s\n{logs(out)}")


def results(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def train_and_lose_a_node(tmp_path: Path) -> tuple[str, list[str]]:
    """Train 6 steps on two nodes, SIGKILL node n1 mid-run, SIGKILL n0 too (the job restarts)
    and wipe n1's local directory."""
    url, nodes = str(tmp_path / "ckpt"), [str(tmp_path / "n0"), str(tmp_path / "n1")]
    out = tmp_path / "train"
    procs = agents(nodes, out, "train", "--url", url)
    deadline = time.monotonic() + 120
    while not (out / "saved").exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"training did not reach its last save\n{logs(out)}")
        time.sleep(0.2)
    time.sleep(0.5)  # mid-run: the ranks step on
    kill_node(procs, 1, nodes[1], out)
    kill_node(procs, 0, nodes[0], out)
    shutil.rmtree(nodes[1])
    return url, nodes


@pytest.fixture(scope="module")
def replaced(tmp_path_factory):
    """A two-node job that lost node n1 (``train_and_lose_a_node``), resumed on both nodes with
    n1 replaced; the same launch then saves a plain checkpoint on its 4 ranks and loads it on 2,
    one per node (``--plain-url``): (URL, the nodes' directories, the launch's output folder,
    the steps at the URL before the restore)."""
    tmp_path = tmp_path_factory.mktemp("two-node")
    url, nodes = train_and_lose_a_node(tmp_path)
    steps = sorted(os.listdir(url))
    out = tmp_path / "replaced"
    finish(agents(nodes, out, "resume", "--url", url, "--plain-url", str(tmp_path / "plain")), out)
    return url, nodes, out, steps


def test_two_torchrun_nodes_restore_a_replaced_node_from_its_peer(replaced, tmp_path):
    url, nodes, out, steps = replaced
    assert steps == ["step-00000004"]  # step 6 is a local step only
    got = results(out)
    assert len(got) == 4 and all(r["step"] == 6 and r["source"] == "local" for r in got), got
    assert all(r["remote"] == 0 for r in got) and sum(r["peer"] for r in got) > 0, got
    if not FULL:
        return

    out = tmp_path / "one-node"  # world 4 -> 2 from node n0's tier alone
    finish(agents(nodes[:1], out, "resume", "--url", url), out)
    got = results(out)
    assert len(got) == 2 and all(r["step"] == 6 and r["world"] == 2 for r in got), got
    assert all(r["source"] == "local" and r["remote"] == 0 and r["peer"] == 0 for r in got), got

    (peer,) = (Path(nodes[0]) / PEERS_DIR).iterdir()  # n1's files of step 6: the last copy
    held = peer / "step-00000006"
    victim = sorted(json.loads((held / TIER_FILE).read_text())["files"])[0]
    flip(str(held / victim), 10)
    out = tmp_path / "fallback"
    finish(agents(nodes, out, "resume", "--url", url), out)
    got = results(out)
    assert len(got) == 4 and all(r["step"] == 4 and r["source"] == "persistent" for r in got), got
    assert all(victim in r["reason"] and "no intact copy" in r["reason"] for r in got), got



@pytest.mark.skipif(not FULL, reason="make test-two-node")
def test_a_node_killed_mid_copy_leaves_no_false_step(tmp_path):
    """n0 dies receiving n1's files of local step 6, then n1 is replaced: n0 holds its own files
    of step 6 and part of n1's copy, without a record; the restore picks persistent step 4."""
    url, nodes = str(tmp_path / "ckpt"), [str(tmp_path / "n0"), str(tmp_path / "n1")]
    out = tmp_path / "train"
    procs = agents(nodes, out, "train", "--url", url, extra={0: ["--die-receiving", "6"]})
    try:
        procs[0].wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"node n0 did not die receiving step 6\n{logs(out)}")
    kill_node(procs, 0, nodes[0], out)  # its other process
    kill_node(procs, 1, nodes[1], out)
    assert not (out / "saved").exists()
    partial = Path(nodes[0]) / PEERS_DIR
    (held,) = partial.iterdir()
    assert not (held / "step-00000006" / TIER_FILE).exists()  # killed before its record
    assert (Path(nodes[0]) / "step-00000006" / TIER_FILE).exists()  # its own copy is whole
    shutil.rmtree(nodes[1])
    out = tmp_path / "resume"
    finish(agents(nodes, out, "resume", "--url", url), out)
    got = results(out)
    assert len(got) == 4 and all(r["step"] == 4 and r["source"] == "persistent" for r in got), got
    assert all("local step 6: no node holds" in r["reason"] for r in got), got


def test_a_plain_save_on_two_nodes_loads_on_two_ranks_bit_exact(replaced):
    """``ckptfs.save`` on 4 ranks (2 nodes x 2), ``ckptfs.load`` on 2 (one per node), checked
    bit-exact by the job (tests/two_node_job.py ``reshard``); in the restore test's launch.
    Resharding itself: tests/test_reshard.py."""
    got = [json.loads(p.read_text()) for p in sorted(replaced[2].glob("plain*.json"))]
    assert [r["loaded_as"] for r in got] == [0, 1] and all(r["bytes"] > 0 for r in got), got


def preempted(tmp_path: Path, name: str, *args: str) -> tuple[str, list[str], int]:
    """A two-node job stepping without saves until node n1's second rank gets SIGTERM; returns
    the URL, the nodes' local directories and the step the preemption saved."""
    url, nodes = str(tmp_path / "ckpt"), [str(tmp_path / "n0"), str(tmp_path / "n1")]
    out = tmp_path / name
    procs = agents(nodes, out, "preempt", "--url", url, *args)
    deadline = time.monotonic() + 120
    while not (out / "stepping").exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            for p in procs:
                p.kill()
            pytest.fail(f"the job did not start stepping\n{logs(out)}")
        time.sleep(0.1)
    pid = int((out / "pids" / "rank3").read_text().split(" ", 1)[0])
    os.kill(pid, signal.SIGTERM)
    finish(procs, out)
    got = results(out)
    assert len(got) == 4 and len({r["step"] for r in got}) == 1, got
    return url, nodes, got[0]["step"]


@pytest.mark.skipif(not FULL, reason="make test-two-node")
def test_a_preemption_saves_a_replicated_local_step_then_persists_it(tmp_path):
    url, nodes, step = preempted(tmp_path, "preempt")
    name = f"step-{step:08d}"
    assert sorted(os.listdir(url)) == [name]  # persisted: committed at the URL too
    for n in nodes:  # and a local step, copied to the other node
        assert os.path.isfile(os.path.join(n, name, INDEX_FILE))
        assert os.path.isfile(os.path.join(n, name, TIER_FILE))
        assert len(list((Path(n) / PEERS_DIR).glob(f"*/{name}/{TIER_FILE}"))) == 1
    out = tmp_path / "resume"
    finish(agents(nodes, out, "resume", "--url", url), out)
    got = results(out)
    assert all(r["step"] == step and r["source"] == "local" and r["remote"] == 0
               and r["local"] > 0 for r in got), got


@pytest.mark.skipif(not FULL, reason="make test-two-node")
def test_a_preemption_without_persistence_survives_a_replaced_node(tmp_path):
    url, nodes, step = preempted(tmp_path, "preempt", "--no-persist")
    assert not os.path.exists(url) or os.listdir(url) == []  # nothing at the URL
    assert (Path(nodes[0]) / PEERS_DIR).is_dir() and (Path(nodes[1]) / PEERS_DIR).is_dir()
    shutil.rmtree(nodes[1])  # n1 replaced: its files come from n0's copy
    out = tmp_path / "resume"
    finish(agents(nodes, out, "resume", "--url", url), out)
    got = results(out)
    assert all(r["step"] == step and r["source"] == "local" and r["remote"] == 0 for r in got), got
    assert sum(r["peer"] for r in got) > 0, got
