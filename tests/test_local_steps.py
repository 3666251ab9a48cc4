"""Local steps in one process (a world of one node, no copies to send): what a save leaves in the
local tier, retention per tier, the choice between a local and a persistent step and its
reasons, and the settings checked. The multi-node cases: tests/test_two_node.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

import ckptfs
from ckptfs.dist.nodes import node_id
from ckptfs.manager.peers import replica_targets
from ckptfs.manager.replicas import TIER_FILE
from tests.test_manager import flip


def sd_at(step: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32).reshape(8, 8) + step, "step": step}


def blank() -> dict:
    return {"w": torch.full((8, 8), -1.0), "step": -1}


def manager(tmp_path, *, writer: str = "thread", **tiers) -> ckptfs.CheckpointManager:
    tiers = {"local_dir": tmp_path / "local", "local_interval_steps": 1, "keep_local": 2, **tiers}
    return ckptfs.CheckpointManager(tmp_path / "ckpt", ckptfs.ManagerOptions(
        tiers=ckptfs.TierOptions(**tiers), save_interval_steps=5,
        save=ckptfs.SaveOptions(asynchronous=ckptfs.AsyncOptions(writer=writer)),
        preemption=ckptfs.PreemptionPolicy(signals=())))


def local_steps(tmp_path) -> list[int]:
    root = tmp_path / "local"
    return sorted(int(n[5:]) for n in os.listdir(root) if (root / n / TIER_FILE).exists())


def test_local_steps_retention_and_restore(tmp_path):
    with manager(tmp_path) as mgr:
        for step in range(1, 9):
            assert mgr.should_save(step) and mgr.is_local_step(step) == (step != 5)
            mgr.save_sync(step, sd_at(step))
            if step == 5:  # the persistent step removed the local steps before it
                assert local_steps(tmp_path) == []
        assert mgr.steps() == [5] and local_steps(tmp_path) == [7, 8]  # keep_local=2
        record = json.loads((tmp_path / "local" / "step-00000008" / TIER_FILE).read_text())
        assert record["step"] == 8 and record["origin"] == node_id() and record["files"]
        sd = blank()
        assert mgr.restore(sd) == 8 and torch.equal(sd["w"], sd_at(8)["w"]) and sd["step"] == 8
        r = mgr.last_restore
        assert r.source == "local" and r.remote_bytes == 0 and r.local_bytes == 256
        assert "local step 8" in r.reason
        # the last copy of a file of step 8 spoiled: step 7 is the newest complete one
        victim = sorted(record["files"])[0]
        path = tmp_path / "local" / "step-00000008" / victim
        flip(str(path), path.stat().st_size - 1)
        sd = blank()
        assert mgr.restore(sd) == 7 and torch.equal(sd["w"], sd_at(7)["w"])
        assert "local step 8: no intact copy (crc32c) of " + victim in mgr.last_restore.reason
        assert local_steps(tmp_path) == [7]  # resuming at 7 leaves step 8's timeline
        for f in (tmp_path / "local" / "step-00000007").rglob("*.safetensors"):
            f.unlink()  # no copy of step 7's files: back to the persistent step 5
        sd = blank()
        assert mgr.restore(sd) == 5 and torch.equal(sd["w"], sd_at(5)["w"])
        r = mgr.last_restore
        assert r.source == "persistent" and "local step 7: no node holds" in r.reason, r.reason


def test_a_copy_without_its_record_does_not_count(tmp_path):
    """A record is written last: a copy killed before it (a node lost mid-copy) is unfinished."""
    with manager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save_sync(step, sd_at(step))
        (tmp_path / "local" / "step-00000002" / TIER_FILE).unlink()
        sd = blank()
        assert mgr.restore(sd) == 1 and torch.equal(sd["w"], sd_at(1)["w"])


def test_an_explicit_step_that_is_neither_committed_nor_held_is_named(tmp_path):
    with manager(tmp_path) as mgr:
        mgr.save_sync(1, sd_at(1))
        sd = blank()
        assert mgr.restore(sd, step=1) == 1 and torch.equal(sd["w"], sd_at(1)["w"])
        with pytest.raises(ckptfs.CheckpointNotFoundError, match="step 3 is neither committed"):
            mgr.restore(blank(), step=3)


@pytest.mark.parametrize("kw, field", [
    (dict(local_interval_steps=0), "local_interval_steps"),
    (dict(replicas=-1), "replicas"),
    (dict(keep_local=0), "keep_local"),
    (dict(local_dir=None), "local_interval_steps needs local_dir"),
    (dict(writer="process"), "local_interval_steps needs save.asynchronous.writer='thread'"),
    (dict(failure_domain=3), "failure_domain must be a str"),
])
def test_settings_are_checked(tmp_path, kw, field):
    with pytest.raises(ckptfs.ConfigError, match=field):
        manager(tmp_path, **kw)


def test_a_torchrun_agent_names_the_node(monkeypatch):
    monkeypatch.delenv("CKPTFS_NODE_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("GROUP_RANK", "3")
    assert node_id().endswith(":3")
    monkeypatch.setenv("CKPTFS_NODE_ID", "rack1-a")
    assert node_id() == "rack1-a"


@pytest.mark.parametrize("domains, node, replicas, want", [
    (["", "", "", ""], 0, 2, [1, 2]),  # no domains: the ring after the node
    (["", "", "", ""], 3, 1, [0]),
    (["a", "a", "b", "b"], 0, 1, [2]),  # the other rack before the next node of its own
    (["a", "a", "b", "b"], 1, 3, [2, 3, 0]),
    (["a", "a", "b", "b"], 2, 1, [0]),
    (["a", "b", "a", "c", "b", "c"], 0, 3, [1, 3, 4]),  # one per other domain first
    (["a", "a"], 0, 5, [1]),  # one domain: the other node; never the node itself
    (["a"], 0, 1, []),
])
def test_copies_go_to_other_failure_domains_first(domains, node, replicas, want):
    assert replica_targets(node, domains, replicas) == want


class Pipe:
    """Two ends of a one-way channel with ``Comm.point_to_point``'s contract (a test double: a
    real pair of ranks would also work, but only over gloo's host tensors)."""

    def __init__(self) -> None:
        import queue

        self.q: queue.Queue = queue.Queue()
        self.device = torch.device("cpu")
        self.sent: list[torch.Tensor] = []

    def point_to_point(self, ops, what):
        for kind, t, _, _ in ops:
            if kind == "send":
                self.sent.append(t)
                self.q.put(t.clone())
            else:
                t.copy_(self.q.get(timeout=10))


def test_pieces_travel_through_a_device_buffer_when_the_group_needs_one(tmp_path, monkeypatch):
    """A group whose backend takes only accelerator tensors gets each piece copied through one
    buffer on its device; here that buffer is a second host buffer (no accelerator)."""
    import threading

    from ckptfs.layout.checksum import checksum
    from ckptfs.manager import peers

    wires: list[torch.Tensor] = []

    def wire(comm, size):
        wires.append(torch.empty(size, dtype=torch.uint8))
        return wires[-1]

    monkeypatch.setattr(peers, "_wire", wire)
    data = os.urandom(3 * 500 + 17)
    (tmp_path / "a").write_bytes(data)
    pipe = Pipe()
    sender = threading.Thread(target=lambda: (
        peers.send_bytes(pipe, b"record", 1, "test"),
        peers.send_file(pipe, str(tmp_path / "a"), len(data), 1, "test", bytearray(1000))))
    sender.start()
    assert peers.recv_bytes(pipe, 0, "test") == b"record"
    crc = peers.recv_file(pipe, str(tmp_path / "b"), len(data), 0, "test", bytearray(1000))
    sender.join()
    assert (tmp_path / "b").read_bytes() == data and crc == checksum(data)
    pool = {w.data_ptr() for w in wires}
    assert pipe.sent and all(t.data_ptr() in pool for t in pipe.sent)  # never the host buffer


def test_a_local_restore_checks_the_copies_as_it_reads_them(tmp_path, monkeypatch):
    """No pass over the copies before the read; a spoiled chunk fails the read, and only then
    is every copy checked whole, the step passed and the older one restored."""
    from ckptfs.manager import recover

    checked: list[str] = []
    whole = recover.file_crc
    monkeypatch.setattr(recover, "file_crc", lambda path, buf: checked.append(path) or whole(path, buf))
    with manager(tmp_path) as mgr:
        for step in (1, 2):
            mgr.save_sync(step, sd_at(step))
        sd = blank()
        assert mgr.restore(sd, step=2) == 2 and torch.equal(sd["w"], sd_at(2)["w"])
        assert checked == [] and mgr.last_restore.local_bytes == 256
        (path,) = (tmp_path / "local" / "step-00000002").rglob("*.safetensors")
        flip(str(path), path.stat().st_size - 1)  # a byte of the chunk's data
        sd = blank()
        assert mgr.restore(sd) == 1 and torch.equal(sd["w"], sd_at(1)["w"])
        assert str(path) in checked and "local step 2: no intact copy" in mgr.last_restore.reason


def test_local_steps_are_whole_when_the_saves_are_segmented(tmp_path):
    """A node-local step's index is written whole, whatever ``index_segments`` says (a node's
    recovery plans from the index it holds); the persistent steps are segmented."""
    opts = ckptfs.ManagerOptions(
        tiers=ckptfs.TierOptions(local_dir=tmp_path / "local", local_interval_steps=1),
        save_interval_steps=2, save=ckptfs.SaveOptions(index_segments=True),
        preemption=ckptfs.PreemptionPolicy(signals=()))
    with ckptfs.CheckpointManager(tmp_path / "ckpt", opts) as mgr:
        for step in (1, 2, 3):
            mgr.save_sync(step, sd_at(step))
        assert mgr.metadata(2).segmented
        local = tmp_path / "local" / "step-00000003" / ckptfs.INDEX_FILE
        assert b"index_segments" not in local.read_bytes()
        sd = blank()
        assert mgr.restore(sd) == 3 and mgr.last_restore.source == "local"
        assert torch.equal(sd["w"], sd_at(3)["w"])
