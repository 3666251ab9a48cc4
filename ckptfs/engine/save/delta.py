"""Delta saves (formats/README.md §2.5): chunks whose bytes equal a chunk of a base checkpoint
are recorded as references to it instead of being written.

``DeltaHook`` is a ``SaveHook`` (engine/save/hooks.py). Each rank reads the base's index on a
thread from ``before_stage`` on, hashes its chunks (xxh3-128, layout/content_hash.py) and, with
a base, compares: in a save that copies (asynchronous, the manager's) the chunks of CPU,
contiguous tensors are hashed in place before any is copied (``before_copy``), and those
referenced are never copied; the others (a synchronous save's, read in place; CUDA and
non-contiguous ones, whose bytes reach the host only as copies) once staged
(``after_stage``). A chunk is referenced only when the base holds a
chunk of the same key, dtype, global shape and box whose recorded hash equals the chunk's
hash (a chunk of the base without a hash is never referenced; neither is one of another
backend, nor a chunk streamed from a device, which is written and not hashed). The write
phase asks ``chunk_reference`` for each chunk and writes only the others (engine/save/write.py);
``before_commit`` records every written chunk's hash in the index, so that the checkpoint can
be the base of the next delta save.

What "equal" means: equal 128-bit content hashes. Two different chunks share one with
probability about 2^-128 for data no adversary chose; a tensor replaced by a new tensor of
the same values is therefore referenced (its bytes are the same). A base changed after the
fact is caught on load by the reference's CRC-32C, copied from the base's entry at save time
(engine/load/bases.py reads references through the ranged-read engine, which checks it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from ckptfs.dist import Comm
from ckptfs.engine.index_io import read_index
from ckptfs.engine.memory.copies import copy_threads
from ckptfs.engine.save.hash_memo import ChunkId, HashMemo, Sources, chunk_id
from ckptfs.engine.save.hooks import SaveHook, WriteOutcome
from ckptfs.errors import ConfigError
from ckptfs.io import run_sync
from ckptfs.io.base_urls import relative_url, resolve_url, split_url
from ckptfs.io.open import open_store
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.content_hash import content_hash
from ckptfs.layout.index import ChunkEntry, Index, TensorEntry
from ckptfs.layout.tensor_bytes import tensor_bytes

#: the backend whose chunks are raw byte ranges a reference can name (both sides of a delta)
RAW_BACKEND = ("safetensors_chunks", 1)


@dataclass(frozen=True, slots=True)
class DeltaNote:
    """What ``after_stage`` found on this rank: each host chunk's hash and the references."""

    hashes: Mapping[ChunkId, str] = field(default_factory=dict)
    refs: Mapping[ChunkId, ChunkEntry] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Pending:
    """What ``before_stage`` and ``before_copy`` found before the chunks were staged: the memo's
    sources, the base's index being read (None: no base, or read when needed), and the chunks
    hashed and referenced before copying."""

    sources: Sources | None = None
    index: Future[Index] | None = None
    hashes: Mapping[ChunkId, str] = field(default_factory=dict)
    refs: Mapping[ChunkId, ChunkEntry] = field(default_factory=dict)


@dataclass(frozen=True)
class DeltaHook(SaveHook):
    """Record every chunk's content hash; with ``base`` (a checkpoint URL, opened like any),
    reference the chunks the base holds with equal hashes. ``url``: this save's root, against
    which a base in the same place is recorded as a relative URL; ``backend``: this save's
    (name, version); ``storage_options`` open the base."""

    url: str
    base: str | None = None
    backend: tuple[str, int] = RAW_BACKEND
    storage_options: Mapping[str, Any] | None = None
    #: ``SaveOptions(reuse_hashes=True)``: the hashes of tensors unchanged since an earlier
    #: save in this process are taken from it, not computed (engine/save/hash_memo.py)
    memo: HashMemo | None = field(default=None, compare=False)
    #: the threads hashing the chunks (``SaveOptions.copy_threads``; None: as many as the
    #: copies take by default, engine/memory/copies.py)
    threads: int | None = None

    def reads_every_chunk(self) -> bool:
        return False

    def before_stage(self, state_dict: Mapping[str, Any], rank: int) -> Pending:
        """The memo's sources, and the base's index read on a thread of its own meanwhile."""
        sources = None if self.memo is None else self.memo.sources(state_dict, rank)
        if self.base is None:
            return Pending(sources)
        reader = ThreadPoolExecutor(1, thread_name_prefix="ckptfsBaseIndex")
        try:
            return Pending(sources, reader.submit(self._base_index))
        finally:
            reader.shutdown(wait=False)  # the read goes on; the thread ends with it

    def before_copy(self, chunks: Sequence[ChunkData], note: Any
                    ) -> tuple[Pending, Mapping[ChunkId, ChunkEntry]]:
        """A save that copies (asynchronous, the manager's): ``chunks`` hashed in place, views
        of the caller's CPU tensors, before any is copied; those the base holds with equal
        hashes are references, never copied (the caller's bytes now are the ones hashed)."""
        pending = note if isinstance(note, Pending) else Pending()
        hashes = self._hashes(chunks, pending.sources)
        refs = self._refs(chunks, hashes, pending) if self.base is not None else {}
        return dataclasses.replace(pending, hashes={**pending.hashes, **hashes},
                                   refs={**pending.refs, **refs}), refs

    def after_stage(self, chunks: Sequence[ChunkData], comm: Comm, note: Any, *,
                    tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None) -> DeltaNote:
        """The staged chunks not hashed by ``before_copy`` (all of a synchronous save, read in
        place; an asynchronous save's CUDA and non-contiguous chunks, from their copies)
        hashed and, with a base, compared with it."""
        pending = note if isinstance(note, Pending) else Pending()
        todo = [c for c in chunks if chunk_id(c) not in pending.hashes]
        hashes = {**pending.hashes, **self._hashes(todo, pending.sources)}
        if self.base is None:
            return DeltaNote(hashes)
        return DeltaNote(hashes, {**pending.refs, **self._refs(todo, hashes, pending)})

    def _refs(self, chunks: Sequence[ChunkData], hashes: Mapping[ChunkId, str],
              pending: Pending) -> dict[ChunkId, ChunkEntry]:
        """The references of ``chunks`` to the base (its index as ``pending`` reads it)."""
        assert self.base is not None
        if self.backend != RAW_BACKEND:
            raise ConfigError(f"a delta save on {self.base!r} needs backend "
                              f"{RAW_BACKEND[0]}-{RAW_BACKEND[1]}, not "
                              f"{self.backend[0]}-{self.backend[1]}")
        if split_url(self.base) == split_url(self.url):
            raise ConfigError(f"a delta save to {self.url!r} names itself as its base: a "
                              f"checkpoint cannot reference the files it replaces")
        base = pending.index.result() if pending.index is not None else self._base_index()
        where = relative_url(self.base, self.url)
        refs = {}
        for c in chunks:
            h = hashes.get(chunk_id(c))
            e = base.tensors.get(c.key)
            ref = _match(c, h, e, where, self.url) if h is not None and e is not None else None
            if ref is not None:
                refs[chunk_id(c)] = ref
        return refs

    def _hashes(self, chunks: Sequence[ChunkData], sources: Sources | None) -> dict[ChunkId, str]:
        """Each host chunk's content hash: from the memo where its tensor is unchanged since
        the save that hashed it, else computed (``hash_chunks``; then recorded in the memo)."""
        out, todo = {}, []
        for c in chunks:
            if c.source is None:
                cid = chunk_id(c)
                known = None if self.memo is None or sources is None else self.memo.get(cid, sources)
                if known is None:
                    todo.append(c)
                else:
                    out[cid] = known
        out.update(hash_chunks(todo, copy_threads(self.threads)))
        if self.memo is not None and sources is not None:
            self.memo.record(out, sources)
        return out

    def _base_index(self) -> Index:
        async def read() -> Index:
            store = await open_store(self.base or "", self.storage_options)
            try:
                return await read_index(store)
            finally:
                await store.close()

        index = run_sync(read())
        if (index.backend, index.backend_version) != RAW_BACKEND:
            raise ConfigError(f"base {self.base!r} is a {index.backend}-{index.backend_version} "
                              f"checkpoint; a delta save references only "
                              f"{RAW_BACKEND[0]}-{RAW_BACKEND[1]} chunks")
        return index

    def chunk_reference(self, chunk: ChunkData, note: DeltaNote) -> ChunkEntry | None:
        return note.refs.get(chunk_id(chunk))

    def after_write(self, suspect: Sequence[ChunkData], note: DeltaNote) -> WriteOutcome:
        return WriteOutcome(note, part=dict(note.hashes))

    def rank_entries(self, entries: Sequence[tuple[str, ChunkEntry]], note: DeltaNote
                     ) -> Sequence[tuple[str, ChunkEntry]]:
        """This rank's entries with the hashes of its chunks (a segmented save's rows)."""
        return [(k, _hashed_entry(k, e, note.hashes)) for k, e in entries]

    def before_commit(self, index: Index, parts: Sequence[Any], note: Any) -> Index:
        hashes: dict[ChunkId, str] = {}
        for part in parts:
            hashes.update(part or {})
        tensors = {k: _hashed(k, t, hashes) for k, t in index.tensors.items()}
        return dataclasses.replace(index, tensors=tensors)


#: chunks smaller than this are hashed by the calling thread, the others on helper threads
PARALLEL_MIN = 1 << 20


def hash_chunks(chunks: Sequence[ChunkData], threads: int) -> dict[ChunkId, str]:
    """The content hash of each of ``chunks`` (host chunks), read in place from their data.
    xxhash releases the GIL while it hashes a large buffer, so the chunks of ``PARALLEL_MIN``
    bytes and more are hashed ``threads`` at a time, the largest first, while the calling
    thread hashes the small ones (a chunk is one hash: one thread reads it whole)."""
    big = sorted((c for c in chunks if c.data.nbytes >= PARALLEL_MIN),
                 key=lambda c: c.data.nbytes, reverse=True)
    if threads <= 1 or len(big) <= 1:
        return {chunk_id(c): content_hash(tensor_bytes(c.data)) for c in chunks}
    with ThreadPoolExecutor(min(threads, len(big))) as pool:
        futures = [(chunk_id(c), pool.submit(content_hash, tensor_bytes(c.data))) for c in big]
        out = {chunk_id(c): content_hash(tensor_bytes(c.data)) for c in chunks
               if c.data.nbytes < PARALLEL_MIN}
        out.update((cid, f.result()) for cid, f in futures)
    return out


def _hashed(key: str, t: TensorEntry, hashes: Mapping[ChunkId, str]) -> TensorEntry:
    """``t`` with each chunk's hash (a chunk that has one keeps it: a reference's)."""
    return dataclasses.replace(t, chunks=tuple(_hashed_entry(key, c, hashes) for c in t.chunks))


def _hashed_entry(key: str, c: ChunkEntry, hashes: Mapping[ChunkId, str]) -> ChunkEntry:
    """``c`` with its hash (one that has one keeps it: a reference's)."""
    h = hashes.get((key, c.offsets, c.shape)) if c.hash is None else None
    return c if h is None else dataclasses.replace(c, hash=h)


def _match(c: ChunkData, digest: str, e: TensorEntry, base: str, root: str) -> ChunkEntry | None:
    """A reference to the base's chunk of ``c``'s box in tensor ``e`` of the base (recorded
    at ``base`` from ``root``), when its dtype, global shape and hash equal ``c``'s."""
    if e.dtype != c.dtype.name or e.shape != c.global_shape:
        return None
    for b in e.chunks:
        if b.offsets != c.box.offsets or b.shape != c.box.shape:
            continue
        if b.hash != digest or b.checksum is None or b.file is None or b.byte_offset is None:
            return None
        # the base's own reference names its base relative to the base: seen from here
        where = base if b.base is None else relative_url(resolve_url(resolve_url(root, base),
                                                                     b.base), root)
        return dataclasses.replace(b, base=where)
    return None
