"""A synchronous save from CUDA: chunk bytes streamed off the device while the files are written.

Instead of copying the whole state into host memory before writing (a full, pinned host copy),
each CUDA chunk becomes a ``DeviceChunk``, a ``StreamedPart`` (io/streamed.py) that the store
pulls while it writes the file: the chunk is cut in C order into pieces of one ring slot
(``geometry.c_order_cuts``), each piece is copied into a free slot of a ring of pinned buffers
by a ``Copier`` (engine/memory/ring.py: a ``non_blocking`` copy on a side stream and its event), the
copies of the next pieces are started while the store writes the current one, and the crc32c
of each piece is computed in the slot before it is written. Pinned memory held = the ring
(``SaveOptions.ring_bytes``), whatever the state's size.

Call order: ``parts = cuda_device_parts(...)`` (the caller's thread, before staging; a
``DeviceParts`` of a ``SlotPool`` and a copier) -> ``parts.part(view)`` for each CUDA chunk
while staging (makes the copies wait for what the caller queued on its current stream) -> the
store's writer threads run each part's ``stream()`` -> after the write, ``part.crc`` ->
``parts.close()`` (gives the slots back; after every stream ended).

A slot is taken blocking only by a stream that holds none, and more are taken for prefetching
only when free, so streams of several files written at once never wait on each other in a
cycle. Backends opt in with ``Backend.streams_device_chunks`` (they pass the chunk's bytes
through untouched); for the others the engine stages CUDA chunks into pinned host buffers.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator

import torch

from ckptfs.engine.memory.ring import Completion, Copier, CudaEvents, SideStreams, pinned_slot_bytes
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import combine, crc_of
from ckptfs.layout.geometry import c_order_cuts


class SlotPool:
    """``slots`` host buffers of ``slot_bytes`` each, made on first use by ``allocate``;
    taken and given back from any thread."""

    def __init__(self, slots: int, slot_bytes: int,
                 allocate: Callable[[int], torch.Tensor]) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs at least one slot of at least one byte, got "
                             f"{slots} x {slot_bytes}")
        self.slots, self.slot_bytes = slots, slot_bytes
        self._allocate = allocate
        self._free: list[torch.Tensor] = []
        self._made = 0
        self._out = 0
        self.peak = 0  #: most slot bytes held at once
        self._cond = threading.Condition()

    def take(self, block: bool) -> torch.Tensor | None:
        """A free slot (a uint8 tensor of ``slot_bytes``); None when none is free and not
        ``block``."""
        with self._cond:
            while not self._free and self._made >= self.slots:
                if not block:
                    return None
                self._cond.wait()
            self._out += 1
            self.peak = max(self.peak, self._out * self.slot_bytes)
            if self._free:
                return self._free.pop()
            self._made += 1
        try:
            return self._allocate(self.slot_bytes)
        except BaseException:
            with self._cond:
                self._made -= 1
                self._out -= 1
                self._cond.notify()
            raise

    def give(self, buf: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buf)
            self._out -= 1
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._free.clear()


class DeviceChunk(StreamedPart):
    """The bytes of one device tensor (any strides), streamed through ``pool``'s slots."""

    def __init__(self, data: torch.Tensor, pool: SlotPool, copier: Copier) -> None:
        self.data = data
        self.pool = pool
        self.copier = copier
        self.shape, self.dtype = tuple(data.shape), data.dtype
        self.itemsize = data.element_size()
        self._nbytes = data.numel() * self.itemsize
        self.crc: int | None = None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stream(self) -> Generator[memoryview, None, None]:
        self.crc = None
        if not self._nbytes:
            self.crc = 0
            return
        itemsize = self.itemsize
        cuts = c_order_cuts(self.shape, itemsize, self.pool.slot_bytes)
        flying: deque[tuple[torch.Tensor, int, Completion]] = deque()
        crc, i = 0, 0  # cuts[i] is the next piece to copy
        try:
            while i < len(cuts) or flying:
                while i < len(cuts):  # start the next copies: blocking only when none is in flight
                    buf = self.pool.take(block=not flying)
                    if buf is None:
                        break
                    box = cuts[i]
                    n = box.volume * itemsize
                    try:
                        flying.append((buf, n, self.start_copy(buf[:n], box, i)))
                    except BaseException:
                        self.pool.give(buf)
                        raise
                    i += 1
                buf, n, done = flying.popleft()
                try:
                    done.wait()
                    view = buf[:n].numpy().data
                    crc = combine(crc, crc_of(view), n)
                    if i == len(cuts) and not flying:  # the last piece: a consumer that
                        self.crc = crc  # holds every byte may stop without asking for more
                    yield view
                finally:
                    self.pool.give(buf)
        finally:
            while flying:  # an early stop: nothing may still copy into a slot given back
                buf, _, done = flying.popleft()
                try:
                    done.wait()
                finally:
                    self.pool.give(buf)


    def start_copy(self, buf: torch.Tensor, box: Box, index: int) -> Completion:
        """Start copying piece ``index`` (``box`` of the data) into ``buf`` (its bytes)."""
        return self.copier(buf.view(self.dtype).view(box.shape), self.data[box.slices()])


class CudaD2H:
    """The CUDA ``Copier`` for saves: device-to-host copies into pinned slots on one side
    stream per device, each after the work the caller had queued on the data's device when the
    save began (``record``, in the caller's thread: the side stream waits for its current
    stream)."""

    def __init__(self) -> None:
        self.streams = SideStreams()

    def record(self, device: torch.device) -> None:
        """Called in the caller's thread while staging: the copies from ``device`` start after
        what is queued on its current stream now."""
        self.streams.get(device)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor) -> Completion:
        stream = self.streams.get(src.device)  # made by ``record`` in the caller's thread
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return CudaEvents([event])


class DeviceParts:
    """The device chunks of one synchronous save and the ring they share."""

    def __init__(self, pool: SlotPool, copier: Copier,
                 accepts: Callable[[torch.Tensor], bool],
                 record: Callable[[torch.device], None] | None = None) -> None:
        self.pool = pool
        self.copier = copier
        self.accepts = accepts
        self._record = record

    def part(self, data: torch.Tensor) -> DeviceChunk:
        if self._record is not None:
            self._record(data.device)
        return DeviceChunk(data, self.pool, self.copier)

    def close(self) -> None:
        self.pool.close()


def cuda_device_parts(has_cuda: bool, *, ring_bytes: int, slots: int) -> DeviceParts | None:
    """Device parts through a pinned ring of ``ring_bytes`` when the state holds CUDA tensors
    (``has_cuda``); None otherwise (a CPU save never pins)."""
    if not has_cuda or not torch.cuda.is_available():
        return None
    from ckptfs.engine.memory.buffers import PinnedAllocator

    d2h = CudaD2H()
    return DeviceParts(SlotPool(slots, pinned_slot_bytes(ring_bytes, slots),
                                PinnedAllocator().allocate), d2h,
                       lambda t: t.device.type == "cuda", d2h.record)
