"""Staging under a bound (``SaveOptions.host_memory_limit``): the chunks that do not fit.

An asynchronous save stages a copy of every chunk its rank writes. Under a bound, the chunks
are taken in order: those that fit in the bound less a small ring are copied into staging
buffers as usual; each later one becomes a ``StreamedPart`` whose bytes are copied from the
caller's tensor through the ring (engine/memory/device_parts.py: a ``SlotPool`` and a copier) while
its file is written. Staging then never holds more than the bound. ``staged`` resolves only
once every such chunk has been copied out of the caller's tensors (``on_done``): until then
the caller must not change them (a later ``staged``, never an out-of-memory).

Call order: ``Overflow(limit, ring_bytes, slots)`` -> ``accepts(data)`` for every chunk, in
order (the staging code's ``device`` hook: True means streamed) -> ``part(data)`` for each
accepted -> ``arm(on_done)`` once staged (fires at once when nothing overflowed) -> the write
streams the parts; the last one's last piece fires ``on_done``.

A part whose bytes were all copied cannot be streamed again (a retried write would read
tensors the caller may have changed): it raises instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator

import torch

from ckptfs.engine.memory.buffers import HostAllocator
from ckptfs.engine.memory.device_parts import CudaD2H, DeviceChunk, SlotPool
from ckptfs.engine.memory.ring import pinned_slot_bytes
from ckptfs.engine.options import SaveOptions
from ckptfs.errors import ConfigError, StorageError
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.backend import Backend

#: the ring takes at most this share of the bound (the rest holds staged copies)
RING_SHARE = 4


class _Copied:
    def wait(self) -> None:
        return None


def copy_piece(dst: torch.Tensor, src: torch.Tensor) -> _Copied:
    """One piece of an overflowing CPU chunk into its ring slot, in the thread that writes the
    chunk's file (at the caller's priority: io/local_store.py)."""
    dst.copy_(src)
    return _Copied()


class Overflow:
    """The chunks of one save beyond its staging bound, and the ring they stream through.

    ``in_place=True`` (a synchronous save, whose caller waits): chunks the save writes in
    place (CPU, C-contiguous) take no staging memory and are neither counted nor streamed, and
    a streamed chunk may be streamed again (a retried write): the caller's tensors do not
    change meanwhile."""

    def __init__(self, limit: int, ring_bytes: int, slots: int, *, in_place: bool = False) -> None:
        self.in_place = in_place
        ring = max(1, min(ring_bytes, limit // RING_SHARE))
        self.budget = limit - ring  #: bytes of chunks copied while staging
        self.used = 0
        self._slots, self._ring = slots, ring
        self._cpu: SlotPool | None = None
        self._cuda: tuple[SlotPool, CudaD2H] | None = None
        self._left = 0
        self._armed: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def accepts(self, data: torch.Tensor) -> bool:
        """Whether ``data`` (the next chunk, in order) is streamed rather than copied now."""
        n = data.numel() * data.element_size()
        if not n or (self.in_place and data.device.type == "cpu" and data.is_contiguous()):
            return False
        if self.used + n <= self.budget:
            self.used += n
            return False
        return True

    def part(self, data: torch.Tensor) -> StreamedPart:
        with self._lock:
            self._left += 1
        if data.device.type == "cuda":
            if self._cuda is None:
                from ckptfs.engine.memory.buffers import PinnedAllocator

                slot = pinned_slot_bytes(self._ring, self._slots)
                self._cuda = (SlotPool(self._slots, slot, PinnedAllocator().allocate), CudaD2H())
            pool, d2h = self._cuda
            d2h.record(data.device)
            chunk = DeviceChunk(data, pool, d2h)
        else:
            if self._cpu is None:
                slot = max(1, self._ring // self._slots)
                self._cpu = SlotPool(self._slots, slot, HostAllocator().allocate)
            chunk = DeviceChunk(data, self._cpu, copy_piece)
        if self.in_place:
            return chunk
        return _Tracked(chunk, self)

    def close(self) -> None:
        """Drop the ring's buffers (after every stream ended)."""
        for pool in (self._cpu, self._cuda[0] if self._cuda is not None else None):
            if pool is not None:
                pool.close()

    @property
    def streamed(self) -> bool:
        """Whether any chunk overflowed."""
        return self._left > 0 or self._armed is not None

    def arm(self, on_done: Callable[[], None]) -> None:
        """Call ``on_done`` once every part has been copied (now, if none is left)."""
        with self._lock:
            fire = self._left == 0
            if not fire:
                self._armed = on_done
        if fire:
            on_done()

    def _finished(self) -> None:
        with self._lock:
            self._left -= 1
            fire = self._armed if self._left == 0 else None
        if fire is not None:
            fire()


class _Tracked(StreamedPart):
    """One overflowed chunk: its bytes as the ring copies them; tells ``owner`` when the last
    piece has been copied."""

    def __init__(self, inner: DeviceChunk, owner: Overflow) -> None:
        self.inner, self.owner = inner, owner
        self.crc: int | None = None
        self._done = False

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def stream(self) -> Generator[memoryview, None, None]:
        if self._done:
            raise StorageError("a chunk staged under host_memory_limit cannot be written again: "
                               "the caller's tensors may have changed since it was copied")
        for view in self.inner.stream():
            if self.inner.crc is not None and not self._done:  # the last piece is copied
                self.crc = self.inner.crc
                self._done = True
                self.owner._finished()
            yield view
        if not self._done:  # an empty chunk
            self.crc = self.inner.crc
            self._done = True
            self.owner._finished()


def bounded(options: SaveOptions, be: Backend, *, in_place: bool = False) -> Overflow | None:
    """The overflow of a save under ``options.host_memory_limit`` (None: no bound;
    ``in_place``: a synchronous save's, see ``Overflow``)."""
    limit = options.host_memory_limit
    if limit is None:
        return None
    if not be.streams_device_chunks:
        raise ConfigError(f"host_memory_limit needs a backend that streams its chunks while "
                          f"writing (safetensors_chunks); {be.name} does not")
    return Overflow(limit, options.ring_bytes, options.ring_slots, in_place=in_place)
