"""GPUDirect Storage: chunks read from local files straight into CUDA targets with kvikio.

Used when ``LoadOptions.gds`` is set and it can work: the store is a local filesystem, ``kvikio``
(the kvikio-cu12 / kvikio-cu13 package) imports, and the load runs with ``verify=False`` (the
crc32c check needs the bytes on the host, which is what GDS avoids). Otherwise ``gds_reader``
warns once, naming the reason, and the load goes through the pinned ring (engine/memory/ring.py).
Only regions that are one byte run in the file and contiguous in the target are read directly;
the rest also go through the ring. Each file is found through the store's wrappers: a delta's
reference (formats/README.md §2.5, engine/load/bases.py) is read from its base's file where
that is a local file too (a base on an object store goes through the ring), a pre-downloaded
checkpoint from its cache (engine/load/pre_download.py). Without the GDS driver kvikio runs
in its compatibility mode (POSIX reads through its own bounce buffers), which can be slower
than the ring: the docs' performance page has the numbers.
"""

from __future__ import annotations

import asyncio
import warnings
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from ckptfs.io.local_store import LocalStore
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.io.wrapper import innermost
from ckptfs.layout.backend import RawChunk
from ckptfs.layout.geometry import region_runs
from ckptfs.planning.load_plan import ReadPiece

#: what ``LoadOptions.gds`` needs and lacks, for the warning
INSTALL_HINT = "pip install kvikio-cu12 (or kvikio-cu13 for CUDA 13)"


class GdsFallbackWarning(UserWarning):
    """``LoadOptions.gds`` was asked for and cannot be used; the load reads through the ring."""


def gds_reader(store: Store, verify: bool) -> DirectReads | None:
    """A ``DirectReads`` for ``store``, or None with a ``GdsFallbackWarning`` saying why not."""
    why = gds_unavailable(store, verify)
    if why is not None:
        warnings.warn(f"LoadOptions.gds: {why}; reading through the pinned ring instead",
                      GdsFallbackWarning, stacklevel=3)
        return None
    import kvikio

    return DirectReads(store, kvikio)


def local_file(store: Store, path: str) -> str | None:
    """The local file that serves ``path`` through ``store`` and its wrappers (None: a store
    of another kind serves it)."""
    store, path = innermost(store, path)
    return store.local_path(path) if isinstance(store, LocalStore) else None


def gds_unavailable(store: Store, verify: bool) -> str | None:
    """Why GDS cannot serve a load from ``store`` (None: it can)."""
    if verify:
        return "GPUDirect Storage reads skip the crc32c check, so they run only with verify=False"
    store = innermost(store)[0]
    if not isinstance(store, LocalStore):
        return f"{store.url} is not a local filesystem"
    try:
        import kvikio  # noqa: F401
    except ImportError as e:
        return f"kvikio is not importable ({e}; {INSTALL_HINT})"
    return None


class DirectReads:
    """The reads of one load that go straight to the device: ``add`` while planning, then
    ``run`` once (concurrently with the other reads)."""

    def __init__(self, store: Store, kvikio: Any) -> None:
        self.store = store  #: the files are found through it (``local_file``)
        self.kvikio = kvikio
        self.items: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self.paths: dict[str, str] = {}  #: a file as the reads name it -> its local path

    def through(self, store: Store) -> DirectReads:
        """A ``DirectReads`` (nothing added yet) that finds the files through ``store``: the
        store a delta's reads run through, which serves its references from their bases."""
        return DirectReads(store, self.kvikio)

    def add(self, job: Any, piece: ReadPiece, src: RawChunk, itemsize: int) -> bool:
        """Take ``piece`` if its region is one run of a local file and contiguous in the
        target."""
        dst = job.target[piece.dst.slices()]
        if dst.device.type != "cuda" or not dst.is_contiguous():
            return False
        starts, _ = region_runs(src.stored_shape or piece.chunk.shape, itemsize, piece.src)
        if len(starts) != 1:
            return False
        # a byte view: torch's __cuda_array_interface__ has no bfloat16
        return self.take(src.file, src.offset + int(starts[0]), dst.reshape(-1).view(torch.uint8))

    def take(self, file: str, offset: int, dst: torch.Tensor) -> bool:
        """Read ``dst.numel()`` bytes of ``file`` at ``offset`` into the byte tensor ``dst``
        when a local file serves ``file`` (False: it does not, read it another way)."""
        full = self.paths.get(file) or local_file(self.store, file)
        if full is None:
            return False
        self.paths[file] = full
        self.items[file].append((offset, dst))
        return True

    async def run(self, store: Store, damaged: Callable[[str, Collection[str], str], Exception],
                  keys_of: Mapping[str, Collection[str]]) -> None:
        """Run every read; a missing or short file is ``damaged(file, keys, what)``."""

        def one_file(path: str, items: list[tuple[int, torch.Tensor]]) -> int:
            full = self.paths[path]
            try:
                with self.kvikio.CuFile(full, "r") as f:
                    futures = [(f.pread(dst, dst.numel(), off), off, dst.numel())
                               for off, dst in items]
                    got = 0
                    for fut, off, n in futures:
                        k = fut.get()
                        if k != n:
                            raise damaged(path, keys_of[path], f"the data file is truncated "
                                          f"(wanted bytes [{off}, {off + n}), got {k})")
                        got += k
                    return got
            except FileNotFoundError as e:
                raise damaged(path, keys_of[path], f"the data file is missing ({e})") from None

        async def go(path: str, items: list[tuple[int, torch.Tensor]]) -> None:
            async with store.semaphore:
                n = await asyncio.to_thread(one_file, path, items)
            store.stats.add_read(n, len(items))

        if self.items:
            await gather_all(*(go(p, i) for p, i in self.items.items()))
            if torch.cuda.is_available():  # the reads land in CUDA tensors (``add``)
                torch.cuda.synchronize()
