"""MXFP4 weights of a Hugging Face checkpoint (the OCP microscaling format, as gpt-oss ships its
experts), dequantised on read by ``ckptfs.load_hf_quantized``.

The layout (what transformers' ``Mxfp4HfQuantizer`` reads): a weight ``<name>`` is stored as
two uint8 tensors, ``<name>_blocks`` of shape ``(E, R, G, 16)`` and ``<name>_scales`` of shape
``(E, R, G)``. Each of the ``G`` groups of a row holds 32 FP4 (E2M1) values in 16 bytes, the
first of each pair in the low four bits; its scale is an E8M0 exponent, ``2 ** (s - 127)``.
Element ``(e, r, 32 * g + k)`` of the stored matrix is

    FP4[code(e, r, g, k)] * 2 ** (scales[e, r, g] - 127)

with ``FP4 = (0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, ..., -6)``, computed as transformers does:
the FP4 value taken in the target's dtype, then ``torch.ldexp`` by the exponent (exact unless the
result leaves the dtype's range). The weight the model holds is that ``(E, R, 32 G)`` matrix with
its last two dimensions swapped, ``(E, 32 G, R)``: transformers'
``convert_moe_packed_tensors`` layout, which ``from_pretrained`` gives when it dequantises.

A target's box ``(e, c, r)`` reads the groups covering its columns ``c`` of rows ``r`` of
experts ``e``: one region of blocks and one of scales, the shard's bytes and no more.
"""

from __future__ import annotations

import torch

from ckptfs.errors import MismatchError
from ckptfs.layout.boxes import Box
from ckptfs.layout.index import TensorEntry

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
#: FP4 values of a group (one scale each)
GROUP = 32
#: E2M1 codes 0-15
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: the E8M0 exponent bias
BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(..., G, 16)`` uint8 blocks and ``(..., G)`` uint8 scales as the ``(..., 32 G)``
    values they code, in ``dtype`` (the module's text; the stored layout, not yet swapped)."""
    lut = torch.tensor(FP4_VALUES, dtype=dtype)
    *lead, groups, half = blocks.shape
    out = torch.empty((*lead, groups, 2 * half), dtype=dtype)
    out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, (scales.to(torch.int32) - BIAS).unsqueeze(-1), out=out)
    return out.reshape(*lead, groups * 2 * half)


def check_entries(key: str, target_shape: tuple[int, ...], blocks: TensorEntry,
                  scales: TensorEntry) -> None:
    """The blocks and scales of ``key`` fit each other and a target of ``target_shape``."""
    b, s = blocks.shape, scales.shape
    want = (b[0], b[2] * GROUP, b[1]) if len(b) == 4 else None
    if (len(b) != 4 or b[3] != GROUP // 2 or s != b[:3] or blocks.dtype != "uint8"
            or scales.dtype != "uint8" or tuple(target_shape) != want):
        raise MismatchError(
            f"key {key!r}: MXFP4 weights need uint8 {key + BLOCKS_SUFFIX!r} (E, R, G, 16) and "
            f"uint8 {key + SCALES_SUFFIX!r} (E, R, G) for a target (E, 32 G, R); the checkpoint "
            f"has {blocks.dtype} {list(b)} and {scales.dtype} {list(s)}, the target "
            f"{list(target_shape)}")


def source_boxes(box: Box) -> tuple[Box, Box]:
    """The boxes of blocks and of scales that the target box ``(e, c, r)`` needs."""
    (e0, c0, r0), (ne, nc, nr) = box.offsets, box.shape
    g0, g1 = c0 // GROUP, -(-(c0 + nc) // GROUP)
    scales = Box((e0, r0, g0), (ne, nr, g1 - g0))
    return Box((*scales.offsets, 0), (*scales.shape, GROUP // 2)), scales


def values(blocks: torch.Tensor, scales: torch.Tensor, box: Box, dtype: torch.dtype) -> torch.Tensor:
    """The target box ``box`` from the regions ``source_boxes(box)`` read."""
    flat = dequantize_mxfp4(blocks, scales, dtype)
    start = box.offsets[1] % GROUP
    return flat[..., start:start + box.shape[1]].transpose(1, 2)
