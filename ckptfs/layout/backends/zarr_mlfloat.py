"""``MLFloat``: the zarr-python ``ZDType`` of a floating type numpy lacks (bfloat16, float8);
``zarr_dtypes._make_class`` makes one subclass per type, setting ``native`` and the names.
Imported only when zarr-python is asked to learn the types (it imports zarr)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, SupportsFloat, TypeGuard, cast

import numpy as np
from zarr.dtype import DataTypeValidationError, ZDType


@dataclass(frozen=True, kw_only=True)
class MLFloat(ZDType[Any, Any]):
    """One ML float type; subclasses set ``native``, ``dtype_cls`` and ``_zarr_v3_name``."""

    native: ClassVar[np.dtype]
    dtype_cls: ClassVar[type]
    _zarr_v3_name: ClassVar[str]
    endianness: str = "little"

    @classmethod
    def _mismatch(cls, what: object) -> Exception:
        return DataTypeValidationError(f"not {cls._zarr_v3_name}: {what!r}")

    @classmethod
    def _check_native_dtype(cls, dtype: Any) -> TypeGuard[Any]:
        return isinstance(dtype, np.dtype) and dtype == cls.native

    @classmethod
    def from_native_dtype(cls, dtype: Any) -> MLFloat:
        # must raise DataTypeValidationError on a mismatch, or the registry would resolve
        # other dtypes (uint16, ...) to this one
        if cls._check_native_dtype(dtype):
            return cls()
        raise cls._mismatch(dtype)

    def to_native_dtype(self) -> np.dtype:
        return self.native

    @classmethod
    def _from_json_v2(cls, data: Any) -> MLFloat:
        if isinstance(data, dict) and data.get("name") == cls._zarr_v3_name \
                and data.get("object_codec_id") is None:
            return cls()
        raise cls._mismatch(data)

    @classmethod
    def _from_json_v3(cls, data: Any) -> MLFloat:
        if data == cls._zarr_v3_name:
            return cls()
        raise cls._mismatch(data)

    def to_json(self, zarr_format: int) -> Any:
        if zarr_format == 2:
            return {"name": self._zarr_v3_name, "object_codec_id": None}
        return self._zarr_v3_name

    @property
    def item_size(self) -> int:
        return self.native.itemsize

    def _check_scalar(self, data: object) -> bool:
        return isinstance(data, int | float | np.generic | str)

    def cast_scalar(self, data: object) -> Any:
        if data is None:
            return self.default_scalar()
        if not self._check_scalar(data):
            raise TypeError(f"cannot cast {data!r} to {self._zarr_v3_name}")
        return self.native.type(float(cast("SupportsFloat | str", data)))  # checked just above

    def default_scalar(self) -> Any:
        return self.native.type(0.0)

    def from_json_scalar(self, data: Any, *, zarr_format: int) -> Any:
        if data is None:  # Megatron/TensorStore v2 arrays have "fill_value": null
            return self.default_scalar()
        if isinstance(data, str) and data.startswith("0x"):  # v3 raw bit pattern
            bits = np.array(int(data, 16), dtype=f"<u{self.native.itemsize}")
            return bits.view(self.native)[()]
        return self.native.type(float(data))

    def to_json_scalar(self, data: object, *, zarr_format: int) -> Any:
        v = float(self.cast_scalar(data))
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "Infinity" if v > 0 else "-Infinity"
        return v
