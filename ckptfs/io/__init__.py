"""How bytes move: the async Store ABC and its stores (local files; fsspec, s3fs and obstore
for remote URLs), with the options that tune them."""

from ckptfs.io.loop import run_sync
from ckptfs.io.open import open_store
from ckptfs.io.options import StoreOptions
from ckptfs.io.ranges import ByteRange, ReadInto, coalesce
from ckptfs.io.store import IOStats, Store

__all__ = ["ByteRange", "IOStats", "ReadInto", "Store", "StoreOptions", "coalesce", "open_store",
           "run_sync"]
