"""``ckptfs.load_hf_quantized`` (also ``load_hf_fp8``): a Hugging Face checkpoint with FP8
block-quantized or MXFP4 weights loaded into bf16 / fp32 targets, dequantised on read,
resharded. MXFP4's layout is in ``hf_mxfp4``; FP8's follows.

The layout (DeepSeek-V3 style, what DCP's ``QuantizedHuggingFaceStorageReader`` reads): a 2-D
weight ``<name>`` stored as ``float8_e4m3fn`` beside ``<name>_scale_inv`` (usually
``x.weight`` and ``x.weight_scale_inv``), a 2-D float tensor of
``(ceil(rows / block), ceil(cols / block))`` scales, one per ``block x block`` tile (the last
row and column of tiles may be partial); ``block`` is 128. Element ``(i, j)`` of the weight is

    float32(w[i, j]) * float32(scale_inv[i // block, j // block])

computed in float32 (the FP8 value and the scale convert exactly; the product rounds once,
to nearest even) and rounded once more to the target's dtype: the values DCP's reader gives
(it multiplies in float32 and copies into the target).

A quantized weight is one whose target is a floating tensor of another dtype while the
checkpoint holds it as ``float8_e4m3fn`` with its ``_scale_inv`` beside it, or holds no
``<name>`` but ``<name>_blocks`` and ``<name>_scales`` (MXFP4). Each rank reads
exactly the byte range of the weight its shard covers (a row range of a DTensor sharded by
rows is one ranged read) and the rows of scales those bytes need, a bounded batch at a time.
Every other target key loads as ``ckptfs.load`` loads it (same dtype, resharded).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.dist import Comm, ProcessGroup
from ckptfs.errors import MismatchError
from ckptfs.io import StoreOptions
from ckptfs.layout.boxes import Box
from ckptfs.layout.index import TensorEntry
from ckptfs.layout.keys import encode_component
from ckptfs.load import LoadResult, load
from ckptfs.state.shards import LocalShard, ShardedTensor, local_shard
from ckptfs.tools import hf_mxfp4
from ckptfs.tools.hf_mxfp4 import BLOCKS_SUFFIX, SCALES_SUFFIX
from ckptfs.tools.source import DEFAULT_BUFFER, Region, Source, open_checkpoint, read_regions

#: the suffix of a quantized weight's scales
SCALE_SUFFIX = "_scale_inv"
#: the stored dtype of a quantized weight
FP8 = "float8_e4m3fn"
#: the tile of one scale, as DeepSeek-V3 and DCP's reader use
BLOCK = 128


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
               block: int = BLOCK, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The reference dequantisation (see the module's text) of ``weight``, the box of a
    quantized weight at ``offset``; ``scale_inv`` holds the scales of the tiles from the one
    holding ``offset`` on (what ``scale_rows`` gives). One tile row at a time in float32."""
    r0, c0 = offset
    rows, cols = weight.shape
    out = torch.empty((rows, cols), dtype=dtype)
    col_tile = (torch.arange(c0, c0 + cols) // block) - c0 // block
    scales = scale_inv.to(torch.float32)
    start = 0
    while start < rows:
        tile = (r0 + start) // block
        stop = min(rows, (tile + 1) * block - r0)
        s = scales[tile - r0 // block].index_select(0, col_tile)
        out[start:stop] = (weight[start:stop].to(torch.float32) * s).to(dtype)
        start = stop
    return out


def scale_box(box: Box, block: int) -> Box:
    """The box of scales the weight box ``box`` needs."""
    lo = tuple(o // block for o in box.offsets)
    hi = tuple((o + s - 1) // block + 1 for o, s in zip(box.offsets, box.shape, strict=True))
    return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=True)))


def load_hf_quantized(state_dict: dict[str, Any], url: str | os.PathLike, *, block: int = BLOCK,
                      process_group: ProcessGroup | None = None,
                      storage_options: Mapping[str, Any] | None = None,
                      store_options: StoreOptions | None = None, strict: bool = True,
                      buffer_bytes: int = DEFAULT_BUFFER, verify: bool = True) -> LoadResult:
    """Fill ``state_dict`` (flat: Hugging Face names -> tensors, DTensors or ``ShardedTensor``s)
    from the Hugging Face checkpoint at ``url``, dequantising its FP8 block-quantized weights
    (see the module's text) and its MXFP4 weights (``hf_mxfp4``). Collective like
    ``ckptfs.load`` in an initialised process group."""
    with open_checkpoint(url, storage_options, store_options) as src:
        kinds = {k: kind for k, v in state_dict.items() if (kind := _kind(src, k, v)) is not None}
        plain = {k: v for k, v in state_dict.items() if k not in kinds}
        res = load(plain, url, process_group=process_group, storage_options=storage_options,
                   store_options=store_options, strict=strict)
        comm = Comm(process_group)
        targets = {k: state_dict[k] for k in kinds}
        read = comm.run_everywhere(
            f"dequantising the quantized weights of {url}",
            lambda: _read_quantized(src, targets, kinds, block, comm.rank, buffer_bytes, verify))
    used = {encode_component(k + s) for k, kind in kinds.items() for s in _SUFFIXES[kind]}
    return dataclasses.replace(res, unexpected_keys=[k for k in res.unexpected_keys if k not in used],
                               bytes_read=res.bytes_read + read, bytes_needed=res.bytes_needed + read)


#: the name that loaded FP8 weights first; the same function
load_hf_fp8 = load_hf_quantized

#: the stored tensors of each kind of quantized weight, by suffix of the target's name
_SUFFIXES = {"fp8": ("", SCALE_SUFFIX), "mxfp4": (BLOCKS_SUFFIX, SCALES_SUFFIX)}


def _kind(src: Source, name: str, target: Any) -> str | None:
    """"fp8" or "mxfp4" where the checkpoint holds ``name`` quantized for a floating target of
    another dtype; None where it loads as stored."""
    dtype = (target.local_tensor if isinstance(target, ShardedTensor) else target).dtype
    if not dtype.is_floating_point or dtype == torch.float8_e4m3fn:
        return None
    have = src.index.tensors
    entry = have.get(encode_component(name))
    if entry is not None:
        return "fp8" if entry.dtype == FP8 and encode_component(name + SCALE_SUFFIX) in have else None
    if all(encode_component(name + s) in have for s in _SUFFIXES["mxfp4"]):
        return "mxfp4"
    return None


def _entries(src: Source, shard: LocalShard, block: int) -> tuple[TensorEntry, TensorEntry]:
    """The weight's and its scales' entries, checked against the target and each other."""
    w = src.index.tensors[encode_component(shard.key)]
    s = src.index.tensors[encode_component(shard.key + SCALE_SUFFIX)]
    if shard.global_shape != w.shape:
        raise MismatchError(f"key {shard.key!r}: the checkpoint has {w.dtype} {list(w.shape)}, "
                            f"the target has {shard.dtype.name} {list(shard.global_shape)}")
    tiles = tuple(-(-n // block) for n in w.shape)
    if len(w.shape) != 2 or s.shape != tiles or not s.dtype.startswith(("float", "bfloat")):
        raise MismatchError(
            f"key {shard.key!r}: an FP8 weight {list(w.shape)} with blocks of {block} needs 2-D "
            f"float scales {list(tiles)} in {shard.key + SCALE_SUFFIX!r}, the checkpoint has "
            f"{s.dtype} {list(s.shape)}")
    return w, s


@dataclass(frozen=True)
class _Plan:
    """One shard of a quantized weight: the two regions to read, and the shard's values from
    their data."""

    shard: LocalShard
    regions: tuple[Region, Region]
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _fp8_plan(src: Source, shard: LocalShard, block: int) -> _Plan:
    w, s = _entries(src, shard, block)
    offset = (shard.box.offsets[0], shard.box.offsets[1])
    dtype = shard.local.dtype
    return _Plan(shard, (Region(w, shard.box), Region(s, scale_box(shard.box, block))),
                 lambda weight, scales: dequantize(weight, scales, dtype, block, offset))


def _mxfp4_plan(src: Source, shard: LocalShard) -> _Plan:
    blocks, scales = (src.index.tensors[encode_component(shard.key + s)] for s in _SUFFIXES["mxfp4"])
    hf_mxfp4.check_entries(shard.key, shard.global_shape, blocks, scales)
    bbox, sbox = hf_mxfp4.source_boxes(shard.box)
    box, dtype = shard.box, shard.local.dtype
    return _Plan(shard, (Region(blocks, bbox), Region(scales, sbox)),
                 lambda b, s: hf_mxfp4.values(b, s, box, dtype))


def _read_quantized(src: Source, targets: Mapping[str, Any], kinds: Mapping[str, str], block: int,
                    rank: int, buffer_bytes: int, verify: bool) -> int:
    """Read, dequantise and place this rank's box of every quantized target; returns the bytes
    read."""
    shards = [sh for k, v in targets.items() if (sh := local_shard(k, v, rank)) is not None and sh.box.volume]
    plans = [_fp8_plan(src, sh, block) if kinds[sh.key] == "fp8" else _mxfp4_plan(src, sh)
             for sh in shards]
    stream = read_regions(src, [r for p in plans for r in p.regions], buffer_bytes=buffer_bytes,
                          verify=verify)
    total = 0
    for plan in plans:
        (_, first), (_, second) = next(stream), next(stream)
        total += first.nbytes + second.nbytes
        plan.shard.local.copy_(plan.values(first, second))
    return total
