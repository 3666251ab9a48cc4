"""The world a launcher such as ``torchrun`` describes, joined by a command-line tool.

``torchrun`` starts every process with ``$RANK``, ``$WORLD_SIZE``, ``$MASTER_ADDR`` and
``$MASTER_PORT``; a ckptfs command started that way joins that world (on gloo: the tools move
bytes between files, not between GPUs) so that its work is spread over every process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


def launcher_world_size() -> int:
    """``$WORLD_SIZE`` (1 when unset or not a number)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@contextmanager
def launcher_world() -> Iterator[int]:
    """Join the launcher's world for the duration (when it has more than one process and no
    process group is initialised yet); yields this process's rank (0 outside a launcher)."""
    if launcher_world_size() < 2 or dist.is_initialized():
        yield dist.get_rank() if dist.is_initialized() else 0
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()
