"""Local steps copied to other nodes, and restores from the nearest intact copy, on spawned gloo
ranks grouped into two nodes by ``CKPTFS_NODE_ID`` (two ranks each, one local directory per
node): a save loop with local and persistent steps, then restores with a node's tier wiped
(4 ranks), with one node gone (2 ranks), and with the last copy of a file spoiled (fallback to
the persistent step, the reason named). Run by ``make test-two-node``."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch.distributed as dist

import ckptfs
from ckptfs.manager.replicas import PEERS_DIR, TIER_FILE
from ckptfs.testing.ranks import run_ranks
from tests.test_manager import blank, check, flip, state

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("CKPTFS_TWO_NODE_FULL") != "1",
    reason="about 45 s on 2 cores: make test-two-node (make test runs tests/test_two_node.py)")]


def manager(url: str, local: str) -> ckptfs.CheckpointManager:
    return ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=local, local_interval_steps=2, keep_local=2, replicas=1), save_interval_steps=4, preemption=ckptfs.PreemptionPolicy(signals=())))


def as_node(rank: int, locals_: list[str]) -> str:
    """Ranks 0, 1 are node n0, ranks 2, 3 node n1; the node's local directory."""
    os.environ["CKPTFS_NODE_ID"] = f"n{rank // 2}"
    return locals_[rank // 2]


def train(rank: int, world: int, url: str, locals_: list[str]) -> None:
    """Steps 1..6: local steps 2 and 6, persistent step 4; the URL holds only step 4."""
    with manager(url, as_node(rank, locals_)) as mgr:
        assert mgr.restore(blank(rank, world)) is None
        for step in range(1, 7):
            if mgr.should_save(step):
                mgr.save(step, state(rank, world, step))
        mgr.wait()
        assert mgr.steps() == [4]


def resume(rank: int, world: int, url: str, locals_: list[str], want: int, out: str) -> None:
    with manager(url, as_node(rank, locals_)) as mgr:
        sd = blank(rank, world)
        assert mgr.restore(sd) == want
        check(sd, rank, world, want)
        r = mgr.last_restore
        assert r is not None
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"source": r.source, "reason": r.reason, "local": r.local_bytes,
                       "peer": r.peer_bytes, "remote": r.remote_bytes,
                       "fetched": r.fetched_bytes}, f)
        dist.barrier()


def results(out: str) -> list[dict]:
    return [json.load(open(os.path.join(out, n))) for n in sorted(os.listdir(out))]


def test_local_steps_restore_from_the_nearest_intact_copy(tmp_path):
    url, locals_ = str(tmp_path / "ckpt"), [str(tmp_path / "n0"), str(tmp_path / "n1")]
    run_ranks(4, train, url, locals_, timeout=120)
    step6 = "step-00000006"
    for me, other in ((0, "n1"), (1, "n0")):  # own copy and the other node's, both recorded
        assert os.path.isfile(os.path.join(locals_[me], step6, TIER_FILE))
        assert os.path.isfile(os.path.join(locals_[me], PEERS_DIR, other, step6, TIER_FILE))
    assert not os.path.exists(os.path.join(locals_[0], "step-00000002"))  # a persistent save made it redundant
    assert not os.path.exists(os.path.join(url, step6))  # a local step writes nothing at the URL

    out = tmp_path / "one-node"  # world 4 -> 2: node n0 alone holds all of step 6
    out.mkdir()
    run_ranks(2, resume, url, locals_, 6, str(out), timeout=120)
    for r in results(str(out)):
        assert r["source"] == "local" and r["remote"] == 0 and r["peer"] == 0 and r["local"] > 0

    shutil.rmtree(locals_[1])  # node n1 replaced: an empty tier
    out = tmp_path / "replaced"
    out.mkdir()
    run_ranks(4, resume, url, locals_, 6, str(out), timeout=120)
    got = results(str(out))
    assert all(r["source"] == "local" and r["remote"] == 0 for r in got)
    assert got[2]["peer"] > 0 and got[2]["fetched"] > 0  # n1's reads came from n0

    # n1's tier is still empty: spoil n0's copy of one of n1's files -> step 6 cannot be
    # completed, the persistent step 4 is restored and the reason names the file
    peer = os.path.join(locals_[0], PEERS_DIR, "n1", step6)
    victim = sorted(json.load(open(os.path.join(peer, TIER_FILE)))["files"])[0]
    flip(os.path.join(peer, victim), os.path.getsize(os.path.join(peer, victim)) - 1)
    out = tmp_path / "fallback"
    out.mkdir()
    run_ranks(4, resume, url, locals_, 4, str(out), timeout=120)
    for r in results(str(out)):
        assert r["source"] == "persistent" and r["local"] + r["remote"] > 0
        assert "local step 6: no intact copy (crc32c) of" in r["reason"] and victim in r["reason"]


def rack_loss(rank: int, world: int, url: str, locals_: list[str], out: str) -> None:
    """Four nodes of one rank each in two racks (failure domains a: n0, n1; b: n2, n3): a local
    step's copies go to the other rack; rack b's tiers wiped, the step is restored from rack a."""
    os.environ["CKPTFS_NODE_ID"] = f"n{rank}"
    os.environ["CKPTFS_FAILURE_DOMAIN"] = "ab"[rank // 2]
    with manager(url, locals_[rank]) as mgr:
        mgr.save_sync(2, state(rank, world, 2))
        peers = os.path.join(locals_[rank], PEERS_DIR)
        held = sorted(os.listdir(peers)) if os.path.isdir(peers) else []
        dist.barrier()
        if rank >= 2:
            shutil.rmtree(locals_[rank])
        dist.barrier()
        sd = blank(rank, world)
        assert mgr.restore(sd) == 2
        check(sd, rank, world, 2)
        r = mgr.last_restore
        assert r is not None
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"held": held, "source": r.source, "remote": r.remote_bytes,
                       "peer": r.peer_bytes}, f)
        dist.barrier()


def test_copies_cross_failure_domains_and_survive_a_rack(tmp_path):
    url = str(tmp_path / "ckpt")
    locals_ = [str(tmp_path / f"n{i}") for i in range(4)]
    out = tmp_path / "out"
    out.mkdir()
    run_ranks(4, rack_loss, url, locals_, str(out), timeout=120)
    got = results(str(out))
    # the plain ring would send n0's copy to n1 and n2's to n3 (the same rack)
    assert [r["held"] for r in got] == [["n2", "n3"], [], ["n0", "n1"], []], got
    assert all(r["source"] == "local" and r["remote"] == 0 for r in got), got
    assert got[2]["peer"] > 0 and got[3]["peer"] > 0, got
