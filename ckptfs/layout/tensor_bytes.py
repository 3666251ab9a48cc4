"""Bytes of CPU tensors without copies, for every storable dtype (bf16 and float8 included)."""

from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU, C-contiguous tensor (shares memory)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a CPU, contiguous tensor")
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
