"""Index segments (formats/README.md §2.6): the root, the blocks, partial and whole reads, the
checks a reader makes, the tools, and the golden segmented checkpoint."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import ckptfs
from ckptfs.engine.index_io import read_index, read_root, read_rows
from ckptfs.io import run_sync
from ckptfs.io.open import open_store
from ckptfs.layout import index as index_mod
from ckptfs.layout.boxes import Box
from ckptfs.layout.index import INDEX_FILE, ChunkEntry, Index, TensorEntry
from ckptfs.layout.segment_rows import split_index
from ckptfs.layout.segments import Block, block_order, partition
from ckptfs.testing.conformance.cases import differences
from ckptfs.testing.conformance.golden import golden_reference, manifest_problems
from ckptfs.testing.conformance.golden_index import golden_index_dir

ROWS, COLS = 8, 8  # the synthetic tensor's chunk grid


def _grid_index() -> Index:
    """A tensor of 8 x 8 chunks (32 x 8 elements each) in one data file, and a small one."""
    chunks, off = [], 0
    for i in range(ROWS):
        for j in range(COLS):
            chunks.append(ChunkEntry((32 * i, 8 * j), (32, 8), "data/abc/r0.bin", off, 32 * 8 * 4,
                                     f"crc32c:{i:04x}{j:04x}"))
            off += 32 * 8 * 4
    w = TensorEntry("w", "float32", (32 * ROWS, 8 * COLS), tuple(chunks))
    b = TensorEntry("b", "int64", (3,), (ChunkEntry((0,), (3,), "data/abc/r0.bin", off, 24,
                                                    "crc32c:00000001"),))
    return Index("safetensors_chunks", 1, {"w": w, "b": b}, files={"data/abc/r0.bin": off + 24},
                 order=("w", "b"), file_checksums={"data/abc/r0.bin": "crc32c:00000000"})


def _write(root: Path, index: Index, **split) -> Index:
    seg_root, files = split_index(index, "abc", **split)
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    (root / INDEX_FILE).write_bytes(seg_root.dumps())
    return seg_root


def _read(root: Path, fn, *args):
    async def go():
        store = await open_store(str(root), None, None)
        try:
            result = await fn(store, *args)
            return result, store.stats.bytes_read, store.stats.read_requests
        finally:
            await store.close()
    return run_sync(go())


@pytest.mark.parametrize("file_ids, minor", [(True, 4), (False, 3)])
def test_a_segmented_root_round_trips_and_reads_whole(tmp_path, file_ids, minor):
    index = _grid_index()
    root = _write(tmp_path, index, rows=1, world=2, rows_per_block=8, file_ids=file_ids)
    assert len(root.segments) == 2 and root.segmented and root.minor_version_used == minor
    raw = json.loads((tmp_path / INDEX_FILE).read_text())
    assert raw["required_features"] == ["packed_chunks", "index_segments"] + (
        ["segment_file_ids"] if file_ids else [])
    assert raw["format_minor_version"] == minor and "chunks" not in raw["tensors"]["w"]
    # a packed row names its file by its position in the root's file table (1.4) or by path
    first = json.loads((tmp_path / root.segments[0]).read_bytes().split(b"\n")[0])[0]
    assert first[2] == (0 if file_ids else "data/abc/r0.bin")
    assert raw["file_table"]["prefix"] + raw["file_table"]["files"][0][0] == "data/abc/r0.bin"
    assert len(raw["tensors"]["w"]["blocks"]) == 8
    back = Index.loads((tmp_path / INDEX_FILE).read_bytes())
    assert back.segments == root.segments and back.tensors["w"].blocks == root.tensors["w"].blocks
    assert back.tensors["w"].chunks == ()
    whole, _, _ = _read(tmp_path, read_index)
    for k in index.tensors:
        assert whole.tensors[k].chunks == index.tensors[k].chunks


def test_a_partial_read_reads_only_the_blocks_that_overlap(tmp_path):
    _write(tmp_path, _grid_index(), rows_per_block=8)
    root, _, _ = _read(tmp_path, read_root)
    blocks = root.tensors["w"].blocks
    # equal distinct offsets per dimension: rows first, so a block is a row strip of 8 chunks
    assert [b.lo for b in blocks] == [(32 * i, 0) for i in range(ROWS)]
    got, read, requests = _read(tmp_path, read_rows, root, {"w": [Box((40, 0), (10, 64))]})
    assert read == blocks[1].byte_length and requests == 1
    assert [c.offsets for c in got.tensors["w"].chunks] == [(32, 8 * j) for j in range(COLS)]
    assert got.tensors["b"].chunks == ()  # not asked for: not read
    # two neighbouring strips come in one ranged request
    got, read, requests = _read(tmp_path, read_rows, root, {"w": [Box((0, 0), (64, 1))]})
    assert requests == 1 and read == blocks[0].byte_length + 1 + blocks[1].byte_length
    assert len(got.tensors["w"].chunks) == 16


def test_the_block_order_takes_the_dimension_with_fewest_offsets_first():
    # a row-parallel weight cut into 8 column strips, each strip sliced into 32 row pieces
    chunks = [ChunkEntry((32 * i, 8 * j), (32, 8)) for i in range(32) for j in range(8)]
    ordered = block_order(chunks)
    assert [c.offsets for c in ordered[:32]] == [(32 * i, 0) for i in range(32)]
    owners = partition([5, 5, 5, 5], world=4, rows=10)
    assert [(o.start, o.stop, o.rank) for o in owners] == [(0, 2, 0), (2, 4, 2)]
    assert [(o.start, o.stop) for o in partition([30, 1, 1], world=8, rows=10)] == [(0, 1), (1, 3)]


def test_a_reader_without_the_feature_refuses_a_segmented_root(tmp_path, monkeypatch):
    _write(tmp_path, _grid_index(), file_ids=False)
    monkeypatch.setattr(index_mod, "KNOWN_FEATURES",
                        frozenset({index_mod.PACKED_CHUNKS, index_mod.CHUNK_REFS}))
    with pytest.raises(ckptfs.FormatVersionError, match=r"\['index_segments'\] are unknown"):
        ckptfs.load_metadata(tmp_path)


def test_a_reader_of_index_1_3_refuses_a_root_whose_rows_number_the_file_table(tmp_path,
                                                                                monkeypatch):
    _write(tmp_path, _grid_index())
    monkeypatch.setattr(index_mod, "KNOWN_FEATURES", frozenset(
        {index_mod.PACKED_CHUNKS, index_mod.CHUNK_REFS, index_mod.SEGMENTS}))
    with pytest.raises(ckptfs.FormatVersionError, match=r"\['segment_file_ids'\] are unknown"):
        ckptfs.load_metadata(tmp_path)


def _edit_block(root_dir: Path, root: Index, edit) -> None:
    """Rewrite the first block of tensor "w" with ``edit`` (bytes -> bytes of the same length)
    and the root's records of it (the block's CRC-32C, the segment's checksum), sealed again."""
    from ckptfs.layout.checksum import checksum, crc_of

    b = root.tensors["w"].blocks[0]
    seg = root_dir / root.segments[b.segment]
    data = bytearray(seg.read_bytes())
    new = edit(bytes(data[b.byte_offset:b.byte_offset + b.byte_length]))
    assert len(new) == b.byte_length
    data[b.byte_offset:b.byte_offset + b.byte_length] = new
    seg.write_bytes(bytes(data))
    blocks = (dataclasses.replace(b, crc=f"{crc_of(new):08x}"), *root.tensors["w"].blocks[1:])
    w = dataclasses.replace(root.tensors["w"], blocks=blocks)
    sums = {**root.file_checksums, root.segments[b.segment]: checksum(bytes(data))}
    bad = dataclasses.replace(root, tensors={**root.tensors, "w": w}, file_checksums=sums)
    (root_dir / INDEX_FILE).write_bytes(bad.dumps())


@pytest.mark.parametrize("fid, match", [
    (b"9", r"s00000.json, block \[0, \d+\) of tensor 'w', row 0: file id 9 is not in file_table"),
    (b"1", r"s00000.json, block \[0, \d+\) of tensor 'w', row 0: file 'index/abc/s00000.json' "
           r"is not a data file"),
])
def test_a_bad_file_id_in_a_segment_is_refused_naming_the_row(tmp_path, fid, match):
    from tests import spec_reader

    root = _write(tmp_path, _grid_index(), rows=1, world=2, rows_per_block=8)
    _edit_block(tmp_path, root, lambda raw: raw.replace(b"], 0, 0, ", b"], " + fid + b", 0, ", 1))
    with pytest.raises(ckptfs.MalformedIndexError, match=match):
        _read(tmp_path, read_index)
    with pytest.raises(ckptfs.MalformedIndexError, match=match):
        _read(tmp_path, read_rows, Index.loads((tmp_path / INDEX_FILE).read_bytes()),
              {"w": [Box((0, 0), (1, 1))]})
    with pytest.raises(spec_reader.SpecError, match="file id 9|a row's file is a segment"):
        spec_reader.audit_index((tmp_path / INDEX_FILE).read_bytes(),
                                spec_reader.local_reader(tmp_path))


def _reseal(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    doc.pop("index_checksum")
    edit(doc)
    path.write_bytes(index_mod.seal(json.dumps(doc).encode()))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("segments"), "segments"),
    (lambda d: d.update(segments=["index/abc/nope.json"]), "must be listed in the data files"),
    (lambda d: d["tensors"]["b"].update(chunks=[]), "lists 'blocks', not 'chunks'"),
    (lambda d: d["tensors"]["b"]["blocks"][0].__setitem__(0, 5), "segment 5 is not an int"),
    (lambda d: d["tensors"]["b"]["blocks"][0].__setitem__(4, [4]), "lo .* lies beyond hi"),
    (lambda d: d["required_features"].remove("index_segments"), "without the required feature"),
    (lambda d: d["tensors"]["b"]["blocks"][0].__setitem__(3, "0000zzzz"),
     r"tensors\['b'\].blocks\[0\]: crc '0000zzzz' is not 8 lowercase hex digits"),
    (lambda d: d["tensors"]["w"]["blocks"][0].__setitem__(5, [256, 64.0]),
     r"tensors\['w'\].blocks\[0\]: hi must be 2 ints"),
])
def test_a_malformed_root_is_refused_naming_the_field(tmp_path, edit, match):
    _write(tmp_path, _grid_index())
    _reseal(tmp_path / INDEX_FILE, edit)
    with pytest.raises(ckptfs.MalformedIndexError, match=match):
        ckptfs.load_metadata(tmp_path)


def test_a_corrupt_or_missing_segment_is_an_error_naming_it(tmp_path):
    root = _write(tmp_path, _grid_index(), rows=1, world=2, rows_per_block=8)
    seg = tmp_path / root.segments[0]
    data = bytearray(seg.read_bytes())
    data[5] ^= 0x01  # inside the first block of "w"
    seg.write_bytes(bytes(data))
    with pytest.raises(ckptfs.IntegrityError, match=r"s00000.json.*damaged"):
        _read(tmp_path, read_index)
    with pytest.raises(ckptfs.IntegrityError, match=r"s00000.json, block \[0, .*tensor 'w'"):
        _read(tmp_path, read_rows, root, {"w": [Box((0, 0), (1, 1))]})
    # a block the rank does not need is not read, so not checked: the load of "b" goes on
    got, _, _ = _read(tmp_path, read_rows, root, {"b": [Box((0,), (3,))]})
    assert len(got.tensors["b"].chunks) == 1
    report = ckptfs.verify(tmp_path, checksums=False)
    assert {(p.kind, p.file, p.key) for p in report.problems} >= {
        ("segment", root.segments[0], "w")}
    seg.unlink()
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="index segment .* is missing"):
        _read(tmp_path, read_index)
    report = ckptfs.verify(tmp_path, checksums=False)
    assert ("missing-file", root.segments[0]) in {(p.kind, p.file) for p in report.problems}


def _rewrite_rows(edit):
    """A block edit for ``_edit_block``: its rows parsed, changed by ``edit`` and written back
    compactly, padded with JSON space to the block's length."""
    def go(raw: bytes) -> bytes:
        rows = json.loads(raw)
        edit(rows)
        new = json.dumps(rows, separators=(",", ":")).encode()
        assert len(new) <= len(raw)
        return new + b" " * (len(raw) - len(new))
    return go


@pytest.mark.parametrize("edit, match", [
    (lambda rows: rows[2].__setitem__(3, 65559), r"row 2: bytes \[65559, 66583\) lie beyond the "
                                                 r"end of data/abc/r0.bin"),
    (lambda rows: rows[1][0].__setitem__(1, -8), r"row 1: offsets must be a list of ints"),
    (lambda rows: rows[3].__setitem__(5, 7), r"row 3: checksum must be a string"),
])
def test_a_bad_row_among_good_ones_is_refused_naming_it(tmp_path, edit, match):
    root = _write(tmp_path, _grid_index(), rows_per_block=8)
    _edit_block(tmp_path, root, _rewrite_rows(edit))
    with pytest.raises(ckptfs.MalformedIndexError, match=match):
        _read(tmp_path, read_rows, Index.loads((tmp_path / INDEX_FILE).read_bytes()),
              {"w": [Box((0, 0), (1, 1))]})


def test_rows_checked_by_column_equal_the_rows_checked_one_by_one(tmp_path):
    """A block of plain packed rows is decoded column by column; one whose rows need the
    row-by-row path (a null checksum) gives the same entries but that one."""
    index = _grid_index()
    root = _write(tmp_path, index, rows_per_block=8)
    whole, _, _ = _read(tmp_path, read_index)
    assert whole.tensors["w"].chunks == index.tensors["w"].chunks
    _edit_block(tmp_path, root, _rewrite_rows(lambda rows: rows[0].__setitem__(5, None)))
    again, _, _ = _read(tmp_path, read_index)
    got, want = again.tensors["w"].chunks, index.tensors["w"].chunks
    assert [c for c in got if c.checksum is None] == [dataclasses.replace(want[0], checksum=None)]
    assert [c for c in got if c.checksum is not None] == list(want[1:])


def test_a_partial_read_reads_through_small_gaps_only(tmp_path, monkeypatch):
    """Blocks of one segment closer than ``GAP_BYTES`` are read with one request; farther
    ones (the other ranks' blocks between) each with their own, the bytes between not read."""
    from ckptfs.engine import index_io

    monkeypatch.setattr(index_io, "GAP_BYTES", 100)
    root = _write(tmp_path, _grid_index(), rows_per_block=8)
    blocks = root.tensors["w"].blocks  # row strips of 32 rows, about 380 bytes each

    def strips(*rows: int) -> dict:
        return {"w": [Box((32 * i, 0), (32, 64)) for i in rows]}

    got, nbytes, requests = _read(tmp_path, read_rows, root, strips(0, 7))
    assert len(got.tensors["w"].chunks) == 2 * COLS and requests == 2
    assert nbytes == blocks[0].byte_length + blocks[7].byte_length
    _, nbytes, requests = _read(tmp_path, read_rows, root, strips(0, 1))
    assert requests == 1 and nbytes == blocks[1].byte_offset + blocks[1].byte_length


def test_a_row_outside_its_blocks_box_is_refused(tmp_path):
    index = _grid_index()
    root = _write(tmp_path, index, rows_per_block=8)
    b0 = root.tensors["w"].blocks[0]
    narrowed = dataclasses.replace(b0, hi=(16, b0.hi[1]))  # the strip holds rows up to 32
    w = dataclasses.replace(root.tensors["w"], blocks=(narrowed, *root.tensors["w"].blocks[1:]))
    bad = dataclasses.replace(root, tensors={**root.tensors, "w": w})
    (tmp_path / INDEX_FILE).write_bytes(bad.dumps())
    with pytest.raises(ckptfs.MalformedIndexError, match="outside the block's box"):
        _read(tmp_path, read_index)


@pytest.mark.parametrize("minor", [3, 4])
def test_golden_segmented_indexes_load_and_verify(minor):
    g = golden_index_dir(minor)
    assert manifest_problems(g) == []
    assert differences(ckptfs.load_keys(g / "checkpoint"), golden_reference()) == []
    index = ckptfs.load_metadata(g / "checkpoint")
    assert index.segmented and len(index.segments) == 2 and index.format_minor_version == minor
    assert ("segment_file_ids" in index.required_features) == (minor == 4)
    assert all(t.chunks for t in index.tensors.values() if t.numel)
    report = ckptfs.verify(g / "checkpoint")
    assert report.ok, report.problems
    # a resharded partial read of one tensor reads only its blocks and gets its rows
    got, _, _ = _read(g / "checkpoint", read_rows, Index.loads(
        (g / "checkpoint" / INDEX_FILE).read_bytes()), {"sharded/rows": [Box((0, 0), (3, 4))]})
    assert [c.file for c in got.tensors["sharded/rows"].chunks] == \
        [c.file for c in index.tensors["sharded/rows"].chunks]


def test_golden_index_1_4_numbers_the_file_table_in_its_rows():
    root = golden_index_dir(4) / "checkpoint"
    raw = json.loads((root / INDEX_FILE).read_text())
    table = [raw["file_table"]["prefix"] + n for n, _ in raw["file_table"]["files"]]
    ids = {row[2] for p in raw["segments"] for line in (root / p).read_bytes().splitlines()
           for row in json.loads(line)}
    assert ids and all(isinstance(i, int) and table[i].startswith("data/") for i in ids)
    # the same rows as index 1.3's golden, but for the file's spelling
    old = golden_index_dir(3) / "checkpoint"
    assert sum(len(p.read_bytes()) for p in (root / "index").rglob("*.json")) < \
        0.7 * sum(len(p.read_bytes()) for p in (old / "index").rglob("*.json"))


@pytest.mark.parametrize("minor", [3, 4])
def test_golden_segmented_indexes_read_with_the_spec_reader(minor):
    from tests import spec_reader

    root = golden_index_dir(minor) / "checkpoint"

    alone = spec_reader.audit_index((root / INDEX_FILE).read_bytes())  # the root by itself
    assert all("chunks" not in t for t in alone.norm["tensors"].values())
    idx = spec_reader.audit_index((root / INDEX_FILE).read_bytes(), spec_reader.local_reader(root))
    data = spec_reader.audit_data(str(root), idx)
    rows = golden_reference()["sharded"]["rows"]
    assert data["sharded/rows"] == rows.numpy().tobytes()


def test_clean_keeps_the_segments_and_removes_a_leftover_one(tmp_path):
    root = _write(tmp_path, _grid_index(), rows=1, world=2)
    (tmp_path / "data/abc").mkdir(parents=True)
    (tmp_path / "data/abc/r0.bin").write_bytes(b"\0" * root.files["data/abc/r0.bin"])
    stray = tmp_path / "index/dead00000000/s00000.json"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"[]\n")
    ckptfs.clean(tmp_path, dry_run=False)
    assert not stray.exists()
    assert all((tmp_path / p).exists() for p in root.segments)


def test_a_block_overlaps_the_boxes_that_meet_its_bounding_box():
    b = Block(0, 0, 10, "00000000", (0, 8), (32, 16))
    assert b.overlaps(Box((31, 15), (5, 5))) and not b.overlaps(Box((32, 0), (1, 100)))
    assert not b.overlaps(Box((0, 8), (0, 8)))  # an empty box overlaps nothing
    assert Block(0, 0, 1, "00000000", (), ()).overlaps(Box((), ()))  # 0-d


def test_inspect_shows_the_segments():
    from ckptfs.tools.describe import describe, render

    g = golden_index_dir(3) / "checkpoint"
    doc = describe(str(g), ckptfs.load_metadata(g), False)
    assert sorted(doc["segments"]) == sorted(ckptfs.load_metadata(g).segments)
    assert "segmented: 2 segment files" in render(doc)
    assert doc["totals"]["chunks"] == 26


def test_a_read_roots_blocks_behave_as_the_tuple_of_its_blocks(tmp_path):
    """A root read from its bytes makes its blocks when first used: they compare, slice, count
    and pickle as the tuple the writer made."""
    import pickle

    root = _write(tmp_path, _grid_index(), rows_per_block=8)
    back = Index.loads((tmp_path / INDEX_FILE).read_bytes())
    want = root.tensors["w"].blocks
    got = back.tensors["w"].blocks
    assert len(got) == len(want) == ROWS and got == want and want == got
    assert got[1:] == want[1:] and list(got) == list(want) and hash(got) == hash(tuple(want))
    again = pickle.loads(pickle.dumps(back))
    assert again.tensors["w"].blocks == want and again == back
