"""The benchmark's synthetic training state: fp32 and bf16 tensors, row-sharded as DTensors.

Contents are a cheap deterministic function of (tensor, global row, column), so any rank can
build its own shard for any world size without communication and check a resharded load
bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HIDDEN = 4096
FFN = 11008  # odd multiple of 2: rows split unevenly over 3 ranks, like 4096 does


@dataclass(frozen=True, slots=True)
class TensorSpec:
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    seed: int

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def layer_specs(layer: int, shrink: int = 1) -> list[TensorSpec]:
    """One transformer-like layer: ~157 MB (a 64 MiB fp32 matrix, an 86 MiB bf16 matrix, 2 vectors);
    every dimension divided by ``shrink`` (a power of two: FFN rows still split unevenly over 3)."""
    p = f"layers.{layer}."
    base = 16 * layer
    h, f = HIDDEN // shrink, FFN // shrink
    return [
        TensorSpec(p + "attn.wq", torch.float32, (h, h), base + 1),
        TensorSpec(p + "mlp.w_up", torch.bfloat16, (f, h), base + 2),
        TensorSpec(p + "attn.bias", torch.float32, (h,), base + 3),
        TensorSpec(p + "norm.weight", torch.bfloat16, (h,), base + 4),
    ]


def state_specs(gb: float) -> list[TensorSpec]:
    """Layers until the state holds at least ``gb`` GB (1e9 bytes); at least one layer. Below one
    full layer (~0.157 GB, quick checks) the layer shrinks, down to 1/64 of each dimension."""
    shrink = 1
    while shrink < 64 and sum(s.nbytes for s in layer_specs(0, shrink * 2)) >= gb * 1e9:
        shrink *= 2
    specs: list[TensorSpec] = []
    layer = 0
    while not specs or sum(s.nbytes for s in specs) < gb * 1e9:
        specs += layer_specs(layer, shrink)
        layer += 1
    return specs


def row_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """DTensor Shard(0) rows of ``rank`` (torch.chunk semantics: ceil-sized, last ones short)."""
    per = -(-n // world)
    lo = min(rank * per, n)
    return lo, min(lo + per, n)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {4: torch.int32, 2: torch.int16}[dtype.itemsize]


def fill(spec: TensorSpec, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of the tensor: row hash XOR column hash, as raw bits of the dtype."""
    it = _int_view(spec.dtype)
    mask = (1 << (8 * spec.dtype.itemsize - 1)) - 1
    rows = ((torch.arange(lo, hi, dtype=torch.int64) * 2654435761 + spec.seed * 97531) & mask).to(it)
    if len(spec.shape) == 1:
        return rows.view(spec.dtype)
    cols = ((torch.arange(spec.shape[1], dtype=torch.int64) * 40503 + spec.seed) & mask).to(it)
    return torch.bitwise_xor(rows[:, None], cols[None, :]).view(spec.dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    it = _int_view(a.dtype)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(it), b.view(it))


def make_state(specs: list[TensorSpec], rank: int, world: int, *, zeros: bool) -> dict[str, torch.Tensor]:
    """This rank's state: each tensor a DTensor Shard(0) over a 1-D mesh of ``world`` ranks.

    ``zeros`` gives pre-faulted zero targets for loads (allocated once, reused by every run, as
    a resumed training job's model and optimizer already are)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for s in specs:
        lo, hi = row_range(s.shape[0], rank, world)
        local = torch.zeros((hi - lo, *s.shape[1:]), dtype=s.dtype) if zeros else fill(s, lo, hi)
        stride = (s.shape[1], 1) if len(s.shape) == 2 else (1,)
        out[s.key] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                        shape=torch.Size(s.shape), stride=stride)
    return out


def check_state(specs: list[TensorSpec], state: dict[str, torch.Tensor], rank: int, world: int) -> list[str]:
    """Keys whose local shard differs from the expected contents."""
    bad = []
    for s in specs:
        lo, hi = row_range(s.shape[0], rank, world)
        if not same_bits(state[s.key].to_local(), fill(s, lo, hi)):
            bad.append(s.key)
    return bad


def small_specs(n: int) -> list[TensorSpec]:
    """``n`` small 1-D fp32 tensors of 64 to 1023 elements (about 2 KB each on average), the
    shape of per-parameter optimizer entries, biases and norms of a large model."""
    return [TensorSpec(f"small.{i}", torch.float32, (64 + (i * 37) % 960,), 10_000 + i) for i in range(n)]


def make_plain(specs: list[TensorSpec], *, zeros: bool) -> dict[str, torch.Tensor]:
    """Whole (unsharded) tensors: zeros, or the contents ``fill`` gives them."""
    return {s.key: torch.zeros(s.shape, dtype=s.dtype) if zeros else fill(s, 0, s.shape[0]) for s in specs}


def mid_layer_specs(layer: int, shrink: int = 1) -> list[TensorSpec]:
    """One layer of mid-size tensors (12-16 MiB each, 52 MiB in all): fp32 (4096, 1024),
    fp32 (1024, 4096), fp32 (3072, 1024), bf16 (4096, 1024): the size of the tensors of a
    model sharded over many ranks, where a save is many writes of a few MiB each per rank;
    every dimension divided by ``shrink`` (quick checks)."""
    p = f"mid.{layer}."
    base = 16 * layer + 5000
    k, m = 1024 // shrink, 4096 // shrink
    return [
        TensorSpec(p + "attn.wqkv", torch.float32, (m, k), base + 1),
        TensorSpec(p + "attn.wo", torch.float32, (k, m), base + 2),
        TensorSpec(p + "mlp.w_in", torch.float32, (3 * k, k), base + 3),
        TensorSpec(p + "mlp.w_out", torch.bfloat16, (m, k), base + 4),
    ]


def mid_specs(gb: float) -> list[TensorSpec]:
    """Mid-size-tensor layers (``mid_layer_specs``) until the state holds at least ``gb`` GB;
    at least one layer. Below one full layer (quick checks) the layer shrinks, down to 1/64 of
    each dimension."""
    shrink = 1
    while shrink < 64 and sum(s.nbytes for s in mid_layer_specs(0, shrink * 2)) >= gb * 1e9:
        shrink *= 2
    specs: list[TensorSpec] = []
    layer = 0
    while not specs or sum(s.nbytes for s in specs) < gb * 1e9:
        specs += mid_layer_specs(layer, shrink)
        layer += 1
    return specs


LARGE = (4096, 8192)  #: rows and columns of ``large_specs``'s matrices: 128 MiB fp32, 64 MiB bf16


def large_specs(gb: float) -> list[TensorSpec]:
    """A few large matrices, fp32 and bf16 (4096, 8192), about 3/4 of the bytes fp32, until the
    state holds about ``gb`` GB (one of each at least): a checkpoint of a few big weights, each
    row-sharded over the ranks, so a rank writes one large chunk per tensor. Below one matrix
    of each (quick checks) every dimension shrinks, down to 1/64."""
    shrink = 1
    while shrink < 64 and (LARGE[0] // (2 * shrink)) * (LARGE[1] // (2 * shrink)) * 6 >= gb * 1e9:
        shrink *= 2
    rows, cols = LARGE[0] // shrink, LARGE[1] // shrink
    n32 = max(1, round(gb * 0.75e9 / (rows * cols * 4)))
    n16 = max(1, round(gb * 0.25e9 / (rows * cols * 2)))
    return ([TensorSpec(f"large.fp32.{i}", torch.float32, (rows, cols), 20_000 + i) for i in range(n32)]
            + [TensorSpec(f"large.bf16.{i}", torch.bfloat16, (rows, cols), 20_100 + i) for i in range(n16)])
