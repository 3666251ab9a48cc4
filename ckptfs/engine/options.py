"""``SaveOptions`` and ``LoadOptions``: how the engine runs a save or a load (waits for other
ranks, copy threads, host and pinned memory budgets, verification). Shared by ``save``,
``async_save``, ``load`` and ``CheckpointManager``; the common call passes neither.

Each setting is defined in one class: what a save and a load share is ``DistOptions`` (nested
in both), an asynchronous save's writer and staging bound ``AsyncOptions``, the health checks
``HealthOptions`` (both nested in ``SaveOptions``).

Store settings (requests in flight, fsync, retries) are ``StoreOptions`` (ckptfs/io/options.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfs.errors import ConfigError

MiB = 2**20

#: environment variable giving the default of ``collective_timeout`` (seconds)
TIMEOUT_ENV = "CKPTFS_COLLECTIVE_TIMEOUT"

#: the kinds of writer an asynchronous save runs on
WRITERS = ("thread", "process")


def _positive(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{owner}.{name} must be a positive int{' or None' if optional else ''}, "
                          f"got {value!r}")


def _timeout(owner: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or value <= 0):
        raise ConfigError(f"{owner}.collective_timeout must be a positive number of seconds or "
                          f"None (${TIMEOUT_ENV}, else 600), got {value!r}")


@dataclass(frozen=True)
class DistOptions:
    """What a save and a load share: how long a wait for the other ranks may take, and the
    pinned host memory CUDA tensors pass through (``SaveOptions.dist``, ``LoadOptions.dist``;
    pass one value to both to tune them alike)."""

    #: seconds every wait for the other ranks may take (a dead or hung rank makes the others
    #: raise CollectiveError naming the step); None: ``$CKPTFS_COLLECTIVE_TIMEOUT``, else 600
    collective_timeout: float | None = None
    #: bytes of pinned host memory a save of CUDA tensors streams through, and a load into CUDA
    #: targets reads through (``ring_slots`` buffers of ``ring_bytes // ring_slots``, rounded
    #: down to a power of two)
    ring_bytes: int = 512 * MiB
    #: buffers the ``ring_bytes`` are cut into (some are copied while others are written or read)
    ring_slots: int = 8

    def __post_init__(self) -> None:
        _timeout("DistOptions", self.collective_timeout)
        for name in ("ring_bytes", "ring_slots"):
            _positive("DistOptions", name, getattr(self, name))


@dataclass(frozen=True)
class AsyncOptions:
    """Who writes an asynchronous save, and how much host memory a save's staging may hold
    (``SaveOptions.asynchronous``; ``async_save``'s ``writer=`` and ``host_memory_limit=``
    set them too)."""

    #: where an asynchronous save is written, checksummed and committed once staged:
    #: "thread" (a thread of this process) or "process" (a persistent writer process per rank,
    #: fed through shared memory)
    writer: str = "thread"
    #: bytes: the most host memory a save's staging holds (either writer of an asynchronous
    #: save; a synchronous save's copies of what it cannot write in place); the chunks that do
    #: not fit are copied through a few buffers within it while the files are written, and
    #: ``staged`` resolves once the last of them is copied. None: no bound (an asynchronous
    #: save stages one copy of the bytes the rank writes)
    host_memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.writer not in WRITERS:
            raise ConfigError(f"AsyncOptions.writer must be one of {WRITERS}, got {self.writer!r}")
        _positive("AsyncOptions", "host_memory_limit", self.host_memory_limit, optional=True)


@dataclass(frozen=True)
class HealthOptions:
    """What a save checks and records of the values it saves (``SaveOptions.health``; the
    ``check_finite=`` and ``stats=`` keywords of ``save`` / ``async_save`` set them too)."""

    #: refuse the save on every rank with NonFiniteError (nothing committed) when any floating
    #: tensor holds a NaN or infinity
    check_finite: bool = False
    #: record each tensor's fingerprint (count, NaN, Inf, min, max, mean, L2) in the index
    stats: bool = False

    def __post_init__(self) -> None:
        for name in ("check_finite", "stats"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"HealthOptions.{name} must be a bool, got "
                                  f"{getattr(self, name)!r}")


@dataclass(frozen=True)
class SaveOptions:
    """Tuning of a save (``save``, ``async_save``, the manager's saves)."""

    #: at most this many ranks of a node (hostname, or ``$CKPTFS_NODE_ID``) write at once;
    #: None: all of them
    throttle_uploads: int | None = None
    #: threads that copy chunks into staging buffers, and that hash them (``hashes``, ``base``,
    #: ``delta``); None: min(4, the CPUs this process may run on)
    copy_threads: int | None = None
    #: bytes: a large copy is cut into pieces of this size, copied in parallel
    copy_piece: int = 8 * MiB
    #: OS nice value (0-19, Linux) of an asynchronous save's threads once staged, and of the
    #: threads writing its local data files: a busy CPU serves the training loop first.
    #: 0: the caller's priority
    background_nice: int = 10
    #: the waits for other ranks and the pinned ring (shared with ``LoadOptions``)
    dist: DistOptions = field(default_factory=DistOptions)
    #: the writer of an asynchronous save and the bound on staging memory
    asynchronous: AsyncOptions = field(default_factory=AsyncOptions)
    #: the checks and fingerprints of the saved values
    health: HealthOptions = field(default_factory=HealthOptions)
    #: a delta save (docs/guide/delta.md): the URL of an earlier checkpoint whose chunks of
    #: equal content hash are recorded as references instead of written; implies ``hashes``
    base: str | None = None
    #: record each chunk's xxh3-128 content hash, so that the checkpoint can be a base
    hashes: bool = False
    #: a ``CheckpointManager``'s saves: each step a delta on the newest step committed at its
    #: URL before it (docs/guide/delta.md); implies ``hashes``. A single save names its ``base``
    delta: bool = False
    #: with ``hashes``/``base``/``delta``: a tensor that is the same object as at an earlier
    #: save in this process, with the same data pointer, layout and version counter, reuses
    #: the hashes then computed instead of hashing again. Writes that bypass torch's version
    #: counter (``.data``, numpy views, raw pointers) are not seen: docs/guide/delta.md
    reuse_hashes: bool = False
    #: write the index as segments (formats/README.md §2.6): each of a few ranks writes the
    #: chunk rows of a run of keys into its own segment file, the coordinator a small root that
    #: lists them, and a load reads only the rows its targets overlap. None: when the save
    #: plans at least ``layout.segments.SEGMENT_MIN_CHUNKS`` chunks; True: always (a backend
    #: whose final files are made from every chunk, DCP's ``.metadata``, refuses it)
    index_segments: bool | None = None
    #: chunk rows a segment file holds at most, about; None: ``layout.segments.SEGMENT_ROWS``
    segment_rows: int | None = None

    def __post_init__(self) -> None:
        _groups("SaveOptions", self, dist=DistOptions, asynchronous=AsyncOptions,
                health=HealthOptions)
        _positive("SaveOptions", "throttle_uploads", self.throttle_uploads, optional=True)
        _positive("SaveOptions", "copy_threads", self.copy_threads, optional=True)
        _positive("SaveOptions", "copy_piece", self.copy_piece)
        if (isinstance(self.background_nice, bool) or not isinstance(self.background_nice, int)
                or not 0 <= self.background_nice <= 19):
            raise ConfigError(f"SaveOptions.background_nice must be an int 0-19, got "
                              f"{self.background_nice!r}")
        if self.index_segments is not None and not isinstance(self.index_segments, bool):
            raise ConfigError(f"SaveOptions.index_segments must be a bool or None, got "
                              f"{self.index_segments!r}")
        _positive("SaveOptions", "segment_rows", self.segment_rows, optional=True)
        if self.base is not None and not isinstance(self.base, str):
            raise ConfigError(f"SaveOptions.base must be a checkpoint URL (str), got "
                              f"{self.base!r}")
        for name in ("hashes", "delta", "reuse_hashes"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SaveOptions.{name} must be a bool, got "
                                  f"{getattr(self, name)!r}")
        if self.delta and self.base is not None:
            raise ConfigError(f"SaveOptions: delta=True bases each step on the one before it; "
                              f"base={self.base!r} names a fixed base: give one of them")

    # read-through views of the groups' fields, for the engine
    collective_timeout = property(lambda self: self.dist.collective_timeout)
    ring_bytes = property(lambda self: self.dist.ring_bytes)
    ring_slots = property(lambda self: self.dist.ring_slots)
    host_memory_limit = property(lambda self: self.asynchronous.host_memory_limit)
    writer = property(lambda self: self.asynchronous.writer)
    check_finite = property(lambda self: self.health.check_finite)
    stats = property(lambda self: self.health.stats)

    def with_shortcuts(self, *, check_finite: bool | None = None, stats: bool | None = None,
                       writer: str | None = None, host_memory_limit: int | None = None
                       ) -> SaveOptions:
        """These options with the fields a call's keyword shortcuts set (None: left as is)."""
        health = {k: v for k, v in (("check_finite", check_finite), ("stats", stats))
                  if v is not None}
        background: dict[str, Any] = {
            k: v for k, v in (("writer", writer), ("host_memory_limit", host_memory_limit))
            if v is not None}
        if not health and not background:
            return self
        return replace(self, health=replace(self.health, **health),
                       asynchronous=replace(self.asynchronous, **background))


@dataclass(frozen=True)
class LoadOptions:
    """Tuning of a load (``load``, ``load_keys``, the manager's restore)."""

    #: check the crc32c of every chunk read (whole or in parts)
    verify: bool = True
    #: read each region several ranks need once per process group and send it to the others
    #: over torch.distributed; None: when the checkpoint is remote and the group has ranks > 1
    exchange: bool | None = None
    #: first copy the files each node needs into ``work_dir`` (one rank per node downloads;
    #: later loads reuse it), then read locally
    pre_download: bool = False
    #: node-local directory of ``pre_download`` (required with it)
    work_dir: str | None = None
    #: bytes of host memory held at once for regions that cannot be read in place
    #: (non-contiguous or non-CPU targets, encoded chunks); reads are batched to stay within it
    scratch_bytes: int = 512 * MiB
    #: bytes one rank sends plus receives per exchange round (the memory in transit at once)
    exchange_bytes: int = 256 * MiB
    #: read chunks straight into CUDA targets with GPUDirect Storage (kvikio) where it can: a
    #: local store, kvikio importable, ``verify=False``; otherwise the ring, with a warning
    gds: bool = False
    #: bytes: one wave of reads of a large file (the unit a read stream issues at a time)
    read_wave: int = 32 * MiB
    #: the waits for other ranks and the pinned ring (shared with ``SaveOptions``)
    dist: DistOptions = field(default_factory=DistOptions)

    def __post_init__(self) -> None:
        _groups("LoadOptions", self, dist=DistOptions)
        for name in ("scratch_bytes", "exchange_bytes", "read_wave"):
            _positive("LoadOptions", name, getattr(self, name))
        if self.work_dir is not None:
            object.__setattr__(self, "work_dir", os.fspath(self.work_dir))

    # read-through views of the group's fields, for the engine
    collective_timeout = property(lambda self: self.dist.collective_timeout)
    ring_bytes = property(lambda self: self.dist.ring_bytes)
    ring_slots = property(lambda self: self.dist.ring_slots)


def _groups(owner: str, value: object, **kinds: type) -> None:
    for name, kind in kinds.items():
        if not isinstance(getattr(value, name), kind):
            raise ConfigError(f"{owner}.{name} must be a {kind.__name__}, got "
                              f"{getattr(value, name)!r}")
