"""Reading a checkpoint's index from a store; foreign checkpoints are sniffed by the backends.

A segmented index (formats/README.md §2.6) is read whole (``read_index``: the root and every
segment, as tools need it) or in part (``read_root``, then ``read_rows`` for the blocks that
overlap the regions a rank loads)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from ckptfs.errors import CheckpointNotFoundError, CkptfsError, ConfigError, IntegrityError
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all
from ckptfs.layout.boxes import Box
from ckptfs.layout.checksum import checksum
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index
from ckptfs.layout.registry import available_backends, get_backend
from ckptfs.layout.segment_rows import decode_block, segment_blocks
from ckptfs.layout.segments import Block

log = logging.getLogger(__name__)


#: blocks of one segment closer than this are read with one ranged request. Small: the blocks a
#: rank skips between the ones it needs are other ranks' columns of the same tensor, often tens
#: of KiB, and reading through them would multiply the index bytes a rank reads; the requests
#: go out together (``gather_all``), so more of them cost little time
GAP_BYTES = 4 << 10


async def read_index(store: Store) -> Index:
    """The checkpoint's whole index (a segmented one with every segment read and its rows in
    place); foreign checkpoints are sniffed by the registered backends."""
    root = await read_root(store)
    return await read_all_rows(store, root) if root.segmented else root


async def read_all_rows(store: Store, root: Index,
                        failed: list[tuple[str, str | None, CkptfsError]] | None = None) -> Index:
    """``root`` with every segment read whole and every tensor's rows in place. With
    ``failed``, a segment or block that cannot be read or fails its checks is recorded there as
    (segment path, key or None, error) and left out instead of raised (``ckptfs verify``)."""
    assert root.segments is not None
    keep = failed is not None
    raws = await gather_all(*(_segment(store, root, p, keep) for p in root.segments))
    rows: dict[str, list[ChunkEntry]] = {k: [] for k in root.tensors}
    for pos, blocks in segment_blocks(root).items():
        raw, err = raws[pos]
        if err is not None:  # with ``failed`` only: the blocks still tell which rows are hurt
            assert failed is not None
            failed.append((root.segments[pos], None, err))
        if raw is None:
            continue
        for key, b in blocks:
            try:
                rows[key].extend(decode_block(raw[b.byte_offset:b.byte_offset + b.byte_length],
                                              b, root.tensors[key], root, source=store.url))
            except CkptfsError as e:
                if failed is None:
                    raise
                failed.append((root.segments[pos], key, e))
    return root.with_rows(rows)


async def _segment(store: Store, root: Index, path: str, keep: bool = False
                   ) -> tuple[bytes | None, CkptfsError | None]:
    """A whole segment file, checked against the size and checksum the root records: (its
    bytes, None). ``keep``: a failure is returned beside the bytes (None if missing), not raised."""
    try:
        raw = bytes(await _get(store, path, None))
    except CkptfsError as e:
        if keep:
            return None, e
        raise
    want, size = root.file_checksums[path], root.files[path]
    got = checksum(raw)
    if len(raw) == size and got == want:
        return raw, None
    err = IntegrityError(f"{store.full_path(path)}: index segment of {len(raw)} bytes with {got}, "
                         f"the root records {size} bytes with {want}: it was damaged or replaced "
                         f"after it was written")
    if keep:
        return raw, err
    raise err


async def _get(store: Store, path: str, span: tuple[int, int] | None) -> bytes:
    try:
        if span is None:
            return bytes(await store.get(path))
        return bytes(await store.get_range(path, *span))
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{store.full_path(path)}: an index segment of the checkpoint at {store.url} is "
            f"missing: the checkpoint cannot be read (formats/README.md §2.6)") from None


async def read_rows(store: Store, root: Index, wanted: Mapping[str, Sequence[Box]]) -> Index:
    """``root`` with the chunks of the keys of ``wanted`` that may overlap their boxes: only
    the blocks overlapping a box are read, neighbours in one segment with one ranged request.
    An index that is not segmented comes back as it is."""
    if not root.segmented:
        return root
    assert root.segments is not None
    todo: dict[int, list[tuple[str, Block]]] = {}
    for key, boxes in wanted.items():
        entry = root.tensors.get(key)
        for b in entry.blocks or () if entry is not None else ():
            if any(b.overlaps(box) for box in boxes):
                todo.setdefault(b.segment, []).append((key, b))
    rows: dict[str, list[ChunkEntry]] = {k: [] for k in wanted if k in root.tensors}
    runs = [run for pos, bs in todo.items() for run in _runs(pos, bs)]
    raws = await gather_all(*(_get(store, root.segments[pos], (lo, hi)) for pos, lo, hi, _ in runs))
    for (_, lo, _, bs), raw in zip(runs, raws, strict=True):
        for key, b in bs:
            part = raw[b.byte_offset - lo:b.byte_offset - lo + b.byte_length]
            rows[key].extend(decode_block(part, b, root.tensors[key], root, source=store.url))
    return root.with_rows(rows)


def _runs(pos: int, blocks: list[tuple[str, Block]]
          ) -> list[tuple[int, int, int, list[tuple[str, Block]]]]:
    """``blocks`` of segment ``pos`` grouped into byte runs: (pos, start, end, blocks)."""
    runs: list[list] = []
    for key, b in sorted(blocks, key=lambda kb: kb[1].byte_offset):
        end = b.byte_offset + b.byte_length
        if runs and b.byte_offset - runs[-1][2] <= GAP_BYTES:
            runs[-1][2] = max(runs[-1][2], end)
            runs[-1][3].append((key, b))
        else:
            runs.append([pos, b.byte_offset, end, [(key, b)]])
    return [(p, lo, hi, bs) for p, lo, hi, bs in runs]


async def read_root(store: Store) -> Index:
    """The checkpoint's index file as it is: a segmented root without its rows, or a whole
    index; foreign checkpoints are sniffed by the registered backends."""
    try:
        data = await store.get(INDEX_FILE)
    except FileNotFoundError:
        data = None
    if data is not None:
        return Index.loads(bytes(data), store.full_path(INDEX_FILE))
    for name, version in available_backends():
        try:
            cls = get_backend(name, version)
        except ImportError as e:  # a broken plugin must not hide the others
            (log.debug if isinstance(e, ConfigError) else log.warning)(  # debug: an extra not installed
                "ckptfs: backend %s-%s cannot be imported: %s", name, version, e)
            continue
        found = await cls.sniff(store)
        if found is not None:
            # the same rules as for an index file: paths inside the root, bounds, keys
            return Index.from_dict(found.to_dict(), f"{store.url} (read as {name}-{version})")
    raise CheckpointNotFoundError(
        f"{store.full_path(INDEX_FILE)}: no committed ckptfs checkpoint here (no index: nothing "
        f"was saved, or a save did not finish and committed nothing; `ckptfs verify {store.url}` "
        f"tells which), and no registered backend recognises the files as a foreign checkpoint"
    )
