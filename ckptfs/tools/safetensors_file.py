"""A safetensors file written one tensor at a time.

The header (every tensor's name, dtype, shape and data offsets) depends only on metadata, so it
is written first and each tensor's bytes follow as they arrive: memory holds one tensor, not
the file. Layout as ``safetensors.torch.save_file`` writes it: an 8-byte little-endian header
length, the JSON header padded with spaces to a multiple of 8, then the tensors largest
element size first (every tensor stays aligned to its element size), contiguous, no gaps.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ckptfs.layout.dtypes import DType
from ckptfs.layout.tensor_bytes import tensor_bytes


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """A tensor of the file: its name in the header, dtype and shape."""

    name: str
    dtype: DType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def layout(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None
           ) -> tuple[bytes, list[TensorSpec]]:
    """(the header bytes including their length prefix, the specs in data order)."""
    ordered = sorted(specs, key=lambda s: (-s.dtype.itemsize, s.name))
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    pos = 0
    for s in ordered:
        header[s.name] = {"dtype": s.dtype.safetensors, "shape": list(s.shape),
                          "data_offsets": [pos, pos + s.nbytes]}
        pos += s.nbytes
    raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


class SafetensorsWriter:
    """Write ``path``: ``layout`` fixes the order, then ``write(name, tensor)`` once per tensor
    in that order (``order``), then ``close``. A mismatch raises ValueError naming the tensor."""

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec],
                 metadata: Mapping[str, str] | None = None) -> None:
        header, self.order = layout(specs, metadata)
        self._next = 0
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(header)
        self._pos = len(header)  #: where the next tensor's bytes go
        self.nbytes = len(header) + sum(s.nbytes for s in self.order)

    def write(self, name: str, t: torch.Tensor) -> None:
        self._check(name, t.dtype, tuple(t.shape))
        self._f.write(tensor_bytes(t.contiguous()))
        self._next += 1
        self._pos += self.order[self._next - 1].nbytes

    def place(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
        """(file descriptor, byte offset) where the next tensor, ``name``, goes, for the caller
        to fill with ``os.pwrite`` instead of ``write``; the checks of ``write``."""
        spec = self._check(name, dtype, shape)
        self._f.flush()
        at = self._pos
        self._pos += spec.nbytes
        self._f.seek(self._pos)  # the next write follows the placed bytes
        self._next += 1
        return self._f.fileno(), at

    def _check(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> TensorSpec:
        spec = self.order[self._next]
        if name != spec.name or dtype != spec.dtype.torch or shape != spec.shape:
            raise ValueError(f"safetensors writer: expected {spec.name!r} {spec.dtype.name} "
                             f"{list(spec.shape)} next, got {name!r} {dtype} {list(shape)}")
        return spec

    def abort(self) -> None:
        """Stop after a failure (the partial file stays for inspection)."""
        self._f.close()

    def close(self) -> None:
        try:
            if self._next != len(self.order):
                raise ValueError(f"safetensors writer: {len(self.order) - self._next} tensor(s) "
                                 f"never written, first {self.order[self._next].name!r}")
        finally:
            self._f.close()


def create_sized(path: str | os.PathLike, header: bytes, size: int) -> None:
    """A file of ``size`` bytes starting with ``header``, for ``SafetensorsPart`` writers to
    fill (the rest reads as zeros until they do)."""
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(size)


class SafetensorsPart:
    """Some tensors of a safetensors file that several writers fill at once: ``create_sized``
    made the file (header and full size) first; ``write(name, tensor)`` puts a tensor's bytes
    at its place, in any order; then ``close``. A tensor the layout does not have, or of
    another dtype or shape, raises ValueError naming it."""

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec],
                 metadata: Mapping[str, str] | None = None) -> None:
        header, order = layout(specs, metadata)
        self._places: dict[str, tuple[TensorSpec, int]] = {}
        pos = len(header)
        for s in order:
            self._places[s.name] = (s, pos)
            pos += s.nbytes
        self._fd = os.open(path, os.O_WRONLY)

    def write(self, name: str, t: torch.Tensor) -> None:
        self.write_run(name, tuple(t.shape), 0, t)

    def write_run(self, name: str, shape: tuple[int, ...], start: int, t: torch.Tensor) -> None:
        """``t``'s bytes as tensor ``name``'s elements from its C-order element ``start`` on (a
        row shard's rows; ``shape``: the whole tensor's), with the checks of ``write``; a run
        past the tensor's end raises ValueError naming it."""
        _, pos = self.place(name, t.dtype, shape)
        spec = self._places[name][0]
        view = tensor_bytes(t.contiguous())
        if start < 0 or start * spec.dtype.itemsize + view.nbytes > spec.nbytes:
            raise ValueError(f"safetensors part: {name!r}: {view.nbytes} bytes from element "
                             f"{start} do not fit its {spec.nbytes} bytes")
        pos += start * spec.dtype.itemsize
        while view.nbytes:
            n = os.pwrite(self._fd, view, pos)
            view, pos = view[n:], pos + n

    def place(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
        """(file descriptor, byte offset) of tensor ``name``'s place, for the caller to fill
        with ``os.pwrite`` instead of ``write``; the checks of ``write``."""
        spec, pos = self._places.get(name, (None, 0))
        if spec is None or dtype != spec.dtype.torch or shape != spec.shape:
            want = "nothing" if spec is None else f"{spec.dtype.name} {list(spec.shape)}"
            raise ValueError(f"safetensors part: {name!r} is {dtype} {list(shape)}, the "
                             f"file's layout has {want} for it")
        return self._fd, pos

    def close(self) -> None:
        os.close(self._fd)
