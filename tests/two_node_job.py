"""A training job run by torchrun agents (tests/test_two_node.py), each agent a node with a
local directory of its own; the node's identity comes from the launcher's environment.

``train``: steps 1..``--steps`` with local steps every 2 and persistent ones every 4, then it
keeps stepping without saving (the test kills a node there, mid-run). ``resume``: restore,
check the state bit-exact against the step restored, and write what the restore reports to
``<out>/rank<N>.json``; with ``--plain-url``, then a plain ``ckptfs.save`` there on every rank and
``ckptfs.load`` on two ranks, one per node, checked bit-exact (``<out>/plain<N>.json``). ``preempt``: step until a preemption notice (SIGTERM to any rank)
has been saved (no other saves), wait for its persistence (unless ``--no-persist``) and write
the step and the steps committed at the URL to ``<out>/rank<N>.json``. Every rank writes its
pid and local directory to ``<out>/pids/``; ``<out>/stepping`` appears once the ranks step.
``--die-receiving N``: this node's receiving rank SIGKILLs its agent and itself once the first
file of step N's copy from the other node has arrived (a node lost mid-copy).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from typing import Any

import torch.distributed as dist

import ckptfs
from tests.test_manager import blank, check, state


def manager(url: str, local: str, *, local_interval_steps: int = 2, **kw: Any
            ) -> ckptfs.CheckpointManager:
    args: dict[str, Any] = dict(save_interval_steps=4, preemption=ckptfs.PreemptionPolicy(signals=()))
    tiers = ckptfs.TierOptions(local_dir=local, local_interval_steps=local_interval_steps,
                               keep_local=2, replicas=1)
    return ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=tiers, **{**args, **kw}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume", "preempt"])
    p.add_argument("--url", required=True)
    p.add_argument("--node-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--die-receiving", type=int, default=None)
    p.add_argument("--no-persist", action="store_true")
    p.add_argument("--plain-url", default=None, help="resume: then a plain save there, loaded on 2 ranks")
    a = p.parse_args()
    if a.die_receiving is not None:
        die_receiving(a.die_receiving)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(a.out, "pids"), exist_ok=True)
    with open(os.path.join(a.out, "pids", f"rank{rank}"), "w") as f:
        f.write(f"{os.getpid()} {a.node_dir}")
    if a.mode == "preempt":
        policy = ckptfs.PreemptionPolicy(signals=(signal.SIGTERM,), exit=False,
                                         persist=not a.no_persist)
        with manager(a.url, a.node_dir, local_interval_steps=10**6, save_interval_steps=10**6,
                     preemption=policy) as mgr:
            preempt(mgr, rank, world, a.out)
    elif a.mode == "train":
        with manager(a.url, a.node_dir) as mgr:
            train(mgr, rank, world, a.steps, a.out)
    else:
        with manager(a.url, a.node_dir) as mgr:
            resume(mgr, rank, world, a.out)
        if a.plain_url:
            reshard(rank, world, a.plain_url, a.out)
    dist.barrier()
    dist.destroy_process_group()


def die_receiving(step: int) -> None:
    """Wrap the copy's file receiver: after the first file of ``step``, SIGKILL the agent
    (this process's parent) and this process."""
    from ckptfs.manager import peers

    receive = peers.recv_file

    def recv_file(comm, path, size, peer, what, buf):  # type: ignore[no-untyped-def]
        crc = receive(comm, path, size, peer, what, buf)
        if f"copying step {step} " in what:
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        return crc

    peers.recv_file = recv_file


def resume(mgr: ckptfs.CheckpointManager, rank: int, world: int, out: str) -> None:
    """Restore, check bit-exact, and write what the restore reports."""
    sd = blank(rank, world)
    step = mgr.restore(sd)
    assert step is not None
    check(sd, rank, world, step)
    r = mgr.last_restore
    assert r is not None
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "source": r.source, "reason": r.reason, "world": world,
                   "local": r.local_bytes, "peer": r.peer_bytes,
                   "remote": r.remote_bytes, "fetched": r.fetched_bytes,
                   "node": os.environ.get("GROUP_RANK")}, f)


def reshard(rank: int, world: int, url: str, out: str) -> None:
    """A plain ``ckptfs.save`` on every rank, then ``ckptfs.load`` on two ranks, one per node
    (a group of its own), resharded and checked bit-exact."""
    ckptfs.save(state(rank, world, 7), url)
    pair = [0, world // 2]
    sub = dist.new_group(pair)
    if rank in pair:
        me = pair.index(rank)
        sd = blank(me, len(pair))
        r = ckptfs.load(sd, url, process_group=sub)
        check(sd, me, len(pair), 7)
        with open(os.path.join(out, f"plain{rank}.json"), "w") as f:
            json.dump({"loaded_as": me, "bytes": r.bytes_read}, f)


def preempt(mgr: ckptfs.CheckpointManager, rank: int, world: int, out: str) -> None:
    """Step (no saves but the preemption's) until the notice's step is saved."""
    dist.barrier()  # every rank's handler is installed
    for step in range(1, 3000):
        if mgr.should_save(step):
            mgr.save(step, state(rank, world, step))
        if mgr.preempted:
            break
        if step == 1 and rank == 0:
            open(os.path.join(out, "stepping"), "w").close()
        time.sleep(0.01)
    assert mgr.preempted, "no preemption notice arrived"
    mgr.wait()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"step": step, "url_steps": mgr.steps()}, f)


def train(mgr: ckptfs.CheckpointManager, rank: int, world: int, steps: int, out: str) -> None:
    for step in range(1, steps + 1):
        if mgr.should_save(step):
            mgr.save(step, state(rank, world, step))
    mgr.wait()
    dist.barrier()
    if rank == 0:
        with open(os.path.join(out, "saved"), "w") as f:
            f.write(str(steps))
    while True:  # training goes on without saving: the test kills a node here
        time.sleep(0.1)


if __name__ == "__main__":
    main()
