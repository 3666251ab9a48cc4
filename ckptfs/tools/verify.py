"""``ckptfs.verify``: check a checkpoint end to end and report every problem, not just the first.

Checks, in order: the index's own checksum; the index against formats/index.schema.json (when
jsonschema is installed) and the format's compatibility policy; every file of the checkpoint
(data and backend files) present with its recorded size, and nothing else under the root; every
tensor's chunks inside its shape, pairwise disjoint and covering it (geometry, not area sums);
every file read whole and its crc32c compared (formats/README.md §6), and every chunk's crc32c
compared with the index: from the same bytes where a chunk is stored raw, so each byte is read
once, else read through the backend. A root without an index is surveyed: the files of a save
that did not finish are reported as such (tools/clean.py). A problem names its kind, key, chunk
offsets and file. New kinds may be added (``KINDS``); consumers should treat an unknown kind as
a problem like any other.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import ckptfs.layout
from ckptfs.engine.errors import public_errors
from ckptfs.engine.load.bases import referenced
from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.engine.options import LoadOptions
from ckptfs.errors import CheckpointNotFoundError, CkptfsError
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.io.base_urls import resolve_url
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum, crc_of, extend, render
from ckptfs.layout.content_hash import content_hash
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.index import (
    INDEX_FILE,
    LOCK_FILE,
    ChunkEntry,
    Index,
    TensorEntry,
    sealed_checksum,
)
from ckptfs.layout.registry import get_backend
from ckptfs.layout.tensor_bytes import tensor_bytes
from ckptfs.options import REMOVED, moved_keywords
from ckptfs.tools.clean import survey
from ckptfs.tools.source import DEFAULT_BUFFER, Region, Source, batches, progress_bar, read_regions

SCHEMA_FILE = Path(ckptfs.layout.__file__).resolve().parent / "index.schema.json"

#: Problem kinds this version reports.
KINDS: dict[str, str] = {
    "index": "the index cannot be read or parsed (nothing else could be checked)",
    "schema": "the index JSON does not validate against formats/index.schema.json",
    "missing-file": "a data file the index names is absent",
    "file-size": "a data file's size differs from the index",
    "bounds": "a chunk's box has the wrong rank or leaves its tensor's shape",
    "overlap": "two chunks of a tensor share elements",
    "hole": "the chunks of a tensor leave elements uncovered",
    "dtype": "a tensor's dtype is unknown",
    "read": "a chunk's bytes cannot be read or decoded",
    "checksum": "a chunk's bytes do not match its crc32c",
    "index-checksum": "the index's bytes do not match its own checksum (damaged or edited)",
    "file-checksum": "a file's bytes do not match the crc32c the index records for it",
    "segment": "an index segment or one of its blocks fails its checks (formats/README.md §2.6)",
    "extra-file": "a file under the root is not part of the checkpoint (a leftover)",
    "interrupted": "no committed checkpoint, but the files of a save that did not finish",
}


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a checkpoint."""

    kind: str  #: one of KINDS (later versions may add kinds)
    message: str
    key: str | None = None
    chunk: tuple[int, ...] | None = None  #: the chunk's offsets in its tensor
    file: str | None = None  #: relative to the checkpoint root

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key,
                "chunk": None if self.chunk is None else list(self.chunk),
                "file": self.file, "message": self.message}

    def __str__(self) -> str:
        where = [f"key {self.key!r}" if self.key is not None else "",
                 f"chunk {list(self.chunk)}" if self.chunk is not None else "",
                 f"file {self.file}" if self.file is not None else ""]
        loc = ", ".join(w for w in where if w)
        return f"[{self.kind}] {loc + ': ' if loc else ''}{self.message}"


@dataclass(frozen=True)
class VerifyReport:
    """What ``verify`` checked and every problem it found; ``ok`` when there is none."""

    url: str
    problems: tuple[Problem, ...]
    backend: str | None = None
    backend_version: int | None = None
    foreign: bool = False  #: no ckptfs index: read through the backend's ``sniff``
    tensors: int = 0
    chunks: int = 0
    chunks_checksummed: int = 0  #: chunks whose crc32c matched
    chunks_without_checksum: int = 0  #: read whole, but the index records no checksum
    files: int = 0
    bytes_read: int = 0
    skipped: tuple[str, ...] = ()  #: checks that could not run, and why
    seconds: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def by_kind(self) -> dict[str, list[Problem]]:
        out: dict[str, list[Problem]] = {}
        for p in self.problems:
            out.setdefault(p.kind, []).append(p)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "ok": self.ok, "backend": self.backend,
                "backend_version": self.backend_version, "foreign": self.foreign,
                "tensors": self.tensors, "chunks": self.chunks,
                "chunks_checksummed": self.chunks_checksummed,
                "chunks_without_checksum": self.chunks_without_checksum, "files": self.files,
                "bytes_read": self.bytes_read, "skipped": list(self.skipped),
                "seconds": round(self.seconds, 3),
                "problems": [p.to_dict() for p in self.problems]}


@moved_keywords("verify", REMOVED["store"])
def verify(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
           store_options: StoreOptions | None = None, checksums: bool = True,
           buffer_bytes: int = DEFAULT_BUFFER, progress: bool = False) -> VerifyReport:
    """Check the checkpoint at ``url`` and return every problem found (never raises for a
    damaged checkpoint; a missing one is a problem of kind "index"). ``checksums=False`` skips
    reading the data (schema, files, sizes and tiling only). Reads at most ``buffer_bytes`` of
    chunk data at a time (one larger chunk alone)."""
    t0 = time.perf_counter()
    url = os.fspath(url)
    with public_errors(url):
        store = run_sync(open_store(url, storage_options, store_options))
        try:
            return _verify(url, store, checksums, buffer_bytes, progress, t0)
        finally:
            run_sync(store.close())


def _verify(url: str, store: Store, checksums: bool, buffer_bytes: int, progress: bool,
            t0: float) -> VerifyReport:
    from ckptfs.engine.index_io import read_index

    problems: list[Problem] = []
    skipped: list[str] = []
    raw = _read_raw_index(store)
    foreign = raw is None
    if raw is not None:
        _own_checksum(store, raw, problems, skipped)
        _schema(raw, problems, skipped)
    try:
        if raw is not None:  # read as it is, also when it failed its own checksum
            index = Index.loads(raw, store.full_path(INDEX_FILE), check=False)
        else:
            index = run_sync(read_index(store))
    except (CkptfsError, OSError) as e:
        where = survey(store) if isinstance(e, CheckpointNotFoundError) else None
        if where is not None and where.state == "interrupted":
            problems.append(Problem("interrupted", where.describe(), file=LOCK_FILE
                                    if where.lock_present else None))
        else:
            problems.append(Problem("index", f"{type(e).__name__}: {e}", file=INDEX_FILE))
        return VerifyReport(url, tuple(problems), skipped=tuple(skipped),
                            seconds=time.perf_counter() - t0)
    if foreign:
        _schema(json.dumps(index.to_dict()).encode(), problems, skipped, sniffed=True)
    else:
        _extra_files(store, problems, skipped)
    if index.segmented:
        index = _segment_rows(store, index, problems)
    chunks = sum(len(t.chunks) for t in index.tensors.values())
    missing = _files(store, index, problems) | _base_files(store, index, problems)
    for entry in index.tensors.values():
        _tiling(entry, problems, skipped)
    summed = unsummed = 0
    before = store.stats.bytes_read
    if checksums:
        bar = progress_bar(0, f"ckptfs verify {url}", progress)
        try:
            summed, unsummed = _read_everything(url, store, index, foreign, missing, problems,
                                                skipped, buffer_bytes, bar)
        finally:
            bar.close()
    else:
        skipped.append("checksums: not requested (every chunk's bytes were left unread)")
    return VerifyReport(
        url, tuple(problems), index.backend, index.backend_version, foreign, len(index.tensors),
        chunks, summed, unsummed, len(_all_files(index)), store.stats.bytes_read - before,
        tuple(skipped), time.perf_counter() - t0)


def _read_everything(url: str, store: Store, index: Index, foreign: bool, missing: set[str],
                     problems: list[Problem], skipped: list[str], buffer_bytes: int,
                     bar: Any) -> tuple[int, int]:
    """Every byte read once: each file whole for its checksum, which also checks the chunks
    stored as their raw bytes; then, through the backend, only the chunks that pass did not
    check (encoded or padded chunks, foreign checkpoints). Returns (matched, unsummed)."""
    checked: set[tuple[str, tuple[int, ...]]] = set()
    if not foreign:
        checked = _file_checksums(store, index, missing, problems, skipped, buffer_bytes, bar)
    try:
        backend = get_backend(index.backend, index.backend_version)(index.backend_options)
    except CkptfsError as e:
        problems.append(Problem("index", f"{type(e).__name__}: {e}"))
        return len(checked), 0
    source = Source(url, store, index, backend, foreign, BufferPool(limit=LoadOptions.scratch_bytes))
    matched, unsummed = _chunks(source, missing, problems, buffer_bytes, bar, checked)
    return matched + len(checked), unsummed


def _own_checksum(store: Store, raw: bytes, problems: list[Problem], skipped: list[str]) -> None:
    """The index's own checksum (formats/README.md §6.2), before anything else."""
    found = sealed_checksum(raw)
    if found is None:
        skipped.append("index checksum: the index records none (written by a ckptfs before "
                       "whole-checkpoint checksums)")
        return
    got = render(extend(crc_of(memoryview(raw)[:found[1]]), b"}"))
    if got != found[0]:
        problems.append(Problem("index-checksum", f"the index fails its own checksum "
                                f"(index_checksum says {found[0]}, its bytes give {got}): it was "
                                f"damaged or edited after it was written", file=INDEX_FILE))


def _extra_files(store: Store, problems: list[Problem], skipped: list[str]) -> None:
    """Files under the root that are not part of the committed checkpoint."""
    s = survey(store)
    for f in s.leftovers:
        what = ("the save lock of a save that did not finish or did not remove it"
                if f == LOCK_FILE else "not part of the checkpoint: a leftover of a save that "
                                       "did not finish (`ckptfs clean URL` removes it)")
        problems.append(Problem("extra-file", what, file=f))
    if s.index is not None and not s.index.complete_manifest:
        skipped.append("extra files: the index does not list the backend's own files (written "
                       "by a ckptfs before whole-checkpoint checksums); only other saves' data "
                       "directories count as extra")
    for d in s.nested:
        skipped.append(f"{d}/: a checkpoint of its own below this one, not checked")


def _file_checksums(store: Store, index: Index, missing: set[str], problems: list[Problem],
                    skipped: list[str], buffer_bytes: int, bar: Any) -> set[tuple[str, tuple[int, ...]]]:
    """Read every file whole (a piece at a time) and compare its crc32c with the index; the
    chunks stored as their raw bytes are checked from the same pieces. Returns the (key,
    offsets) of the chunks that matched that way."""
    if not index.file_checksums:
        skipped.append("whole-file checksums: the index records none (written by a ckptfs before "
                       "whole-checkpoint checksums); the chunks' checksums were checked")
        return set()
    piece = max(1, min(buffer_bytes, 64 << 20))
    sizes = index.all_files
    sized = {p.file for p in problems if p.kind == "file-size"}  # their checksum cannot match
    todo = [(path, want) for path, want in sorted(index.file_checksums.items())
            if path not in missing and path not in sized]
    bar.add_total(sum(sizes.get(path) or 0 for path, _ in todo))
    raw = _raw_chunks(index)
    checked: set[tuple[str, tuple[int, ...]]] = set()
    for path, want in todo:
        try:
            got, matched = run_sync(_crc_file(store, path, piece, raw.get(path, []), bar))
        except (CkptfsError, OSError) as e:
            problems.append(Problem("read", f"{type(e).__name__}: {e}", file=path))
            continue
        checked |= matched
        if render(got) != want:
            keys = sorted({t.key for t in index.tensors.values() for c in t.chunks if c.file == path})
            holds = (f"holds {', '.join(map(repr, keys[:5]))}{' ...' if len(keys) > 5 else ''}"
                     if keys else "a file of the backend" if path in index.backend_files
                     else "no chunk")
            problems.append(Problem("file-checksum", f"crc32c of the whole file is {render(got)}, "
                                    f"the index says {want} ({sizes.get(path, '?')} bytes; {holds})",
                                    file=path))
    return checked


@dataclass
class _RawChunk:
    """A chunk whose stored bytes may be its raw bytes: its CRC is built from the file's pieces."""

    key: str
    offsets: tuple[int, ...]
    start: int
    end: int
    want: str
    crc: int = 0


def _raw_chunks(index: Index) -> dict[str, list[_RawChunk]]:
    """Per file, the chunks stored with as many bytes as their raw C-order data (and a checksum),
    by offset. A chunk whose stored bytes turn out not to be its raw bytes (an encoding of the
    same length) fails the comparison and is read again through the backend, never reported."""
    out: dict[str, list[_RawChunk]] = {}
    for entry in index.tensors.values():
        try:
            itemsize = from_name(entry.dtype, entry.key).itemsize
        except CkptfsError:
            continue
        for c in entry.chunks:
            if c.file is None or c.byte_offset is None or c.checksum is None \
                    or c.base is not None:
                continue
            if c.byte_length != int(np.prod(c.shape, dtype=np.int64)) * itemsize:
                continue
            end = c.byte_offset + c.byte_length
            out.setdefault(c.file, []).append(
                _RawChunk(entry.key, tuple(c.offsets), c.byte_offset, end, c.checksum))
    for chunks in out.values():
        chunks.sort(key=lambda r: r.start)
    return out


async def _crc_file(store: Store, path: str, piece: int, chunks: list[_RawChunk],
                    bar: Any) -> tuple[int, set[tuple[str, tuple[int, ...]]]]:
    """(crc32c of the whole file, the raw chunks in it whose bytes matched their checksum)."""
    size = await store.size(path)
    value = 0
    for start in range(0, size, piece):
        end = min(size, start + piece)
        data = memoryview(await store.get_range(path, start, end))
        value = extend(value, data)
        for c in chunks:
            lo, hi = max(c.start, start), min(c.end, end)
            if lo < hi:
                c.crc = extend(c.crc, data[lo - start:hi - start])
        bar.update(end - start)
    return value, {(c.key, c.offsets) for c in chunks if c.end <= size and render(c.crc) == c.want}


def _read_raw_index(store: Store) -> bytes | None:
    try:
        return bytes(run_sync(store.get(INDEX_FILE)))
    except FileNotFoundError:
        return None


def _schema(raw: bytes, problems: list[Problem], skipped: list[str], sniffed: bool = False) -> None:
    try:
        import jsonschema
    except ImportError:
        skipped.append("schema: jsonschema is not installed (pip install 'ckptfs[conformance]')")
        return
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return  # reported by the index parser
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    validator = jsonschema.validators.validator_for(schema)(schema)
    what = "the index built from the foreign files, " if sniffed else ""
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        path = list(e.absolute_path)
        key = path[1] if len(path) > 1 and path[0] in ("tensors", "values") else None
        problems.append(Problem("schema", f"{what}at {path}: {e.message}", key=key,
                                file=None if sniffed else INDEX_FILE))


def _segment_rows(store: Store, root: Index, problems: list[Problem]) -> Index:
    """A segmented root's rows (formats/README.md §2.6): every segment read whole and every
    block checked against the root; what fails is a problem naming the segment (and the key),
    and its tensors are then left with the rows that could be read."""
    from ckptfs.engine.index_io import read_all_rows

    failed: list[tuple[str, str | None, CkptfsError]] = []
    index = run_sync(read_all_rows(store, root, failed))
    for path, key, e in failed:
        if isinstance(e, CheckpointNotFoundError):
            continue  # the missing file is reported with the others
        problems.append(Problem("segment", f"{type(e).__name__}: {e}", key=key, file=path))
    return index


def _all_files(index: Index) -> dict[str, int | None]:
    """Every file the index names: its file tables (with sizes) and every chunk's file."""
    files: dict[str, int | None] = dict(index.all_files)
    for t in index.tensors.values():
        for c in t.chunks:
            if c.file is not None and c.base is None:  # a reference's file is its base's
                files.setdefault(c.file, None)
    return files


def _base_files(store: Store, index: Index, problems: list[Problem]) -> set[str]:
    """Check that every file a reference names is in its base checkpoint (formats/README.md
    §2.5) and holds the named range; returns the missing ones, as ``referenced`` names them."""
    ranges: dict[str, tuple[str, str, int, set[str]]] = {}  # path -> (base, file, end, keys)
    for t in index.tensors.values():
        for c in t.chunks:
            path = referenced(c)
            if path is None or c.base is None or c.file is None:
                continue
            end = (c.byte_offset or 0) + (c.byte_length or 0)
            base, file, last, keys = ranges.get(path, (c.base, c.file, 0, set()))
            ranges[path] = (base, file, max(last, end), keys | {t.key})
    if not ranges:
        return set()

    async def sizes() -> list[int | None]:
        async def one(base: str, file: str) -> int | None:
            url = resolve_url(store.url, base)
            s = store.sibling(url) or await open_store(url, None, store.options)
            try:
                return await s.size(file)
            except FileNotFoundError:
                return None
            finally:
                await s.close()
        return await gather_all(*(one(b, f) for b, f, _, _ in ranges.values()))

    missing = set()
    for (path, (base, _, end, keys)), got in zip(ranges.items(), run_sync(sizes()), strict=True):
        shown = ", ".join(map(repr, sorted(keys)[:5])) + (" ..." if len(keys) > 5 else "")
        if got is None:
            missing.add(path)
            problems.append(Problem("missing-file", f"a file of base {base!r} is missing "
                                    f"(referenced by {shown})", file=path))
        elif got < end:
            problems.append(Problem("file-size", f"{got} bytes, the references of {shown} "
                                    f"read up to byte {end} of base {base!r}", file=path))
    return missing


def _files(store: Store, index: Index, problems: list[Problem]) -> set[str]:
    """Check presence and size of every file; returns the missing ones."""
    files = _all_files(index)

    async def sizes() -> list[int | None]:
        async def one(path: str) -> int | None:
            try:
                return await store.size(path)
            except FileNotFoundError:
                return None
        return await gather_all(*(one(p) for p in files))

    missing = set()
    for (path, want), got in zip(files.items(), run_sync(sizes()), strict=True):
        if got is None:
            missing.add(path)
            keys = sorted({t.key for t in index.tensors.values() for c in t.chunks if c.file == path})
            shown = ", ".join(map(repr, keys[:5])) + (" ..." if len(keys) > 5 else "")
            what = ("backend file is missing" if path in index.backend_files
                    else f"data file is missing (holds {shown or 'no chunk'})")
            problems.append(Problem("missing-file", what, file=path))
        elif want is not None and got != want:
            problems.append(Problem("file-size", f"{got} bytes, the index says {want}", file=path))
    return missing


def _tiling(entry: TensorEntry, problems: list[Problem], skipped: list[str]) -> None:
    """Chunks inside the shape, pairwise disjoint, and covering every element: in-bounds,
    disjoint boxes cover the tensor exactly when their volumes add up to its size."""
    shape = entry.shape
    boxes: list[Box] = []
    for c in entry.chunks:
        box = Box(c.offsets, c.shape)
        if not box.in_bounds(shape):
            problems.append(Problem("bounds", f"chunk {box} does not fit in shape {list(shape)}",
                                    entry.key, c.offsets, c.file))
        elif box.volume:
            boxes.append(box)
    boxes.sort()
    overlaps = False
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.offsets and b.offsets[0] >= a.ends[0]:
                break  # sorted by offsets: no later box reaches back into a
            common = a.intersect(b)
            if common is not None:
                overlaps = True
                problems.append(Problem("overlap", f"chunks {a} and {b} share {common}", entry.key,
                                        b.offsets))
    total = entry.numel
    if not overlaps:
        covered = sum(b.volume for b in boxes)
        if covered != total:
            problems.append(Problem("hole", f"the chunks cover {covered} of {total} elements of "
                                            f"shape {list(shape)}{_first_hole(shape, boxes)}", entry.key))
    elif total > HOLE_MAP_LIMIT:
        skipped.append(f"holes of key {entry.key!r}: its chunks overlap and it has {total} elements")
    else:
        hole = _first_hole(shape, boxes)
        if hole:
            problems.append(Problem("hole", f"the chunks leave elements of shape {list(shape)} "
                                            f"uncovered{hole}", entry.key))


#: largest tensor (elements) whose coverage is mapped element by element to locate a hole
HOLE_MAP_LIMIT = 1 << 24


def _first_hole(shape: tuple[int, ...], boxes: list[Box]) -> str:
    """' (first uncovered element [i, j, ...])', or '' when all are covered or the tensor is
    too large to map."""
    n = 1
    for s in shape:
        n *= s
    if n > HOLE_MAP_LIMIT:
        return ""
    covered = np.zeros(shape, dtype=bool)
    for b in boxes:
        covered[b.slices()] = True
    holes = np.argwhere(~covered)
    return f" (first uncovered element {holes[0].tolist()})" if len(holes) else ""


def _chunks(source: Source, missing: set[str], problems: list[Problem], buffer_bytes: int,
            bar: Any, checked: set[tuple[str, tuple[int, ...]]]) -> tuple[int, int]:
    """Read every chunk not ``checked`` already whole (through the backend, so encoded and padded
    chunks count) and compare its crc32c. Returns (chunks that matched, chunks without a
    checksum)."""
    regions = []
    for entry in source.index.tensors.values():
        try:
            from_name(entry.dtype, entry.key)
        except CkptfsError as e:
            problems.append(Problem("dtype", str(e), entry.key))
            continue
        for c in entry.chunks:
            if (referenced(c) or c.file) in missing \
                    or not Box(c.offsets, c.shape).in_bounds(entry.shape):
                continue
            if (entry.key, tuple(c.offsets)) in checked:
                continue
            regions.append(Region.of_chunk(entry, c))
    store = source.store
    matched = unsummed = 0
    for batch in batches(regions, buffer_bytes):
        before = store.stats.bytes_read
        m, u = _check_batch(source, batch, buffer_bytes, problems)
        matched, unsummed = matched + m, unsummed + u
        got = store.stats.bytes_read - before  # what was read: stored bytes, not decoded ones
        bar.add_total(got)
        bar.update(got)
    return matched, unsummed


def _check_batch(source: Source, batch: list[Region], buffer_bytes: int,
                 problems: list[Problem]) -> tuple[int, int]:
    """Read one batch and check it (its tensors are freed on return, before the next batch)."""
    try:
        got = list(read_regions(source, batch, buffer_bytes=buffer_bytes, verify=False))
    except Exception:  # find the culprits one chunk at a time
        got = []
        for r in batch:
            try:
                got += list(read_regions(source, [r], verify=False))
            except Exception as e:
                problems.append(Problem("read", f"{type(e).__name__}: {e}", r.entry.key,
                                        r.box.offsets, r.chunk.file if r.chunk else None))
    matched = unsummed = 0
    for r, data in got:
        want = r.chunk.checksum if r.chunk else None
        if want is None:
            unsummed += 1
            continue
        have = checksum(tensor_bytes(data))
        if have != want:
            problems.append(Problem("checksum", f"crc32c is {have}, the index says {want}",
                                    r.entry.key, r.box.offsets, _where(r.chunk)))
        elif r.chunk and r.chunk.hash and content_hash(tensor_bytes(data)) != r.chunk.hash:
            problems.append(Problem("checksum", f"the content hash differs from the index's "
                                    f"{r.chunk.hash}", r.entry.key, r.box.offsets,
                                    _where(r.chunk)))
        else:
            matched += 1
    return matched, unsummed


def _where(chunk: ChunkEntry | None) -> str | None:
    """The file a chunk's problem names: a reference's as ``base/file``."""
    return None if chunk is None else referenced(chunk) or chunk.file
