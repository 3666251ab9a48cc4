"""Spawned gloo ranks for the Megatron interop scripts (``make interop-strategies``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def spawn(run: Callable[..., None], world: int, *args: Any) -> None:
    """``run(rank, world, *args)`` on ``world`` spawned processes joined in one gloo group
    (``run`` a module-level function of the script, so the children find it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(run, world, port, args), nprocs=world, start_method="spawn")


def _rank(rank: int, run: Callable[..., None], world: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        run(rank, world, *args)
    finally:
        dist.destroy_process_group()


def cpu_only_cuda() -> None:
    """Megatron's own save synchronises CUDA and flags tensors on its device (a CPU-only torch
    has none); ckptfs's strategies need neither."""
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"
