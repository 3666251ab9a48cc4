"""``SaveOptions`` and ``LoadOptions``: how the engine runs a save or a load (waits for other
ranks, copy threads, host and pinned memory budgets, verification). Shared by ``save``,
``async_save``, ``load`` and ``CheckpointManager``; the common call passes neither.

Store settings (requests in flight, fsync, retries) are ``StoreOptions`` (ckptfs/io/options.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ckptfs.errors import ConfigError

MiB = 2**20

#: environment variable giving the default of ``collective_timeout`` (seconds)
TIMEOUT_ENV = "CKPTFS_COLLECTIVE_TIMEOUT"


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
class SaveOptions:
    """Tuning of a save (``save``, ``async_save``, the manager's saves)."""

    #: seconds every wait for the other ranks may take (a dead or hung rank makes the others
    #: raise CollectiveError naming the step); None: ``$CKPTFS_COLLECTIVE_TIMEOUT``, else 600
    collective_timeout: float | None = None
    #: at most this many ranks of a node (hostname, or ``$CKPTFS_NODE_ID``) write at once;
    #: None: all of them
    throttle_uploads: int | None = None
    #: threads that copy chunks into staging buffers; None: min(4, the CPUs this process may
    #: run on)
    copy_threads: int | None = None
    #: bytes: a large copy is cut into pieces of this size, copied in parallel
    copy_piece: int = 8 * MiB
    #: bytes of pinned host memory a save of CUDA tensors streams through (``ring_slots``
    #: buffers of ``ring_bytes // ring_slots``, rounded down to a power of two)
    ring_bytes: int = 512 * MiB
    #: buffers the ``ring_bytes`` are cut into (copies of one run while others are written)
    ring_slots: int = 8
    #: OS nice value (0-19, Linux) of an asynchronous save's threads once staged, and of the
    #: threads writing its local data files: a busy CPU serves the training loop first.
    #: 0: the caller's priority
    background_nice: int = 10
    #: bytes: the most host memory a save's staging holds (either writer of an asynchronous
    #: save; a synchronous save's copies of what it cannot write in place); the chunks that do
    #: not fit are copied through a few buffers within it while the files are written, and
    #: ``staged`` resolves once the last of them is copied. None: no bound (an asynchronous
    #: save stages one copy of the bytes the rank writes)
    host_memory_limit: int | None = None

    def __post_init__(self) -> None:
        _timeout("SaveOptions", self.collective_timeout)
        _positive("SaveOptions", "host_memory_limit", self.host_memory_limit, optional=True)
        _positive("SaveOptions", "throttle_uploads", self.throttle_uploads, optional=True)
        _positive("SaveOptions", "copy_threads", self.copy_threads, optional=True)
        for name in ("copy_piece", "ring_bytes", "ring_slots"):
            _positive("SaveOptions", name, getattr(self, name))
        if (isinstance(self.background_nice, bool) or not isinstance(self.background_nice, int)
                or not 0 <= self.background_nice <= 19):
            raise ConfigError(f"SaveOptions.background_nice must be an int 0-19, got "
                              f"{self.background_nice!r}")


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
    #: seconds, as ``SaveOptions.collective_timeout``
    collective_timeout: float | None = None
    #: bytes of host memory held at once for regions that cannot be read in place
    #: (non-contiguous or non-CPU targets, encoded chunks); reads are batched to stay within it
    scratch_bytes: int = 512 * MiB
    #: bytes one rank sends plus receives per exchange round (the memory in transit at once)
    exchange_bytes: int = 256 * MiB
    #: pinned host memory a load into CUDA targets reads through (as ``SaveOptions.ring_bytes``)
    ring_bytes: int = 512 * MiB
    #: buffers the ``ring_bytes`` are cut into (reads into some while others are copied)
    ring_slots: int = 8
    #: read chunks straight into CUDA targets with GPUDirect Storage (kvikio) where it can: a
    #: local store, kvikio importable, ``verify=False``; otherwise the ring, with a warning
    gds: bool = False
    #: bytes: one wave of reads of a large file (the unit a read stream issues at a time)
    read_wave: int = 32 * MiB

    def __post_init__(self) -> None:
        _timeout("LoadOptions", self.collective_timeout)
        for name in ("scratch_bytes", "exchange_bytes", "ring_bytes", "ring_slots", "read_wave"):
            _positive("LoadOptions", name, getattr(self, name))
        if self.work_dir is not None:
            object.__setattr__(self, "work_dir", os.fspath(self.work_dir))
