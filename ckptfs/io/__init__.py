"""How bytes move: one asyncio layer over fsspec that every backend goes through."""

from ckptfs.io.loop import run_sync
from ckptfs.io.open import open_store
from ckptfs.io.ranges import ByteRange, ReadInto, coalesce
from ckptfs.io.store import IOConfig, IOStats, Store

__all__ = ["ByteRange", "IOConfig", "IOStats", "ReadInto", "Store", "coalesce", "open_store",
           "run_sync"]
