"""``HashMemo``: content hashes of a process's tensors kept from one save to the next, so that a
delta save (engine/save/delta.py) with ``SaveOptions(reuse_hashes=True)`` does not hash again a
tensor nothing wrote to since (docs/guide/delta.md, formats/README.md §2.5).

A chunk's recorded hash is reused only when the tensor it comes from is the **same tensor
object** as at the save that hashed it (held by a weak reference: it stayed alive, so its
storage was never freed and reused), with the same data pointer, storage offset, shape,
strides, dtype and device, and the same **version counter** (``Tensor._version``). torch bumps
that counter on every in-place operation that goes through its dispatcher, on the tensor or any
view of it (views, ``detach()`` included, share the counter): optimizer steps (for-each and
fused ones included), ``copy_``, ``load_state_dict``, in-place arithmetic under ``no_grad``.

What it does not see (leave ``reuse_hashes`` off where anything writes tensors so): writes
through ``tensor.data`` (a tensor of its own counter over the same storage), through numpy or
DLPack views, through another tensor made over the same storage (``set_``), through raw
pointers (ctypes, custom CUDA kernels) and by collectives that receive into the tensor in place.
A memo entry whose tensor was freed is dropped. A memo is an object, not a global: a manager
owns one; ``ckptfs.save`` / ``async_save`` share the process's (``default_memo``); a writer
process receives an empty one.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ckptfs.layout.backend import ChunkData
from ckptfs.state.flatten import flatten
from ckptfs.state.shards import local_shard

ChunkId = tuple[str, tuple[int, ...], tuple[int, ...]]  #: key, offsets, shape


def chunk_id(c: ChunkData) -> ChunkId:
    """A chunk's key, offsets and shape: how the save's hooks and phases name it."""
    return c.key, c.box.offsets, c.box.shape


@dataclass(frozen=True, slots=True)
class Signature:
    """What must be unchanged for a tensor's hashes to be reused."""

    version: int
    data_ptr: int
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def signature(t: torch.Tensor) -> Signature:
    return Signature(t._version, t.data_ptr(), int(t.storage_offset()), tuple(t.shape),
                     tuple(t.stride()), t.dtype, t.device)


@dataclass(frozen=True)
class Sources:
    """The local tensors of one save's state, by key, with their signatures at staging time
    (``HashMemo.sources``: the delta hook's ``before_stage`` note)."""

    tensors: Mapping[str, tuple[weakref.ref[torch.Tensor], Signature]]


class HashMemo:
    """Chunk hashes of tensors, reused while ``signature`` and identity hold (module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[ChunkId, tuple[weakref.ref[torch.Tensor], Signature, str]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {}  # a writer process reuses nothing: it receives hashes made here

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def sources(state_dict: Mapping[str, Any], rank: int) -> Sources:
        """The local tensors of ``state_dict`` on ``rank`` and their signatures (none where the
        state cannot be taken apart: ``stage`` refuses it on every rank)."""
        try:
            flat = flatten(state_dict, rank)
            shards = [local_shard(k, t, rank) for k, t in flat.tensors.items()]
        except Exception:
            return Sources({})
        return Sources({s.key: (weakref.ref(s.local), signature(s.local))
                        for s in shards if s is not None})

    def get(self, chunk: ChunkId, sources: Sources) -> str | None:
        """The hash recorded for ``chunk`` when its tensor is the one recorded, unchanged."""
        src = sources.tensors.get(chunk[0])
        with self._lock:
            entry = self._entries.get(chunk)
        if src is None or entry is None:
            return None
        ref, sig, digest = entry
        t = ref()
        return digest if t is not None and t is src[0]() and sig == src[1] == signature(t) else None

    def record(self, hashes: Mapping[ChunkId, str], sources: Sources) -> None:
        """Remember ``hashes`` of the chunks whose tensors ``sources`` holds; forget the
        entries of tensors since freed."""
        with self._lock:
            for cid, digest in hashes.items():
                src = sources.tensors.get(cid[0])
                if src is not None and src[0]() is not None:
                    self._entries[cid] = (src[0], src[1], digest)
            for cid in [c for c, e in self._entries.items() if e[0]() is None]:
                del self._entries[cid]


_DEFAULT = HashMemo()


def default_memo() -> HashMemo:
    """The process's memo of ``ckptfs.save`` and ``async_save`` with ``reuse_hashes``."""
    return _DEFAULT
