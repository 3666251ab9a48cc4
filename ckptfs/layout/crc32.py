"""CRC-32 (zlib's polynomial), the checksum a zip container keeps of every record: what a
``torch.save`` blob of the torch_dist layout needs of each chunk's bytes (formats/torch_dist-1.md).

The isal package (ISA-L's folding CRC, without the GIL) computes it where it is installed:
several times the speed of the zlib CPython links (docs/performance.md), which a torch_dist save
pays once per byte it writes. zlib's ``crc32`` otherwise; both give the same value.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any


def _fastest() -> Callable[[Any, int], int]:
    """isal's ``crc32`` where it imports and agrees with zlib's on a probe, else zlib's."""
    try:
        from isal import isal_zlib
    except ImportError:
        return zlib.crc32
    probe = b"123456789"
    if isal_zlib.crc32(probe, 7) != zlib.crc32(probe, 7):
        return zlib.crc32
    return isal_zlib.crc32


_crc32 = _fastest()


def crc32(data: Any, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any contiguous buffer), continuing from ``value``."""
    return _crc32(data, value)
