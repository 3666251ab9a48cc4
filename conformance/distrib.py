"""Spawned gloo ranks for the suite (self-contained: third parties run it without ckptfs's tests).

Each spawn costs a torch import per rank, so callers batch every case of every pair into one
spawn; a rank that fails raises here with every failing rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, errdir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(rank, world, *args)
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(errdir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(world: int, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks (``fn`` at module level)."""
    with tempfile.TemporaryDirectory() as errdir:
        try:
            mp.spawn(_entry, args=(world, _free_port(), fn, args, errdir), nprocs=world, join=True)
        except Exception as e:
            msgs = []
            for name in sorted(os.listdir(errdir)):
                with open(os.path.join(errdir, name)) as f:
                    msgs.append(f"--- {name}\n{f.read()}")
            raise RuntimeError("\n".join(msgs) or str(e)) from None
