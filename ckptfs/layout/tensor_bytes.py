"""Bytes of CPU tensors without copies, for every storable dtype (bf16 and float8 included)."""

from __future__ import annotations

import torch

#: dtype -> whether ``Tensor.numpy()`` takes it (then its buffer is cast to bytes directly: about
#: 1.5 us against 4.9 us for reshape + view(uint8) + numpy, which counts at 20,000 small tensors)
_NUMPY: dict[torch.dtype, bool] = {}


def _numpy_takes(dtype: torch.dtype) -> bool:
    ok = _NUMPY.get(dtype)
    if ok is None:
        try:
            torch.empty(1, dtype=dtype).numpy()
            ok = True
        except TypeError:  # bf16, float8: no numpy dtype
            ok = False
        _NUMPY[dtype] = ok
    return ok


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a CPU, C-contiguous tensor (shares memory)."""
    if not t.is_cpu or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a CPU, contiguous tensor")
    if t.numel() == 0:
        return memoryview(b"")
    if _numpy_takes(t.dtype):
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data
