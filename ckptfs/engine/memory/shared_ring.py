"""The overflow of a bounded save (engine/memory/overflow.py) when a writer process writes it.

Under ``SaveOptions.host_memory_limit`` the chunks beyond the bound are copied out of the
caller's tensors only while their files are written. With ``writer="process"`` the caller's
tensors are in the training process and the files are written by the writer, so the copies
cross processes through a ring of shared-memory slots (engine/memory/shm.py) that the training
process owns and the writer maps:

- training process: ``SharedOverflow`` takes the overflowing chunks while staging (each a
  ``FedPart``: the source tensor, never streamed here) and, at the writer's request, copies
  piece ``i`` of part ``p`` into slot ``k`` (``copy``). When every piece of every part has been
  copied once, ``staged`` resolves (``Overflow.arm``).
- writer process: each part is a ``FedChunk``, a ``DeviceChunk`` whose copies are requests
  (``request(p, i, k)`` returns the copy's completion: the training process's answer). The
  writer takes and gives back the slots (a ``SlotPool`` over its mappings of them), so a slot is
  never filled while the writer still reads it, and it computes the checksums.

Pieces are cut in C order into pieces of one slot (``geometry.c_order_cuts``), the same cuts
on both sides. Staging then holds at most the bound: the copied chunks and the ring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from ckptfs.engine.memory.device_parts import DeviceChunk, SlotPool
from ckptfs.engine.memory.overflow import RING_SHARE, Overflow
from ckptfs.engine.memory.ring import Completion
from ckptfs.errors import StorageError
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.boxes import Box
from ckptfs.layout.geometry import c_order_cuts

#: the shared ring's slots are a multiple of this many bytes
SLOT_ALIGN = 4096


@dataclass(frozen=True)
class FedRef:
    """Stands, in what is sent to the writer, for the overflowing part ``index``."""

    index: int


def ring_geometry(limit: int, ring_bytes: int, slots: int) -> tuple[int, int]:
    """(slots, bytes of each) of the shared ring of a save bounded by ``limit``."""
    ring = max(1, min(ring_bytes, limit // RING_SHARE))
    size = max(SLOT_ALIGN, ring // slots // SLOT_ALIGN * SLOT_ALIGN)
    return max(1, ring // size), size


class FedPart(StreamedPart):
    """Training process: one overflowing chunk, copied into the shared ring at the writer's
    request (``SharedOverflow.copy``)."""

    def __init__(self, data: torch.Tensor, index: int, owner: SharedOverflow) -> None:
        self.data, self.index, self.owner = data, index, owner
        self._nbytes = data.numel() * data.element_size()
        self.cuts: list[Box] | None = None
        self.copied: set[int] = set()
        self.finished = False

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def stream(self) -> Generator[memoryview, None, None]:
        raise StorageError("a chunk fed to a writer process is streamed by the writer")


class SharedOverflow(Overflow):
    """Training process: the overflow of a bounded save written by a writer process; its ring
    is ``slots`` (shared-memory buffers of equal size, made by ``make_slots(count, size)`` at
    the first overflowing chunk)."""

    def __init__(self, limit: int, ring_bytes: int, slots: int,
                 make_slots: Callable[[int, int], list[torch.Tensor]]) -> None:
        super().__init__(limit, ring_bytes, slots)
        self.geometry = ring_geometry(limit, ring_bytes, slots)
        self.budget = limit - self.geometry[0] * self.geometry[1]
        self._make_slots = make_slots
        self.slots: list[torch.Tensor] = []
        self.parts: list[FedPart] = []
        self._copy_lock = threading.Lock()

    def part(self, data: torch.Tensor) -> StreamedPart:
        if not self.slots:
            self.slots = self._make_slots(*self.geometry)
        with self._lock:
            self._left += 1
            p = FedPart(data, len(self.parts), self)
            self.parts.append(p)
        return p

    def copy(self, index: int, piece: int, slot: int) -> None:
        """Copy piece ``piece`` of part ``index`` into slot ``slot`` (the writer asks)."""
        p = self.parts[index]
        if p.finished:
            raise StorageError("a chunk staged under host_memory_limit cannot be written again: "
                               "the caller's tensors may have changed since it was copied")
        itemsize = p.data.element_size()
        if p.cuts is None:
            p.cuts = c_order_cuts(tuple(p.data.shape), itemsize, self.geometry[1])
        box = p.cuts[piece]
        dst = self.slots[slot][:box.volume * itemsize].view(p.data.dtype).view(box.shape)
        dst.copy_(p.data[box.slices()])
        with self._copy_lock:
            p.copied.add(piece)
            done = len(p.copied) == len(p.cuts) and not p.finished
            if done:
                p.finished = True
        if done:
            self._finished()


class FedChunk(DeviceChunk):
    """Writer process: one overflowing chunk of ``shape`` and ``dtype``, its pieces copied by
    the training process into ``pool``'s slots (``request(part, piece, buffer)`` starts one)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pool: SlotPool, index: int,
                 request: Callable[[int, int, torch.Tensor], Completion]) -> None:
        self.pool, self.index, self._request = pool, index, request
        self.shape, self.dtype = shape, dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        n = 1
        for d in shape:
            n *= d
        self._nbytes = n * self.itemsize
        self.crc: int | None = None

    def start_copy(self, buf: torch.Tensor, box: Box, index: int) -> Completion:
        return self._request(self.index, index, buf)


class WriterRing:
    """Writer process: the shared ring's slots as mapped here (``slots``, equal sizes) and how
    a copy into one is asked for (``ask(part, piece, slot) -> Completion``)."""

    def __init__(self, slots: list[torch.Tensor],
                 ask: Callable[[int, int, int], Completion]) -> None:
        free = iter(slots)
        self.pool = SlotPool(len(slots), slots[0].numel(), lambda n: next(free))
        self._slot = {t.data_ptr(): k for k, t in enumerate(slots)}
        self._ask = ask

    def request(self, index: int, piece: int, buf: torch.Tensor) -> Completion:
        return self._ask(index, piece, self._slot[buf.data_ptr()])

    def chunk(self, shape: tuple[int, ...], dtype: torch.dtype, index: int) -> FedChunk:
        return FedChunk(shape, dtype, self.pool, index, self.request)
