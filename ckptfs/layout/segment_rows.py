"""The rows of a segmented index (formats/README.md §2.6): an owner encodes its tensors' chunk
rows into a segment file and reports the blocks; the coordinator makes the root from the
owners' reports; a reader decodes the blocks it read, checked against the root."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from itertools import chain
from operator import add, le
from typing import Any

from ckptfs.errors import IntegrityError, MalformedIndexError
from ckptfs.layout.checksum import checksum, crc_of
from ckptfs.layout.index import (
    HASHES_MINOR_VERSION,
    MAX_DIM,
    PACKED_CHUNKS,
    ChunkEntry,
    Index,
    TensorEntry,
    check_relative_path,
    parse_json,
)
from ckptfs.layout.segments import (
    ROWS_PER_BLOCK,
    SEGMENT_FILE_IDS,
    SEGMENT_ROWS,
    SEGMENTS,
    Block,
    SegmentFile,
    SegmentPart,
    block_order,
    bounding,
    numbering,
    partition,
    segment_path,
    table_digest,
)

_CRC = "crc32c:"


class _Paths(Mapping[str, str]):
    """A file's packed-row item in an index 1.3 segment is its path (§2.6), not a file-table
    position."""

    def __getitem__(self, path: str) -> str:
        return path

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def encode_segment(rows: Mapping[str, Sequence[ChunkEntry]], path: str, *, packed: bool,
                   bases: Sequence[str] = (), rows_per_block: int = ROWS_PER_BLOCK,
                   table: Mapping[str, int] | None = None) -> tuple[bytes, SegmentPart]:
    """*Writer*: the bytes of the segment file at ``path`` holding ``rows`` (per tensor key, in
    the order given) and the report its owner sends to the coordinator. ``packed``: rows in
    the packed form (§2.3), the file by its position in ``table`` (the root's file table,
    ``file_ids``: index 1.4) or, without it, by path (index 1.3); otherwise chunk objects
    (§2.1, §2.5) numbering ``bases``."""
    out = bytearray()
    base_ids = {u: i for i, u in enumerate(bases)}
    paths: Mapping[str, Any] = _Paths() if table is None else table
    blocks: list[tuple[str, tuple[Block, ...]]] = []
    for key, chunks in rows.items():
        ordered: list[Any] = block_order(chunks)
        mine = []
        for i in range(0, len(ordered), rows_per_block):
            part = ordered[i:i + rows_per_block]
            doc = [c.to_row(paths) if packed else c.to_dict(base_ids) for c in part]
            body = json.dumps(doc, ensure_ascii=False, allow_nan=False).encode()
            lo, hi = bounding(part)
            mine.append(Block(-1, len(out), len(body), f"{crc_of(body):08x}", lo, hi))
            out += body
            out += b"\n"
        blocks.append((key, tuple(mine)))
    data = bytes(out)
    digest = None if table is None or not packed else \
        table_digest(sorted(table, key=table.__getitem__))
    return data, SegmentPart(SegmentFile(path, len(data), checksum(data)), tuple(blocks), digest)


def root_of(index: Index, parts: Sequence[SegmentPart], *, packed: bool) -> Index:
    """*Writer* (coordinator): the segmented root of ``index`` (its tensors without chunks, its
    data files and their checksums) from the owners' ``parts``, numbered in their order; the
    segment files join the data files. A tensor no part names has no rows (no elements).
    Parts whose rows number the file table (index 1.4) must have numbered this root's."""
    blocks: dict[str, tuple[Block, ...]] = {}
    for pos, part in enumerate(parts):
        for key, bs in part.blocks:
            if key in blocks or key not in index.tensors:
                raise ValueError(f"segment {part.file.path}: key {key!r} is in two segments "
                                 f"or not a tensor of the index")
            blocks[key] = tuple(b.numbered(pos) for b in bs)
    tensors = {k: TensorEntry(t.key, t.dtype, t.shape, (), t.extra, t.stats, blocks.get(k, ()))
               for k, t in index.tensors.items()}
    features = [f for f in index.required_features
                if f not in (PACKED_CHUNKS, SEGMENTS, SEGMENT_FILE_IDS)]
    if packed:
        features.append(PACKED_CHUNKS)
    files = dict(sorted({**index.files, **{p.file.path: p.file.size for p in parts}}.items()))
    table = None
    if packed and parts and parts[0].table is not None:
        table = tuple(files)
        digest = table_digest(table)
        wrong = [p.file.path for p in parts if p.table != digest]
        if wrong:
            raise ValueError(f"segment {wrong[0]}: its rows number a file table other than the "
                             f"root's ({digest}), or name files by path")
        features += [SEGMENTS, SEGMENT_FILE_IDS]
    sums = {**index.file_checksums, **{p.file.path: p.file.checksum for p in parts}}
    return replace(index, tensors=tensors, files=files, file_checksums=sums,
                   required_features=tuple(features), segments=tuple(p.file.path for p in parts),
                   base_urls=index.bases if not index.segmented else index.base_urls,
                   file_table=table)


def decode_block(raw: bytes, block: Block, entry: TensorEntry, root: Index, *,
                 source: str) -> tuple[ChunkEntry, ...]:
    """The chunk rows of ``block`` of ``entry`` from its bytes ``raw``, checked: its CRC-32C,
    the rows' form (packed or objects as the root's features say; a packed row's file a
    position of the root's file table (index 1.4) or a path (1.3)), paths inside the root and
    among its data files, byte ranges inside the files, and every chunk inside the block's
    bounding box and the tensor (a reader skipping the block must miss nothing)."""
    assert root.segments is not None, "decode_block reads a segmented index's rows"
    seg = root.segments[block.segment]
    where = f"{source}: segment {seg}, block [{block.byte_offset}, " \
            f"{block.byte_offset + block.byte_length}) of tensor {entry.key!r}"
    got = f"{crc_of(raw):08x}"
    if len(raw) != block.byte_length or got != block.crc:
        raise IntegrityError(f"{where}: {len(raw)} bytes with crc32c {got}, the root records "
                             f"{block.byte_length} bytes with {block.crc}: the segment was "
                             f"damaged or replaced after it was written")
    doc = parse_json(raw, where)
    if not isinstance(doc, list):
        raise MalformedIndexError(f"{where}: a block must be a JSON array of chunk entries")
    fast = _numbered_rows(doc, block, entry, root) if root.file_table is not None else None
    if fast is not None:
        return fast
    if root.file_table is not None:
        table = root.file_table
        chunks = tuple(ChunkEntry.from_row(r, table, _at(where, i)) for i, r in enumerate(doc))
    else:
        chunks = tuple(_row(r, root, f"{where}, row {i}") for i, r in enumerate(doc))
    bad = _outside(chunks, block, entry)
    if bad is not None:
        c = chunks[bad]
        raise MalformedIndexError(f"{where}, row {bad}: chunk at {list(c.offsets)} of shape "
                                  f"{list(c.shape)} lies outside the block's box "
                                  f"[{list(block.lo)}, {list(block.hi)}) or the tensor")
    _check_files(chunks, root, where)
    return chunks


def _numbered_rows(doc: list[Any], block: Block, entry: TensorEntry, root: Index
                   ) -> tuple[ChunkEntry, ...] | None:
    """The rows of an index 1.4 block checked column by column, when each is a plain packed row
    (six items, none null, no ``extra``) that passes every check ``decode_block`` makes; None
    when some row does not (the row-by-row checks then name it). A rank decodes tens of
    thousands of rows: one pass per column instead of several per row."""
    table = root.file_table
    assert table is not None
    if not doc or not all(type(r) is list and len(r) == 6 for r in doc):
        return None
    offsets, shapes, fids, starts, lengths, crcs = zip(*doc)
    ndim = len(entry.shape)
    if not (set(map(type, offsets)) == {list} == set(map(type, shapes))
            and set(map(len, offsets)) == {ndim} == set(map(len, shapes))
            and set(map(type, crcs)) == {str}):
        return None
    numbers = [*chain.from_iterable(offsets), *chain.from_iterable(shapes), *fids, *starts,
               *lengths]
    if set(map(type, numbers)) != {int} or min(numbers) < 0 or max(numbers) > MAX_DIM \
            or max(fids) >= len(table):
        return None
    for d, (lo, hi) in enumerate(zip(block.lo, map(min, block.hi, entry.shape))):
        column = [o[d] for o in offsets]
        if min(column) < lo or max(map(add, column, [s[d] for s in shapes])) > hi:
            return None
    segments = frozenset(root.segments or ())
    known = {f: root.files.get(table[f]) for f in set(fids)}
    if any(n is None or table[f] in segments for f, n in known.items()):
        return None
    sizes = {f: n for f, n in known.items() if n is not None}
    if not all(map(le, map(add, starts, lengths), map(sizes.__getitem__, fids))):
        return None
    return tuple(ChunkEntry(tuple(o), tuple(s), table[f], a, n, _CRC + c, {})
                 for o, s, f, a, n, c in zip(offsets, shapes, fids, starts, lengths, crcs))


def _at(where: str, i: int) -> Callable[[], str]:
    """Where row ``i`` of a block is, for messages: made only when an error needs it."""
    return lambda: f"{where}, row {i}"


def _row(r: Any, root: Index, where: str) -> ChunkEntry:
    """One row of an index 1.3 block: a packed row (its file a path) or a chunk object."""
    if PACKED_CHUNKS not in root.required_features:
        if not isinstance(r, dict):
            raise MalformedIndexError(f"{where}: a chunk object was expected")
        return ChunkEntry.from_dict(r, where, root.base_urls)
    if not isinstance(r, list) or len(r) not in (6, 7):
        raise MalformedIndexError(f"{where}: a packed chunk must be a list of 6 or 7 items")
    path = r[2]
    if path is not None and not isinstance(path, str):
        raise MalformedIndexError(f"{where}: the file of a segment's packed row is a path, "
                                  f"got {path!r}")
    files = [] if path is None else [check_relative_path(path, where)]
    return ChunkEntry.from_row([*r[:2], None if path is None else 0, *r[3:]], files, where)


def _outside(chunks: Sequence[ChunkEntry], block: Block, entry: TensorEntry) -> int | None:
    """The first row whose box is not inside the block's box ``[lo, hi)`` and the tensor
    (dimensions differing included), or None."""
    lo, hi = block.lo, tuple(map(min, block.hi, entry.shape))
    ndim = len(entry.shape)
    for i, c in enumerate(chunks):
        if len(c.offsets) != ndim or not all(
                a <= o and o + n <= z for o, n, a, z in zip(c.offsets, c.shape, lo, hi)):
            return i
    return None


def _check_files(chunks: Sequence[ChunkEntry], root: Index, where: str) -> None:
    """Each row's file is a data file of the root (not a segment) and its byte range lies
    inside the file's recorded size."""
    files, segments = root.files, frozenset(root.segments or ())
    for i, c in enumerate(chunks):
        if c.file is None or c.base is not None:
            continue
        size = files.get(c.file)
        if size is None or c.file in segments:
            raise MalformedIndexError(f"{where}, row {i}: file {c.file!r} is not a data file of "
                                      f"the index")
        if c.byte_offset is not None and c.byte_length is not None \
                and c.byte_offset + c.byte_length > size:
            raise MalformedIndexError(f"{where}, row {i}: bytes [{c.byte_offset}, "
                                      f"{c.byte_offset + c.byte_length}) lie beyond the end of "
                                      f"{c.file} ({size} bytes by the index)")


def segment_blocks(root: Index) -> dict[int, list[tuple[str, Block]]]:
    """Every block of the root by segment position, in byte order: (key, block)."""
    out: dict[int, list[tuple[str, Block]]] = {}
    for key, t in root.tensors.items():
        for b in t.blocks or ():
            out.setdefault(b.segment, []).append((key, b))
    for bs in out.values():
        bs.sort(key=lambda kb: kb[1].byte_offset)
    return out



def split_index(index: Index, save_id: str, *, rows: int = SEGMENT_ROWS, world: int = 1,
                packed: bool | None = None, rows_per_block: int = ROWS_PER_BLOCK,
                file_ids: bool = True) -> tuple[Index, dict[str, bytes]]:
    """A whole ``index`` written segmented in one process (what the ranks of a segmented save
    write between them): the root and the segment files' bytes by path. ``packed``: the rows'
    form (None: packed unless the index holds content hashes or references, §2.5);
    ``file_ids``: packed rows number the root's file table (index 1.4), else name their file
    by path (index 1.3)."""
    if index.segmented:
        raise ValueError("split_index: the index is segmented already")
    if packed is None:
        packed = index.minor_version_used < HASHES_MINOR_VERSION
    keys = [k for k in (index.order or index.tensors) if k in index.tensors]
    owners = partition([len(index.tensors[k].chunks) for k in keys], world, rows)
    paths = [segment_path(save_id, o.pos) for o in owners]
    table = numbering([*index.files, *paths]) if packed and file_ids else None
    files: dict[str, bytes] = {}
    parts = []
    for o, path in zip(owners, paths, strict=True):
        data, part = encode_segment({k: index.tensors[k].chunks for k in keys[o.start:o.stop]},
                                    path, packed=packed, bases=index.bases,
                                    rows_per_block=rows_per_block, table=table)
        files[path] = data
        parts.append(part)
    return root_of(index, parts, packed=packed), files
