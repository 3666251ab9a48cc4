"""Chunk checksums: crc32c of a chunk's raw C-order bytes, written as "crc32c:<8 hex digits>"."""

from __future__ import annotations

import google_crc32c
import numpy as np

ALGORITHM = "crc32c"


def checksum(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    """The index form of the checksum of ``data``."""
    arr = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    return f"{ALGORITHM}:{google_crc32c.value(arr):08x}"
