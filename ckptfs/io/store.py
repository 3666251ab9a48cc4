"""The Store ABC: the whole contract between ckptfs and a storage system."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any, Self

from ckptfs.errors import MalformedIndexError, ReadOnlyStoreError
from ckptfs.io.budget import ByteBudget
from ckptfs.io.options import StoreOptions
from ckptfs.io.ranges import ReadInto, coalesce
from ckptfs.io.streamed import StreamedPart
from ckptfs.io.tasks import gather_all

Buffer = bytes | bytearray | memoryview
#: a part of a file ``Store.put`` writes: host bytes, or (stores with ``streams_parts``)
#: bytes produced while they are written (io/streamed.py)
Part = Buffer | StreamedPart


def path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path inside a checkpoint root (formats/README.md §1:
    '/'-separated non-empty components, none '.' or '..', no backslash or NUL, not absolute), or
    None."""
    if not path:
        return "it is empty"
    if "\0" in path:
        return "it holds a NUL character"
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
    if path and (path.startswith("/") or "\\" in path or "\0" in path or ".." in path.split("/")):
        raise MalformedIndexError(f"{path!r} is not a path inside the checkpoint root {root} "
                                  f"({path_problem(path)}); refused before any request")
    return path


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

    #: the client options it was opened with (``open_store``'s ``storage_options``): how a base
    #: checkpoint of the same kind elsewhere is opened (engine/load/bases.py)
    storage_options: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, url: str, options: StoreOptions | None = None) -> None:
        self.url = url
        self.options = options or StoreOptions()
        self.stats = IOStats()
        self._sem: asyncio.Semaphore | None = None
        self._budget: ByteBudget | None = None

    @property
    def semaphore(self) -> asyncio.Semaphore:
        """Bounds requests in flight (created lazily inside the running loop)."""
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.options.max_concurrency)
        return self._sem

    @property
    def budget(self) -> ByteBudget:
        """Bounds bytes of requests in flight (created lazily inside the running loop)."""
        if self._budget is None:
            self._budget = ByteBudget(self.options.max_bytes_in_flight)
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

    @property
    def streams_in_place(self) -> bool:
        """Whether ``put`` writes each view of a ``StreamedPart`` as it comes, without copying it
        (a local disk; implies ``streams_parts``): the engine then hands it host chunk bytes as
        streamed parts too, to checksum each slice as it is written (engine/save/checked_parts.py)."""
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
        groups = coalesce(reads, self.options.max_gap, self.options.max_span)

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
        files, so equal bytes mean this save wrote it). Bytes of the right length that differ
        are read again, twice at most: a body damaged on the way (a client that checks no
        checksum of what it downloads, as gcsfs) must not pass for another save's."""
        try:
            for _ in range(3):
                got = bytes(await self.get(path))
                if got == data:
                    return True
                if len(got) != len(data):
                    return False
            return False
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

    def sibling(self, url: str) -> Store | None:
        """A store for the checkpoint root ``url`` served by this store's client (its session,
        credentials and endpoint), or None where the store cannot (another place, another kind
        of store: open ``url`` then). Closing it leaves this store's client open. How a delta
        checkpoint reads a base in the same bucket (engine/load/bases.py)."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release sessions and connections. Closing twice is harmless; a store is not used
        after it is closed."""
