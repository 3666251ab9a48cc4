"""The Store ABC: the whole contract between ckptfs and a storage system."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Self

from ckptfs.errors import ConfigError, MalformedIndexError, ReadOnlyStoreError
from ckptfs.io.budget import ByteBudget
from ckptfs.io.ranges import ReadInto, coalesce
from ckptfs.io.retry import RetryPolicy
from ckptfs.io.streamed import StreamedPart
from ckptfs.io.tasks import gather_all

Buffer = bytes | bytearray | memoryview
#: a part of a file ``Store.put`` writes: host bytes, or (stores with ``streams_parts``)
#: bytes produced while they are written (io/streamed.py)
Part = Buffer | StreamedPart


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path inside a checkpoint root (formats/README.md §1:
    '/'-separated non-empty components, none '.' or '..', no backslash, not absolute), or None."""
    if not path:
        return "it is empty"
    if path.startswith("/"):
        return "it is absolute"
    if "\\" in path:
        return "it holds a backslash"
    if any(p in ("", ".", "..") for p in path.split("/")):
        return "it has an empty, '.' or '..' component"
    return None


def inside_root(path: str, root: str) -> str:
    """``path``, if it cannot leave the root (the stores' last line of defence: index, foreign
    metadata and backends are checked before, this holds whatever reached the store)."""
    if path and (path.startswith("/") or "\\" in path or ".." in path.split("/")):
        raise MalformedIndexError(f"{path!r} is not a path inside the checkpoint root {root} "
                                  f"({path_problem(path)}); refused before any request")
    return path


@dataclass(frozen=True, slots=True)
class IOConfig:
    """Tuning of the I/O layer; every store honours these."""

    max_concurrency: int = 16  #: requests in flight at once per store
    max_gap: int = 64 * 1024  #: reads closer than this are fetched as one request
    max_span: int = 64 * 2**20  #: upper bound on one coalesced request
    fsync: bool = True  #: make local writes durable before the index is committed
    #: remote client: "fsspec" (s3fs for s3://, the fsspec package elsewhere) or "obstore"
    #: (s3:// with s3fs-style options translated; gs://, az://, ... through obstore.from_url)
    engine: str = "fsspec"
    max_bytes_in_flight: int = 512 * 2**20  #: bytes of ranged reads and upload parts in flight
    #: host memory a load may hold at once for regions it cannot read in place (non-contiguous
    #: or non-CPU targets, encoded chunks); reads are batched to stay within it
    scratch_bytes: int = 512 * 2**20
    part_size: int = 32 * 2**20  #: multipart upload part size (and pre-download piece size)
    #: ``load(..., exchange=True)``: bytes one rank sends plus receives per exchange round (the
    #: memory in transit at once)
    exchange_bytes: int = 256 * 2**20
    upload_concurrency: int = 4  #: parts of one file uploaded at once
    retries: int = 5  #: extra attempts for a transient error (5xx, throttling, drops, timeouts)
    retry_delay: float = 0.2  #: first backoff cap in seconds; doubles per retry, full jitter
    retry_max_delay: float = 10.0  #: upper bound of one backoff
    #: pinned host memory a load into CUDA targets reads through: ``ring_slots`` buffers of
    #: ``ring_bytes // ring_slots`` (rounded down to a power of two, as torch pins) each
    ring_bytes: int = 512 * 2**20
    ring_slots: int = 8
    #: read chunks straight into CUDA targets with GPUDirect Storage (kvikio) where it can:
    #: a local store, kvikio importable, ``verify=False``; otherwise the ring, with a warning
    gds: bool = False
    #: local stores read the pieces of a load that are not in the page cache with O_DIRECT
    #: (through aligned bounce buffers): a cold read then costs the CPU a copy instead of
    #: filling the page cache, and leaves nothing cached (a second load reads the disk again);
    #: pieces already cached read as usual. Off by default: measured on a loaded 2-core VM it
    #: saved about 0.1 s of CPU per 1.5 GB (kernel time down 0.55 s, the copy up 0.45 s)
    direct_reads: bool = False
    #: local stores: a load reads the bytes it needs from one file as this many contiguous runs,
    #: each read front to back one request at a time, instead of every piece at once in any
    #: order. Measured on the 2-vCPU VM's virtio disk, cold, 1.1 GB: 8 such runs read 1.8x as
    #: fast as the same 8 MiB pieces 16 at a time in file order; 1-4 runs read as fast as 8 on
    #: one rank and 13% faster on two (README, "Performance")
    read_streams: int = 4
    #: OS nice value (0-19, Linux) of an asynchronous save's thread once staged (checksums,
    #: commit) and of the threads writing its local data files, so that a busy CPU serves the
    #: training loop first and idle CPUs the save; the write takes longer only when CPUs are
    #: busy (README, "Asynchronous save": measured). 0: the caller's priority
    background_nice: int = 10
    #: threads that copy a save's chunks into staging buffers (``async_save``, and the copies a
    #: save must make of non-contiguous data): copies of large tensors are cut into pieces of
    #: ``engine.copies.PIECE`` bytes copied in parallel (``copy_`` of one thread does not reach
    #: the memory bandwidth); small tensors are copied by the staging thread alone. None:
    #: min(4, the CPUs this process may run on)
    copy_threads: int | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"IOConfig.engine must be one of {ENGINES}, got {self.engine!r}")
        for name in ("max_concurrency", "max_bytes_in_flight", "part_size", "upload_concurrency",
                     "scratch_bytes", "exchange_bytes", "ring_bytes", "ring_slots", "read_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"IOConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.retries < 0:
            raise ConfigError(f"IOConfig.retries must be >= 0, got {self.retries}")
        if self.copy_threads is not None and self.copy_threads < 1:
            raise ConfigError(f"IOConfig.copy_threads must be at least 1, got {self.copy_threads}")
        if not 0 <= self.background_nice <= 19:
            raise ConfigError(f"IOConfig.background_nice must be 0-19, got {self.background_nice}")

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.retries, self.retry_delay, self.retry_max_delay)


ENGINES = ("fsspec", "obstore")


@dataclass(slots=True)
class IOStats:
    """Counters of one store: what a load or save really moved."""

    read_requests: int = 0
    bytes_read: int = 0
    write_requests: int = 0
    bytes_written: int = 0
    retries: int = 0  #: transient errors retried

    def add_read(self, nbytes: int, requests: int = 1) -> None:
        self.read_requests += requests
        self.bytes_read += nbytes


class Store(ABC):
    """Async access to the files under one checkpoint root. Paths are relative, '/'-separated.

    A store is opened (``open_store``, or its constructor inside the ckptfs I/O loop), used,
    then closed once: ``await store.close()``, or ``async with store:`` which closes it on exit.
    What a store can do is stated by its capability properties (``supports_writes``,
    ``supports_deletes``, ``supports_listing``, ``supports_ranged_reads``, ``streams_parts``)
    and ``read_only``; callers ask them instead of testing the store's class.
    ``ckptfs.testing.store_tests.StoreTests`` checks an implementation against this contract.
    """

    def __init__(self, url: str, config: IOConfig | None = None) -> None:
        self.url = url
        self.config = config or IOConfig()
        self.stats = IOStats()
        self._sem: asyncio.Semaphore | None = None
        self._budget: ByteBudget | None = None

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """Bounds requests in flight (created lazily inside the running loop)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.config.max_concurrency)
        return self._sem

    @property
    def budget(self) -> ByteBudget:
        """Bounds bytes of requests in flight (created lazily inside the running loop)."""
        if self._budget is None:
            self._budget = ByteBudget(self.config.max_bytes_in_flight)
        return self._budget

    # -- capabilities --------------------------------------------------------------------
    @property
    def read_only(self) -> bool:
        """True when this store refuses every write and delete with ``ReadOnlyStoreError``
        (a ``RoutedStore``, a ``ReadOnlyStore`` view); reads work as usual."""
        return False

    @property
    def supports_writes(self) -> bool:
        """Whether this kind of store can write (``put``, ``put_files``, ``put_if_absent``)."""
        return True

    @property
    def supports_deletes(self) -> bool:
        """Whether this kind of store can remove files (``delete``)."""
        return True

    @property
    def supports_listing(self) -> bool:
        """Whether ``list`` returns the files under a prefix."""
        return True

    @property
    def supports_ranged_reads(self) -> bool:
        """Whether ``get_range`` fetches only the bytes asked for (False: it reads the whole
        file and slices it; the results are the same, the bytes moved are not)."""
        return True

    @property
    def streams_parts(self) -> bool:
        """Whether ``put`` takes ``StreamedPart``s (writing each view before asking for the
        next); the engine gives other stores host bytes only."""
        return False

    def check_writable(self, path: str) -> None:
        """Raise ``ReadOnlyStoreError`` naming the store and ``path`` if this store is read-only
        (every write and delete method of a store that can be read-only calls it first)."""
        if self.read_only:
            raise ReadOnlyStoreError(f"{self.full_path(path)}: the store {self.url} is "
                                     f"read-only; refused to write or delete {path!r}")

    # -- lifecycle -------------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    def full_path(self, path: str) -> str:
        """The URL of ``path``, for messages."""
        return f"{self.url.rstrip('/')}/{path}"

    def read_streams(self, path: str) -> int | None:
        """How many sequential streams a large read of ``path`` should be split into: the
        engine then reads each contiguous run of its pieces in order, one ``read_into`` at a
        time. None (object stores): no preference, every piece may be in flight at once."""
        return None

    # -- reading ---------------------------------------------------------------------------
    @abstractmethod
    async def get_range(self, path: str, start: int, end: int) -> Buffer:
        """Bytes ``[start, end)`` of ``path``; raises FileNotFoundError naming the URL."""

    @abstractmethod
    async def get(self, path: str) -> Buffer:
        """All bytes of ``path``."""

    async def read_into(self, path: str, reads: Sequence[ReadInto]) -> None:
        """Fill each ``read.dest`` from ``path``; near reads are coalesced, requests run
        concurrently up to ``max_concurrency`` (``get_range`` holds the request semaphore and,
        in remote stores, the byte budget). Short reads raise an error naming the file."""
        groups = coalesce(reads, self.config.max_gap, self.config.max_span)

        async def one(g) -> None:
            data = await self.get_range(path, g.span.start, g.span.end)
            if len(data) != g.span.length:
                raise EOFError(
                    f"{self.full_path(path)}: wanted bytes [{g.span.start}, {g.span.end}), "
                    f"got {len(data)} bytes"
                )
            mv = memoryview(data)
            for r in g.reads:
                o = r.start - g.span.start
                r.dest[:] = mv[o : o + r.dest.nbytes]

        await gather_all(*(one(g) for g in groups))

    async def read_files(self, items: Sequence[tuple[str, Sequence[ReadInto]]]
                         ) -> list[BaseException | None]:
        """``read_into`` for several (small) files at once: each item's error, or None. The
        engine hands small files over in groups, so that a store can read a group with one
        request or one worker thread instead of paying a thread hop and a task per file (a local
        store does). Here: each file's ``read_into``, concurrently."""
        got = await asyncio.gather(*(self.read_into(p, r) for p, r in items), return_exceptions=True)
        return [g if isinstance(g, BaseException) else None for g in got]

    # -- writing ---------------------------------------------------------------------------
    @abstractmethod
    async def put(self, path: str, parts: Sequence[Part]) -> None:
        """Write the concatenation of ``parts`` as ``path`` (overwriting)."""

    async def put_files(self, items: Sequence[tuple[str, Sequence[Part]]]) -> None:
        """``put`` for several (small) files of host bytes at once. The engine hands many small
        files over in groups, so that a store can write a group in one worker thread instead of
        paying a thread hop and a task per file (a local store does). Here: each file's ``put``,
        concurrently; a failure cancels the others and raises."""
        await gather_all(*(self.put(p, parts) for p, parts in items))

    @abstractmethod
    async def put_if_absent(self, path: str, data: Buffer) -> None:
        """Create ``path`` atomically; raise FileExistsError if it exists (the commit)."""

    async def holds(self, path: str, data: bytes) -> bool:
        """True if ``path`` exists with exactly ``data``: tells a retried create whose first
        attempt landed (answer lost) from a real conflict (an index names its save's unique
        files, so equal bytes mean this save wrote it)."""
        try:
            return bytes(await self.get(path)) == data
        except FileNotFoundError:
            return False

    # -- namespace -------------------------------------------------------------------------
    @abstractmethod
    async def exists(self, path: str) -> bool: ...

    @abstractmethod
    async def size(self, path: str) -> int: ...

    async def version_tag(self, path: str) -> str:
        """A string that changes when ``path`` is rewritten (ETag on object stores; size and
        mtime or just size elsewhere); one metadata request, no data."""
        return f"size={await self.size(path)}"

    @abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """Relative paths of all files under ``prefix`` (recursive)."""

    @abstractmethod
    async def delete(self, paths: Sequence[str]) -> None:
        """Remove files; missing ones are ignored."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release sessions and connections. Closing twice is harmless; a store is not used
        after it is closed."""
