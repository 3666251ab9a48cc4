"""Teach zarr-python the ML data types it lacks: bfloat16, float8_e4m3fn and float8_e5m2.

zarr-python (3.1 to 3.4) has no such data types, yet TensorStore and Megatron-Core write
``"bfloat16"`` as the v2 ``.zarray`` dtype, and the zarr-extensions registry names the v3
``data_type`` values ``bfloat16`` and ``float8_e5m2``. This module registers one ``ZDType`` per
name in zarr's public data type registry (``zarr.dtype``), built on the public ``ZDType`` ABC
only, so ``zarr.open_group(root)[path][...]`` returns ``ml_dtypes`` arrays (formats/zarr-2.md
§Data types). ckptfs itself never needs this to read or write: it is for plain zarr readers.

``register()`` is idempotent and returns False, with a warning, if this zarr-python has moved
the API; ``supported()`` tells whether zarr-python can read the types.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar, SupportsFloat, TypeGuard, cast

import ml_dtypes
import numpy as np

log = logging.getLogger(__name__)

#: ckptfs dtype name -> (zarr name, used in v2 ``dtype`` and v3 ``data_type``; numpy dtype)
ML_DTYPES: dict[str, tuple[str, np.dtype]] = {
    "bfloat16": ("bfloat16", np.dtype(ml_dtypes.bfloat16)),
    "float8_e4m3fn": ("float8_e4m3fn", np.dtype(ml_dtypes.float8_e4m3fn)),
    "float8_e5m2": ("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2)),
}

_registered: bool | None = None


def _make_class(zarr_name: str, native: np.dtype) -> type:
    from zarr.dtype import DataTypeValidationError, ZDType

    def _mismatch(what: object) -> Exception:
        return DataTypeValidationError(f"not {zarr_name}: {what!r}")

    @dataclass(frozen=True, kw_only=True)
    class MLFloat(ZDType[Any, Any]):
        dtype_cls: ClassVar[type] = type(native)
        _zarr_v3_name: ClassVar[str] = zarr_name
        endianness: str = "little"

        @classmethod
        def _check_native_dtype(cls, dtype: Any) -> TypeGuard[Any]:
            return isinstance(dtype, np.dtype) and dtype == native

        @classmethod
        def from_native_dtype(cls, dtype: Any) -> MLFloat:
            # must raise DataTypeValidationError on a mismatch, or the registry would resolve
            # other dtypes (uint16, ...) to this one
            if cls._check_native_dtype(dtype):
                return cls()
            raise _mismatch(dtype)

        def to_native_dtype(self) -> np.dtype:
            return native

        @classmethod
        def _from_json_v2(cls, data: Any) -> MLFloat:
            if isinstance(data, dict) and data.get("name") == zarr_name \
                    and data.get("object_codec_id") is None:
                return cls()
            raise _mismatch(data)

        @classmethod
        def _from_json_v3(cls, data: Any) -> MLFloat:
            if data == zarr_name:
                return cls()
            raise _mismatch(data)

        def to_json(self, zarr_format: int) -> Any:
            if zarr_format == 2:
                return {"name": zarr_name, "object_codec_id": None}
            return zarr_name

        @property
        def item_size(self) -> int:
            return native.itemsize

        def _check_scalar(self, data: object) -> bool:
            return isinstance(data, int | float | np.generic | str)

        def cast_scalar(self, data: object) -> Any:
            if data is None:
                return self.default_scalar()
            if not self._check_scalar(data):
                raise TypeError(f"cannot cast {data!r} to {zarr_name}")
            return native.type(float(cast("SupportsFloat | str", data)))  # checked just above

        def default_scalar(self) -> Any:
            return native.type(0.0)

        def from_json_scalar(self, data: Any, *, zarr_format: int) -> Any:
            if data is None:  # Megatron/TensorStore v2 arrays have "fill_value": null
                return self.default_scalar()
            if isinstance(data, str) and data.startswith("0x"):  # v3 raw bit pattern
                bits = np.array(int(data, 16), dtype=f"<u{native.itemsize}")
                return bits.view(native)[()]
            return native.type(float(data))

        def to_json_scalar(self, data: object, *, zarr_format: int) -> Any:
            v = float(self.cast_scalar(data))
            if math.isnan(v):
                return "NaN"
            if math.isinf(v):
                return "Infinity" if v > 0 else "-Infinity"
            return v

    MLFloat.__name__ = MLFloat.__qualname__ = "".join(p.capitalize() for p in zarr_name.split("_"))
    return MLFloat


def register() -> bool:
    """Register the ML data types with zarr-python (idempotent); False if this zarr cannot."""
    global _registered
    if _registered is not None:
        return _registered
    try:
        from zarr.dtype import data_type_registry

        for zarr_name, native in ML_DTYPES.values():
            try:
                data_type_registry.get(zarr_name)  # someone (a newer zarr?) has it already
            except KeyError:
                data_type_registry.register(zarr_name, _make_class(zarr_name, native))
        _registered = True
    except Exception as e:  # an API move in a future zarr must not break ckptfs
        log.warning("ckptfs: cannot register bfloat16/float8 with zarr-python: %s", e)
        _registered = False
    return _registered


def supported() -> bool:
    """Whether zarr-python reads and writes bfloat16/float8 arrays (after ``register()``)."""
    return register()
