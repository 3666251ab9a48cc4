"""``StoreOptions``: how one store moves bytes (requests in flight, coalescing, durability, the
remote client, retries). Accepted wherever ``storage_options`` is; every store honours them.

``storage_options`` are the client's own keywords (credentials, endpoint, region), passed to
fsspec / s3fs / obstore as they are; ``StoreOptions`` tune ckptfs's I/O layer on top of them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ckptfs.errors import ConfigError
from ckptfs.io.retry import RetryPolicy

MiB = 2**20

#: remote clients a store can be opened with
CLIENTS = ("fsspec", "obstore")


@dataclass(frozen=True)
class StoreOptions:
    """Tuning of the I/O layer; the defaults suit local disks and object stores alike."""

    #: requests in flight at once per store
    max_concurrency: int = 16
    #: bytes: reads of one file closer than this are fetched as one request
    max_gap: int = 64 * 1024
    #: bytes: upper bound of one coalesced request
    max_span: int = 64 * MiB
    #: make local writes durable (fsync, and the directory of the index) before the commit
    fsync: bool = True
    #: remote client: "fsspec" (s3fs for s3://, the fsspec package elsewhere) or "obstore"
    #: (s3:// with s3fs-style options translated; gs://, az://, ... through obstore.from_url)
    client: str = "fsspec"
    #: bytes of ranged reads and upload parts in flight at once
    max_bytes_in_flight: int = 512 * MiB
    #: bytes: multipart upload part size (and pre-download piece size)
    part_size: int = 32 * MiB
    #: parts of one file uploaded at once
    upload_concurrency: int = 4
    #: extra attempts for a transient error (5xx, throttling, dropped connections, timeouts)
    retries: int = 5
    #: seconds: first backoff cap; doubles per retry, full jitter
    retry_delay: float = 0.2
    #: seconds: upper bound of one backoff
    retry_max_delay: float = 10.0
    #: local stores read pieces that are not in the page cache with O_DIRECT (through aligned
    #: bounce buffers): a cold read costs a copy instead of filling the page cache
    direct_reads: bool = False
    #: local stores: a load reads the bytes it needs from one file as this many contiguous runs,
    #: each front to back one request at a time (sequential runs read faster cold)
    read_streams: int = 4
    #: bytes: largest single read request of a local store (a coalesced span is cut into these)
    read_piece: int = 32 * MiB

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ConfigError(f"StoreOptions.client must be one of {CLIENTS}, got {self.client!r}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"StoreOptions.{f.name} must be an int, got {value!r}")
            if f.name in _POSITIVE and value < 1:
                raise ConfigError(f"StoreOptions.{f.name} must be at least 1, got {value!r}")
        for name in ("max_gap", "retries", "retry_delay", "retry_max_delay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"StoreOptions.{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def retry_policy(self) -> RetryPolicy:
        return RetryPolicy(self.retries, self.retry_delay, self.retry_max_delay)


_POSITIVE = frozenset({"max_concurrency", "max_span", "max_bytes_in_flight", "part_size",
                       "upload_concurrency", "read_streams", "read_piece"})
