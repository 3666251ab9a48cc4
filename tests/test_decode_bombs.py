"""Decompression bombs in zarr chunks: a stored chunk that expands (or says it expands) far
beyond the shape its index declares is refused with IntegrityError naming the key, the chunk
and its file, and the load's memory stays bounded (tracemalloc), whatever codec the index names:
the streamed compressors (zlib, gzip, bz2, lzma) are inflated a bounded piece at a time, and
blosc, lz4 and zstd have their declared sizes checked before decoding, at every stage of the
pipeline (an inner stage, one before the last, gets no output buffer to bound it).

A sound chunk through each of those codecs still loads exact.
"""

from __future__ import annotations

import bz2
import functools
import gzip
import json
import lzma
import struct
import tracemalloc
import zlib
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.layout.index import INDEX_FILE, seal

numcodecs = pytest.importorskip("numcodecs")

SHAPE = (64, 64)  #: the chunk's declared shape: 16 KiB of float32
BOMB = 32 << 20  #: what the bombs inflate to
PEAK = 16 << 20  #: the most a refused load may allocate (lzma's decoder takes its 8 MiB dictionary)


def _crc(data: bytes) -> str:
    return f"crc32c:{google_crc32c.value(data):08x}"


def _strip_content_size(frame: bytes) -> bytes:
    """A zstd frame without its content size (a streaming writer's frame)."""
    fhd = frame[4]
    assert not (fhd >> 5) & 1, "a single-segment frame has no window descriptor to keep"
    at = 5 + 1 + (0, 1, 2, 4)[fhd & 3]
    return frame[:4] + bytes([fhd & 0x3F]) + frame[5:at] + frame[at + (0, 2, 4, 8)[fhd >> 6]:]


def _zstd_claiming(size: int) -> bytes:
    """A zstd frame header (single segment, 8-byte content size) claiming ``size`` bytes."""
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", size) + b"\x01\x00\x00"


@functools.cache
def bombs() -> dict[str, tuple[list[dict], bytes]]:
    """name -> (the tensor's codecs, the stored chunk)."""
    zeros = bytes(BOMB)
    inner_zstd = [{"id": "crc32c"}, {"id": "zstd", "level": 1}]  # zstd decoded first
    return {
        "zlib": ([{"id": "zlib", "level": 9}], zlib.compress(zeros, 9)),
        "gzip": ([{"id": "gzip", "level": 9}], gzip.compress(zeros, 9)),
        "bz2": ([{"id": "bz2", "level": 1}], bz2.compress(zeros, 1)),
        "lzma": ([{"id": "lzma"}], lzma.compress(zeros, preset=1)),
        "lz4-claim": ([{"id": "lz4"}], struct.pack("<i", 1 << 30) + b"\0" * 8),
        "blosc-inner-claim": ([{"id": "crc32c"}, {"id": "blosc"}],
                              numcodecs.Blosc(cname="zstd").encode(zeros)),
        "zstd-inner-claim": (inner_zstd, _zstd_claiming(1 << 40)),
        "zstd-inner-unsized": (inner_zstd, _strip_content_size(numcodecs.Zstd(level=1).encode(zeros))),
    }


def _plant(tmp_path: Path, codecs: list[dict], stored: bytes) -> Path:
    """A zarr checkpoint of one 64x64 chunk whose index names ``codecs`` and whose chunk file
    holds ``stored`` (the index sealed again)."""
    root = tmp_path / "ck"
    ckptfs.save({"w": torch.zeros(SHAPE)}, root, backend="zarr",
                 backend_options={"compressor": "zstd"})
    body = json.loads((root / INDEX_FILE).read_bytes())
    body.pop("index_checksum")
    entry = body["tensors"]["w"]
    (chunk,) = entry["chunks"]
    chunk.update(byte_offset=0, byte_length=len(stored))
    chunk.pop("checksum", None)
    entry["extra"] = {**entry.get("extra", {}), "codecs": codecs}
    body["files"][chunk["file"]] = len(stored)
    body.get("file_checksums", {})[chunk["file"]] = _crc(stored)
    (root / chunk["file"]).write_bytes(stored)
    (root / INDEX_FILE).write_bytes(seal(json.dumps(body).encode()))
    return root


@pytest.mark.parametrize("name", list(bombs()))
def test_a_chunk_that_expands_beyond_its_shape_is_refused_in_bounded_memory(tmp_path, name):
    codecs, stored = bombs()[name]
    root = _plant(tmp_path, codecs, stored)
    tracemalloc.start()
    try:
        with pytest.raises(ckptfs.IntegrityError) as e:
            ckptfs.load_keys(root)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    text = str(e.value)
    assert "key 'w'" in text and "chunk at [0, 0]" in text and "w/c/0/0" in text, text
    assert peak < PEAK, f"{name}: the refused load allocated {peak >> 20} MiB"


@pytest.mark.parametrize("codecs", [
    [{"id": "zlib", "level": 1}], [{"id": "gzip", "level": 1}], [{"id": "bz2", "level": 1}],
    [{"id": "lzma"}], [{"id": "lz4"}], [{"id": "crc32c"}, {"id": "blosc"}],
    [{"id": "crc32c"}, {"id": "zstd"}], [{"id": "shuffle", "elementsize": 4}, {"id": "zlib"}],
], ids=lambda c: "+".join(x["id"] for x in c))
def test_a_sound_chunk_through_each_codec_loads_exact(tmp_path, codecs):
    want = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE)
    pipe = [numcodecs.get_codec(dict(c)) for c in codecs]
    buf = np.ascontiguousarray(want.numpy())
    for c in pipe:  # encoding order
        buf = c.encode(buf)
    root = _plant(tmp_path, codecs, bytes(memoryview(buf).cast("B")))
    got = ckptfs.load_keys(root)["w"]
    assert torch.equal(got, want)
