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

import ml_dtypes
import numpy as np

from ckptfs.layout.dtypes import ZARR_ML_NAMES

log = logging.getLogger(__name__)

#: ckptfs dtype name -> (zarr name, used in v2 ``dtype`` and v3 ``data_type``; numpy dtype)
ML_DTYPES: dict[str, tuple[str, np.dtype]] = {
    name: (zarr_name, np.dtype(getattr(ml_dtypes, name))) for name, zarr_name in ZARR_ML_NAMES.items()}

#: per-process: whether zarr-python's registry took the types (it is itself per process)
_registered: bool | None = None


def _make_class(zarr_name: str, native: np.dtype) -> type:
    """The zarr ``ZDType`` class of one ML data type (zarr imported only here: an extra)."""
    from ckptfs.layout.backends.zarr_mlfloat import MLFloat

    name = "".join(p.capitalize() for p in zarr_name.split("_"))
    return type(name, (MLFloat,), {"dtype_cls": type(native), "_zarr_v3_name": zarr_name,
                                   "native": native, "__qualname__": name})


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
