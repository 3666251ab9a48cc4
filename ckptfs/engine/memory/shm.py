"""Staging buffers in shared memory, for the writer process (engine/background/writer_process.py).

``SharedArena`` is a ``BufferAllocator`` whose buffers are carved out of files in
``/dev/shm`` that the training process creates and owns. A writer process maps each file once
(``Mappings``) and sees the staged bytes without a copy. ``to_ref`` / ``from_ref`` turn a tensor
that lies in an arena into a small reference (file name, byte offset, dtype, shape, strides) and
back, so a staged save travels to the writer as a pickle of references.

Names: ``ckptfs-<pid>-<token>-<n>`` (``pid``: the owning process), so whoever outlives the owner
(its writer, or ``unlink_owned``) can remove what it left. ``clear()`` unlinks every file; a
file whose every buffer was freed is unlinked at once.
"""

from __future__ import annotations

import bisect
import mmap
import os
import secrets
import threading
import warnings
from dataclasses import dataclass

import torch

from ckptfs.engine.memory.buffers import BufferAllocator

SHM_DIR = "/dev/shm"
PREFIX = "ckptfs-"
#: the least size of one arena file; larger buffers get a file of their own size
SEGMENT = 64 << 20
ALIGN = 64


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where a tensor lies in an arena file."""

    name: str
    offset: int  #: bytes from the file's start to the tensor's first element
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    span: int  #: bytes from ``offset`` that the view may touch


class _Segment:
    def __init__(self, name: str, size: int) -> None:
        self.name, self.size = name, size
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.base = self.tensor.data_ptr()
        self.used = 0
        self.live = 0
        self.pinned = False

    def pin(self) -> None:
        """Page-lock the segment for CUDA (``cudaHostRegister``): device-to-host copies into
        it run asynchronously. Best effort: a segment that cannot be pinned stays pageable
        (the copies into it are then synchronous)."""
        if self.pinned:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0)
        if int(err) != 0:
            warnings.warn(f"shared staging memory {self.name} could not be pinned "
                          f"(cudaHostRegister error {int(err)}); its CUDA copies are synchronous",
                          RuntimeWarning, stacklevel=2)
            return
        self.pinned = True

    def unlink(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.pinned = False
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class SharedArena(BufferAllocator):
    """Host buffers in ``/dev/shm`` files owned by this process (thread-safe)."""

    def __init__(self) -> None:
        self._token = f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self._segments: list[_Segment] = []
        self._lock = threading.Lock()
        self._count = 0
        self._pinned = False

    def pin(self) -> None:
        """From now on every segment is page-locked for CUDA (those made so far too): the
        staging of a state on CUDA (``SaveOptions``' pinned staging, here in shared memory)."""
        with self._lock:
            self._pinned = True
            for seg in self._segments:
                seg.pin()

    @property
    def names(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(s.name for s in self._segments)

    def allocate(self, nbytes: int) -> torch.Tensor:
        size = (max(nbytes, 1) + ALIGN - 1) // ALIGN * ALIGN
        with self._lock:
            seg = self._segments[-1] if self._segments else None
            if seg is None or seg.size - seg.used < size:
                self._count += 1
                seg = _Segment(f"{self._token}-{self._count}", max(size, SEGMENT))
                if self._pinned:
                    seg.pin()
                self._segments.append(seg)
            start = seg.used
            seg.used += size
            seg.live += 1
        return seg.tensor[start:start + nbytes]

    def _owner(self, t: torch.Tensor) -> _Segment | None:
        ptr = t.data_ptr()
        for seg in self._segments:
            if seg.base <= ptr < seg.base + seg.size:
                return seg
        return None

    def free(self, buffer: torch.Tensor) -> None:
        with self._lock:
            seg = self._owner(buffer)
            if seg is None:
                return
            seg.live -= 1
            if seg.live == 0 and seg is not self._segments[-1]:
                self._segments.remove(seg)
                seg.unlink()

    def clear(self) -> None:
        with self._lock:
            segments, self._segments = self._segments, []
        for seg in segments:
            seg.unlink()  # the memory goes once the last mapping does

    def to_ref(self, t: torch.Tensor) -> TensorRef | None:
        """``t``'s place in one of this arena's files, or None when it lies elsewhere."""
        with self._lock:
            seg = self._owner(t) if t.device.type == "cpu" else None
        if seg is None:
            return None
        span = (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
                if t.numel() else 0) * t.element_size()
        return TensorRef(seg.name, t.data_ptr() - seg.base, t.dtype, tuple(t.shape),
                         tuple(t.stride()), span)


    def flat_ref(self, t: torch.Tensor) -> tuple[str, int, int] | None:
        """(file name, byte offset, bytes) of a C-contiguous ``t`` in this arena, or None."""
        if t.device.type != "cpu" or not t.is_contiguous() or not t.numel():
            return None
        with self._lock:
            seg = self._owner(t)
        if seg is None:
            return None
        return seg.name, t.data_ptr() - seg.base, t.numel() * t.element_size()


    def flat_refs(self, tensors: list[torch.Tensor]) -> list[tuple[str, int, int] | None]:
        """``flat_ref`` of each of ``tensors`` (one lock and one lookup table for all)."""
        with self._lock:
            spans = sorted((s.base, s.base + s.size, s.name) for s in self._segments)
        starts = [b for b, _, _ in spans]
        out: list[tuple[str, int, int] | None] = []
        for t in tensors:
            ref = None
            if t.device.type == "cpu" and t.is_contiguous():
                n = t.numel() * t.element_size()
                ptr = t.data_ptr()
                i = bisect.bisect_right(starts, ptr) - 1
                if n and i >= 0 and ptr < spans[i][1]:
                    ref = (spans[i][2], ptr - spans[i][0], n)
            out.append(ref)
        return out


class Mappings:
    """A writer's view of its owner's arena files: each mapped once, kept until ``close``."""

    def __init__(self) -> None:
        self._maps: dict[str, torch.Tensor] = {}

    def _base(self, name: str) -> torch.Tensor:
        base = self._maps.get(name)
        if base is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                base = torch.frombuffer(mmap.mmap(fd, 0), dtype=torch.uint8)
            finally:
                os.close(fd)
            self._maps[name] = base
        return base

    def flat(self, ref: tuple[str, int, int]) -> torch.Tensor:
        """The bytes ``SharedArena.flat_ref`` located (a uint8 view)."""
        name, offset, nbytes = ref
        return self._base(name)[offset:offset + nbytes]

    def from_ref(self, ref: TensorRef) -> torch.Tensor:
        base = self._base(ref.name)
        if not ref.span:
            return torch.empty(ref.shape, dtype=ref.dtype)
        raw = base[ref.offset:ref.offset + ref.span].view(ref.dtype)
        return torch.as_strided(raw, ref.shape, ref.stride)

    def forget(self, live: set[str]) -> None:
        """Drop the mappings of files not in ``live`` (their owner unlinked them)."""
        for name in [n for n in self._maps if n not in live]:
            del self._maps[name]


def unlink_owned(pid: int) -> int:
    """Remove every arena file that process ``pid`` created; how many were removed."""
    mine = f"{PREFIX}{pid}-"
    gone = 0
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        if name.startswith(mine):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                gone += 1
            except OSError:
                pass
    return gone


def unlink_orphans() -> int:
    """Remove the arena files of processes that no longer exist (a training process killed
    while no writer watched it); how many were removed. Files of a live process are kept."""
    owners: set[int] = set()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return 0
    for name in names:
        owner = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and owner.isdigit():
            owners.add(int(owner))
    gone = 0
    for pid in owners:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            gone += unlink_owned(pid)
        except OSError:
            pass  # alive, another user's
    return gone
