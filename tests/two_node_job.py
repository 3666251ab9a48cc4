"""A training job run by torchrun agents (tests/test_two_node.py), each agent a node with a
local directory of its own; the node's identity comes from the launcher's environment.

``train``: steps 1..``--steps`` with local steps every 2 and persistent ones every 4, then it
keeps stepping without saving (the test kills a node there, mid-run). ``resume``: restore,
check the state bit-exact against the step restored, and write what the restore reports to
``<out>/rank<N>.json``. Every rank writes its pid and local directory to ``<out>/pids/``.
``--die-receiving N``: this node's receiving rank SIGKILLs its agent and itself once the first
file of step N's copy from the other node has arrived (a node lost mid-copy).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch.distributed as dist

import ckptfs
from tests.test_manager import blank, check, state


def manager(url: str, local: str) -> ckptfs.CheckpointManager:
    return ckptfs.CheckpointManager(url, local_dir=local, local_interval_steps=2,
                                    save_interval_steps=4, keep_local=2, replicas=1,
                                    preemption=ckptfs.PreemptionPolicy(signals=()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--url", required=True)
    p.add_argument("--node-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--die-receiving", type=int, default=None)
    a = p.parse_args()
    if a.die_receiving is not None:
        die_receiving(a.die_receiving)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.makedirs(os.path.join(a.out, "pids"), exist_ok=True)
    with open(os.path.join(a.out, "pids", f"rank{rank}"), "w") as f:
        f.write(f"{os.getpid()} {a.node_dir}")
    with manager(a.url, a.node_dir) as mgr:
        if a.mode == "train":
            train(mgr, rank, world, a.steps, a.out)
        else:
            sd = blank(rank, world)
            step = mgr.restore(sd)
            assert step is not None
            check(sd, rank, world, step)
            r = mgr.last_restore
            assert r is not None
            with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
                json.dump({"step": step, "source": r.source, "reason": r.reason, "world": world,
                           "local": r.local_bytes, "peer": r.peer_bytes,
                           "remote": r.remote_bytes, "fetched": r.fetched_bytes,
                           "node": os.environ.get("GROUP_RANK")}, f)
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
