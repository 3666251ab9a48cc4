"""Spawned torch.distributed ranks for tests, the conformance suite, benchmarks and the demo.

``run_ranks(world, fn, *args)`` starts ``world`` processes with the ``spawn`` start method (never
fork: a forked child inherits the parent's I/O loop thread and client sessions), joins them into
one gloo process group over a free loopback port and calls ``fn(rank, world, *args)`` in each.
When a rank fails, every failing rank's traceback is collected and raised here as one
``RanksFailed``; a rank that is still alive when ``timeout`` runs out is killed and reported.
``fn`` must be importable (defined at module level).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import ckptfs


class RanksFailed(AssertionError):
    """One or more spawned ranks failed; the message holds each failing rank's traceback."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, errdir: str,
           env: Mapping[str, str], threads: int | None) -> None:
    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        ckptfs.close()  # an asynchronous save still in flight finishes on its own group first
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, env: Mapping[str, str] | None = None,
              threads: int | None = None, timeout: float | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks and wait for all of them.

    ``env`` is added to each rank's environment; ``threads`` sets torch's intra-op threads per
    rank; ``timeout`` (seconds) kills ranks still running after it and raises RanksFailed.
    """
    with tempfile.TemporaryDirectory(prefix="ckptfs-ranks-") as errdir:
        ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, errdir, dict(env or {}),
                                               threads),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = None if timeout is None else time.monotonic() + timeout
        error: BaseException | None = None
        try:
            while not ctx.join(timeout=0.5):
                if deadline is not None and time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    raise RanksFailed(f"rank(s) {alive} still running after {timeout:g} s; killed")
        except ProcessException as e:
            error = e
        except BaseException:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise
        if error is not None:
            for p in ctx.processes:  # the others may wait in a collective for the dead one
                if p.is_alive():
                    p.kill()
            msgs = []
            for name in sorted(os.listdir(errdir)):
                with open(os.path.join(errdir, name)) as f:
                    msgs.append(f"--- {name}\n{f.read()}")
            raise RanksFailed("\n".join(msgs) or str(error)) from None
