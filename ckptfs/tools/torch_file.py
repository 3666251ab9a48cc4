"""A ``torch.save`` file written one tensor at a time, byte for byte what ``torch.save`` writes.

1. ``torch.save`` writes the container under ``torch.serialization.skip_data`` with
   uninitialised tensors standing in for the real ones: the pickle, every record and the zip
   directory, with holes where the storages go (a sparse file). Their memory is allocated but
   never touched, so it costs address space, not resident memory.
2. ``torch.load(map_location="meta")`` of that file tells each tensor's storage offset.
3. Each tensor's bytes are written into its hole as it arrives; then the CRC-32 of every
   storage record (central directory and data descriptor) and the serialization id, which
   folds the CRC-32 of every earlier record, are filled in (formats/torch_dist-1.md §Blobs).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import torch

from ckptfs.layout.backends.torch_dist_zip import (
    _DESCRIPTOR,
    _LOCAL,
    ZipRecord,
    _hash_combine,
    _run_sync,
    locate_records,
)
from ckptfs.layout.crc32 import crc32
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.state.flatten import flatten


class TorchFileWriter:
    """Write the ``torch.save`` file ``path`` of the object ``build`` returns, then
    ``write(key, tensor)`` once per tensor (canonical key, any order), then ``close``."""

    def __init__(self, path: str | os.PathLike, build: Any) -> None:
        """``build(make)`` returns the object to save; it calls ``make(key, dtype, shape)`` for
        every tensor (an uninitialised stand-in)."""
        self.path = os.fspath(path)
        shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

        def make(key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
            shapes[key] = (dtype, tuple(shape))
            return torch.empty(shape, dtype=dtype)

        obj = build(make)
        with torch.serialization.skip_data():
            torch.save(obj, self.path)
        del obj
        meta = flatten(torch.load(self.path, map_location="meta", weights_only=True)).tensors
        if set(meta) != set(shapes):
            raise AssertionError(f"torch file {self.path}: saved keys {sorted(meta)[:5]} differ "
                                 f"from the planned {sorted(shapes)[:5]}")
        size = os.path.getsize(self.path)
        self._f = open(self.path, "r+b")  # noqa: SIM115 - closed in close()
        records = _run_sync(locate_records(size), self._read)
        assert isinstance(records, tuple)
        self._records = sorted(records, key=lambda r: r.header_offset)
        by_start = {self._payload_start(r): r for r in self._records}
        self._slots: dict[str, tuple[ZipRecord, int, torch.dtype, tuple[int, ...]]] = {}
        for key, t in meta.items():
            offset = t.untyped_storage()._checkpoint_offset
            rec = by_start.get(offset)
            dtype, shape = shapes[key]
            if rec is None or t.storage_offset() != 0 or rec.size != t.untyped_storage().nbytes():
                raise AssertionError(f"torch file {self.path}: no storage record of key {key!r} "
                                     f"at offset {offset}")
            self._slots[key] = (rec, offset, dtype, shape)
        self._crcs: dict[str, int] = {}
        self.nbytes = size

    def _read(self, start: int, end: int) -> bytes:
        self._f.seek(start)
        return self._f.read(end - start)

    def _payload_start(self, rec: ZipRecord) -> int:
        head = self._read(rec.header_offset, rec.header_offset + 30)
        if head[:4] != _LOCAL:
            raise AssertionError(f"torch file {self.path}: no local header for {rec.name}")
        nlen, elen = struct.unpack_from("<HH", head, 26)
        return rec.header_offset + 30 + nlen + elen

    def write(self, key: str, t: torch.Tensor) -> None:
        rec, offset, dtype, shape = self._slots[key]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"torch file writer: key {key!r} is {dtype} {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}")
        data = tensor_bytes(t.contiguous())
        os.pwrite(self._f.fileno(), data, offset)
        self._crcs[rec.name] = crc32(data)

    def abort(self) -> None:
        """Stop after a failure (the partial file stays for inspection)."""
        self._f.close()

    def close(self) -> None:
        try:
            missing = sorted(k for k, s in self._slots.items()
                             if s[0].name not in self._crcs and s[0].size)
            if missing:
                raise ValueError(f"torch file writer: {len(missing)} tensor(s) never written, "
                                 f"first {missing[0]!r}")
            self._finish()
        finally:
            self._f.close()

    def _finish(self) -> None:
        """Fill in the storage records' CRC-32s, then the serialization id and its CRC-32."""
        sid = next((r for r in self._records if r.name.endswith("/.data/serialization_id")), None)
        for rec in self._records:
            if rec.name in self._crcs:
                self._set_crc(rec, self._crcs[rec.name])
        if sid is None:
            return
        fold = 0
        for rec in self._records:
            if rec is sid:
                break
            if rec.size:
                fold = _hash_combine(fold, self._crcs.get(rec.name, rec.crc))
        at = self._payload_start(sid)
        old = self._read(at, at + 40)
        new = old[:20] + f"{fold:020d}".encode()
        os.pwrite(self._f.fileno(), new, at)
        self._set_crc(sid, crc32(new))

    def _set_crc(self, rec: ZipRecord, crc: int) -> None:
        value = struct.pack("<I", crc)
        fd = self._f.fileno()
        os.pwrite(fd, value, rec.crc_at)
        if rec.flags & 0x8:
            end = self._payload_start(rec) + rec.compressed_size
            at = end + (4 if self._read(end, end + 4) == _DESCRIPTOR else 0)
            os.pwrite(fd, value, at)
        else:
            os.pwrite(fd, value, rec.header_offset + 14)

