"""Data type names of the format and their torch, safetensors and zarr equivalents."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DType:
    """One storable data type."""

    name: str  #: name in the index (formats/README.md §Data types)
    torch: torch.dtype
    itemsize: int
    safetensors: str  #: dtype string in a safetensors header


_ALL = (
    DType("bool", torch.bool, 1, "BOOL"),
    DType("uint8", torch.uint8, 1, "U8"),
    DType("int8", torch.int8, 1, "I8"),
    DType("int16", torch.int16, 2, "I16"),
    DType("int32", torch.int32, 4, "I32"),
    DType("int64", torch.int64, 8, "I64"),
    DType("float16", torch.float16, 2, "F16"),
    DType("bfloat16", torch.bfloat16, 2, "BF16"),
    DType("float32", torch.float32, 4, "F32"),
    DType("float64", torch.float64, 8, "F64"),
    DType("complex64", torch.complex64, 8, "C64"),
    DType("float8_e4m3fn", torch.float8_e4m3fn, 1, "F8_E4M3"),
    DType("float8_e5m2", torch.float8_e5m2, 1, "F8_E5M2"),
)
BY_NAME: dict[str, DType] = {d.name: d for d in _ALL}
BY_TORCH: dict[torch.dtype, DType] = {d.torch: d for d in _ALL}
BY_SAFETENSORS: dict[str, DType] = {d.safetensors: d for d in _ALL}  #: for foreign headers
NAMES: tuple[str, ...] = tuple(BY_NAME)
#: ckptfs dtype name -> the name other zarr implementations give this ML data type, which
#: zarr-python lacks (v2 ``dtype``, v3 ``data_type``; the zarr backends write it, and
#: layout/backends/zarr_dtypes.py teaches zarr-python the types)
ZARR_ML_NAMES: dict[str, str] = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
                                 "float8_e5m2": "float8_e5m2"}


def from_torch(dtype: torch.dtype, key: str = "?") -> DType:
    """The format's dtype for a torch dtype, or a clear error naming the key."""
    got = BY_TORCH.get(dtype)  # once per tensor staged: no import on this path
    if got is not None:
        return got
    from ckptfs.errors import UnsupportedValueError

    try:
        return BY_TORCH[dtype]
    except KeyError:
        raise UnsupportedValueError(
            f"key {key!r}: dtype {dtype} cannot be stored; supported: {', '.join(NAMES)}"
        ) from None


def from_name(name: str, key: str = "?") -> DType:
    """The dtype for an index name, or a clear error naming the key."""
    from ckptfs.errors import MalformedIndexError

    try:
        return BY_NAME[name]
    except KeyError:
        raise MalformedIndexError(
            f"key {key!r}: unknown dtype {name!r} in the index; known: {', '.join(NAMES)}"
        ) from None


def from_safetensors(code: str, where: str = "?") -> DType:
    """The dtype of a safetensors header dtype code ("F32", "BF16", ...), or a clear error naming
    ``where`` (the tensor and file) and the codes ckptfs can store."""
    from ckptfs.errors import UnsupportedValueError

    try:
        return BY_SAFETENSORS[code]
    except (KeyError, TypeError):  # TypeError: not a string (a list, an object) in the header
        raise UnsupportedValueError(
            f"{where}: safetensors dtype {code!r} is not supported; supported: "
            f"{', '.join(BY_SAFETENSORS)}"
        ) from None
