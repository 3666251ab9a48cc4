"""How bytes move: the ``Store`` ABC (store.py) and its implementations: local files
(local_store.py), any fsspec filesystem (fsspec_store.py, s3fs in s3.py), obstore
(obstore_store.py), and stores that forward to others (wrapper.py, prefixed.py, routed.py);
``open_store`` picks one by URL protocol from the store registry (registry.py).
The engine reads and writes through a store; backends never touch one."""

from ckptfs.io.loop import run_sync
from ckptfs.io.open import open_store
from ckptfs.io.options import StoreOptions
from ckptfs.io.ranges import ByteRange, ReadInto, coalesce
from ckptfs.io.registry import StoreRequest, register_store, store_protocols
from ckptfs.io.store import IOStats, Store
from ckptfs.io.wrapper import ReadOnlyStore, WrapperStore

__all__ = ["ByteRange", "IOStats", "ReadInto", "ReadOnlyStore", "Store", "StoreOptions",
           "StoreRequest", "WrapperStore", "coalesce", "open_store", "register_store",
           "run_sync", "store_protocols"]
