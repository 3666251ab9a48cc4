"""``ckptfs.testing.ranks.RankPool``: spawned gloo ranks that run one ``run_ranks`` call after
another. The calls share the processes, never their state: each call gets a new process group,
the caller's environment and directory, a freshly seeded torch generator and an empty ckptfs
runtime (no plan, group or backend of an earlier call); a failed, dead or hung call
takes the pool's processes with it, and the next call starts from fresh ones. The port ranks meet
on is drawn outside the kernel's ephemeral range."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.testing.ranks import RanksFailed, pooled, run_ranks

pytestmark = pytest.mark.slow  # every test spawns ranks


def report(rank: int, world: int, out: str, tag: str) -> None:
    """What a rank sees of its process and the call: written to OUT/TAG-rankR.json."""
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    # the same structure in every call: an earlier call's cached plan is not reused
    saved = ckptfs.save({"w": torch.ones(2, 2)}, os.path.join(out, f"{tag}-ck"))
    seen = {"plan_cached": saved.plan_cached, "pid": os.getpid(), "world": dist.get_world_size(), "sum": int(t.item()),
            "cwd": os.getcwd(), "env": os.environ.get("CKPTFS_POOL_TEST"),
            "left": os.environ.get("CKPTFS_POOL_LEFT"), "threads": torch.get_num_threads(),
            "randn": torch.randn(4).tolist(),
            "registered": ("pool_probe", 1) in ckptfs.available_backends()}
    os.environ["CKPTFS_POOL_LEFT"] = tag  # must not reach the next call
    ckptfs.register_backend("pool_probe", 1, "ckptfs.layout.backends.zarr_backend:ZarrV3Backend")  # nor this
    torch.set_num_threads(1)
    with open(os.path.join(out, f"{tag}-rank{rank}.json"), "w") as f:
        json.dump(seen, f)


def seen(out, tag: str, world: int) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(world)]


def breaks(rank: int, world: int, how: str) -> None:
    if rank == 1:
        if how == "raise":
            raise ValueError("rank 1 broke on purpose")
        if how == "exit":
            os._exit(7)
        time.sleep(600)  # "hang"
    dist.barrier()  # rank 0 waits here for rank 1


@pytest.fixture(scope="module")
def pool(rank_pool):
    """The run's pool (tests/conftest.py), which the other modules' pooled ranks share: what a
    call here leaves or kills, they would see."""
    return rank_pool


def test_calls_reuse_the_processes_but_not_their_state(pool, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CKPTFS_POOL_TEST", "first")
    started, size = pool.started, pool.size
    pool.run(2, report, str(tmp_path), "a")
    monkeypatch.setenv("CKPTFS_POOL_TEST", "second")
    pool.run(2, report, str(tmp_path), "b", env={"CKPTFS_POOL_LEFT": "given"})
    pool.run(3, report, str(tmp_path), "c")  # a larger world: the pool grows by one
    a, b, c = seen(tmp_path, "a", 2), seen(tmp_path, "b", 2), seen(tmp_path, "c", 3)
    assert pool.started - started == max(0, 3 - size) and pool.size == max(3, size)
    assert [s["pid"] for s in a] == [s["pid"] for s in b] == [s["pid"] for s in c[:2]]
    assert [s["sum"] for s in a + b + c] == [3, 3, 3, 3, 6, 6, 6]
    assert [s["world"] for s in a + b + c] == [2, 2, 2, 2, 3, 3, 3]
    assert {s["cwd"] for s in a + b + c} == {str(tmp_path)}
    assert [s["env"] for s in a + b] == ["first", "first", "second", "second"]
    # what a call set in its environment and threads is gone in the next; env= still applies
    assert [s["left"] for s in a + b + c] == [None, None, "given", "given", None, None, None]
    assert len({s["threads"] for s in a + b + c}) == 1
    assert not any(s["plan_cached"] or s["registered"] for s in a + b + c)
    # torch's generator is seeded afresh in every call, as in a new process
    assert len({tuple(s["randn"]) for s in a + b + c}) == 7


def test_run_ranks_uses_the_pool_inside_pooled_only(pool, tmp_path):
    pool.run(2, report, str(tmp_path), "warm")
    started = pool.started
    with pooled(pool):
        run_ranks(2, report, str(tmp_path), "in1")
        run_ranks(2, report, str(tmp_path), "in2")
    run_ranks(2, report, str(tmp_path), "out")
    in1, in2, out = (seen(tmp_path, t, 2) for t in ("in1", "in2", "out"))
    assert pool.started == started
    assert [s["pid"] for s in in1] == [s["pid"] for s in in2]
    assert {s["pid"] for s in out}.isdisjoint(s["pid"] for s in in1)


@pytest.mark.parametrize("how, message", [
    ("raise", r"(?s)rank1\.err.*ValueError: rank 1 broke on purpose"),
    ("exit", r"process 1 terminated with exit code 7"),
    ("hang", r"rank\(s\) \[0, 1\] still running after 8 s; killed"),
])
def test_a_failed_call_reports_and_the_next_starts_fresh(pool, tmp_path, how, message):
    pool.run(2, report, str(tmp_path), "before")
    started = pool.started
    t0 = time.monotonic()
    with pytest.raises(RanksFailed, match=message):
        pool.run(2, breaks, how, timeout=8)
    assert time.monotonic() - t0 < 60  # rank 0, waiting in a barrier, was killed
    pool.run(2, report, str(tmp_path), "after")
    before, after = seen(tmp_path, "before", 2), seen(tmp_path, "after", 2)
    assert pool.started == started + 2
    assert {s["pid"] for s in after}.isdisjoint(s["pid"] for s in before)
    assert [s["sum"] for s in after] == [3, 3]


def test_free_ports_are_drawn_outside_the_ephemeral_range(monkeypatch):
    """The kernel hands the local ends of connections out of its ephemeral range, so a port
    drawn there may be taken before its rank listens: ``free_port`` draws outside it (where
    there is room), a port a bind accepts, and falls back to the kernel's pick otherwise."""
    from ckptfs.testing import ranks

    low, high = ranks._ephemeral_ports()
    got = {ranks.free_port() for _ in range(20)}
    assert all(not low <= p <= high for p in got), (low, high, got)
    assert len(got) > 1
    monkeypatch.setattr(ranks, "_ephemeral_ports", lambda: (1024, 65535))  # no room outside
    with socket.socket() as s:
        s.bind(("127.0.0.1", ranks.free_port()))
