"""Hostile input: an index, a DCP ``.metadata``, a Megatron ``metadata.json``/zarr ``.zarray``,
a safetensors header or a ``torch.save`` zip crafted to escape the checkpoint root, allocate
without bound or crash the parser is refused with a ``CkptfsError`` naming the file and field,
before any read outside the root and before any large allocation. The index parser and the
safetensors and zip header parsers are fuzzed (hypothesis); cases it found are kept below."""

from __future__ import annotations

import asyncio
import io
import json
import pickle
import re
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfs
from ckptfs.errors import CkptfsError, MalformedIndexError
from ckptfs.layout.backends.torch_dist_zip import (
    ZipFormatError,
    locate_tensor,
    read_value_blob,
    run_on_bytes,
)
from ckptfs.layout.index import INDEX_FILE, Index

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"


def _saved(root: Path) -> dict:
    """A small checkpoint at ``root`` whose tensor "w" (8 x 8 float32) is described as two chunks
    of 4 rows (a valid index: the loads below pass before the edits); returns the index dict."""
    w = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    ckptfs.save({"w": w, "step": 3}, root)
    d = _unsealed(json.loads((root / INDEX_FILE).read_bytes()))
    (c,) = d["tensors"]["w"]["chunks"]
    d["tensors"]["w"]["chunks"] = [
        {"offsets": [0, 0], "shape": [4, 8], "file": c["file"], "byte_offset": c["byte_offset"],
         "byte_length": 128},
        {"offsets": [4, 0], "shape": [4, 8], "file": c["file"],
         "byte_offset": c["byte_offset"] + 128, "byte_length": 128}]
    _write_index(root, d)
    assert torch.equal(ckptfs.load_keys(root)["w"], w)
    return d


def _write_index(root: Path, doc: dict | bytes) -> None:
    """Replace the index (unsealed: the hostile content must reach the parser)."""
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    (root / INDEX_FILE).write_bytes(data)


def _unsealed(d: dict) -> dict:
    d = dict(d)
    d.pop("index_checksum", None)
    return d


def _chunk(d: dict, i: int = 0) -> dict:
    return d["tensors"]["w"]["chunks"][i]


def _edit(fn):
    def apply(d: dict) -> dict:
        d = _unsealed(d)
        fn(d)
        return d
    return apply


def _set_file(path: str):
    def f(d):
        old = _chunk(d)["file"]
        _chunk(d)["file"] = path
        d["files"][path] = d["files"].pop(old)
        d.get("file_checksums", {}).pop(old, None)
    return f


#: (id, edit of the index dict, error class, fragment of the message)
INDEX_CASES = [
    ("dotdot-path", _edit(_set_file("../outside.bin")), MalformedIndexError, "outside.bin"),
    ("absolute-path", _edit(_set_file("/etc/passwd")), MalformedIndexError, "/etc/passwd"),
    ("url-path", _edit(_set_file("s3://bucket/x.bin")), MalformedIndexError, "s3://bucket"),
    ("http-url-path", _edit(_set_file("http://evil.example/x")), MalformedIndexError, "http://"),
    ("backslash-path", _edit(_set_file("..\\x.bin")), MalformedIndexError, "x.bin"),
    ("files-dotdot", _edit(lambda d: d["files"].update({"../y": 4})), MalformedIndexError, "../y"),
    ("absurd-shape", _edit(lambda d: d["tensors"]["w"].update(shape=[2**40, 2**40])),
     MalformedIndexError, "2**62"),
    ("absurd-dim", _edit(lambda d: d["tensors"]["w"].update(shape=[8, 2**70])),
     MalformedIndexError, "shape"),
    ("absurd-byte-length", _edit(lambda d: _chunk(d).update(byte_length=2**70)),
     MalformedIndexError, "byte_length"),
    ("range-beyond-file", _edit(lambda d: _chunk(d).update(byte_offset=2**40)),
     MalformedIndexError, "beyond"),
    ("absurd-file-size", _edit(lambda d: d["files"].update({_chunk(d)["file"]: 2**80})),
     MalformedIndexError, "files"),
    ("chunk-outside-tensor", _edit(lambda d: _chunk(d, 1).update(offsets=[6, 0])),
     MalformedIndexError, "outside"),
    ("overlapping-chunks", _edit(lambda d: _chunk(d, 1).update(offsets=[0, 0])),
     ckptfs.ShardingError, "overlap"),
    ("wrong-dtype", _edit(lambda d: d["tensors"]["w"].update(dtype="float33")),
     MalformedIndexError, "float33"),
    ("shape-as-strings", _edit(lambda d: d["tensors"]["w"].update(shape=["8", "8"])),
     MalformedIndexError, "shape"),
    ("offset-as-string", _edit(lambda d: _chunk(d).update(byte_offset="0")),
     MalformedIndexError, "byte_offset"),
    ("version-as-string", _edit(lambda d: d.update(format_version="1")),
     MalformedIndexError, "format_version"),
    ("bool-as-int", _edit(lambda d: _chunk(d).update(byte_length=True)),
     MalformedIndexError, "byte_length"),
    ("negative-size", _edit(lambda d: _chunk(d).update(byte_length=-4)),
     MalformedIndexError, "byte_length"),
]


@pytest.mark.parametrize("case", INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_hostile_index_is_refused_before_reading(tmp_path, case):
    _, edit, error, fragment = case
    root = tmp_path / "ck"
    good = _saved(root)
    # a file outside the root holding exactly the chunk's bytes: a reader that followed the
    # path would load the right data and pass; only refusing the path makes the test pass
    first = root / _chunk(good)["file"]
    (tmp_path / "outside.bin").write_bytes(first.read_bytes())
    _write_index(root, edit(good))
    for load in (lambda: ckptfs.load_keys(root),
                 lambda: ckptfs.load({"w": torch.empty(8, 8), "step": 0}, root)):
        with pytest.raises(error, match=fragment.replace("*", r"\*").replace("(", r"\(")) as e:
            load()
        assert str(root) in str(e.value) or "'w'" in str(e.value)


@pytest.mark.parametrize("doc", [
    b"[" * 200_000 + b"]" * 200_000,  # deeper than any parser's stack
    b'{"format": "ckptfs", "x": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
    b'{"format": "ckptfs\xff\xfe"}',  # not UTF-8
    b"\xef\xbb\xbf{}",  # a BOM
    b'{"format": "ckptfs", "format": "ckptfs"}',
    b'{"format": "ckptfs", "format_version": 1e400}',
    b'{"format": "ckptfs", "format_version": ' + b"9" * 5000 + b"}",  # int beyond str limit
], ids=["deep-list", "deep-object", "non-utf8", "bom", "duplicate", "huge-float", "huge-int"])
def test_hostile_index_documents_are_malformed(tmp_path, doc):
    root = tmp_path / "ck"
    _saved(root)
    _write_index(root, doc)
    with pytest.raises((MalformedIndexError, ckptfs.FormatVersionError), match=INDEX_FILE):
        ckptfs.load_keys(root)


def test_index_above_the_size_bound_is_refused_before_parsing(tmp_path, monkeypatch):
    root = tmp_path / "ck"
    d = _unsealed(_saved(root))
    d["writer"]["padding"] = "x" * 4096
    _write_index(root, d)
    monkeypatch.setenv("CKPTFS_MAX_INDEX_BYTES", "4000")
    with pytest.raises(MalformedIndexError, match="CKPTFS_MAX_INDEX_BYTES"):
        ckptfs.load_keys(root)
    monkeypatch.setenv("CKPTFS_MAX_INDEX_BYTES", "100000")
    assert ckptfs.load_keys(root)["step"] == 3


def _packed(root: Path) -> dict:
    """``_saved``'s checkpoint with a packed index (formats/README.md §2.3): "w" as 64 chunks of
    one element (enough for the planner's bisection over many chunks), rows naming their file
    through ``file_table``. A valid index: the loads pass before the edits."""
    d = _unsealed(_saved(root))
    c = _chunk(d)
    path, base = c["file"], c["byte_offset"]
    d["required_features"] = ["packed_chunks"]
    d["file_table"] = {"prefix": "", "files": [[path, d["files"].pop(path)]]}
    assert not d.pop("files")
    d["tensors"]["w"]["chunks"] = [[[i, j], [1, 1], 0, base + 4 * (8 * i + j), 4, None]
                                   for i in range(8) for j in range(8)]
    _write_index(root, d)
    assert torch.equal(ckptfs.load_keys(root)["w"], torch.arange(64.0).reshape(8, 8))
    return d


def _row(i: int, **set_items):
    names = ("offsets", "shape", "file", "byte_offset", "byte_length")

    def f(d):
        row = d["tensors"]["w"]["chunks"][i]
        for name, v in set_items.items():
            row[names.index(name)] = v
    return f


PACKED_CASES = [
    ("prefix-dotdot", lambda d: d["file_table"].update(prefix="../"), MalformedIndexError, "../"),
    ("beyond-dim-0", _row(63, offsets=[8, 0]), MalformedIndexError, "outside"),
    ("beyond-dim-1", _row(5, offsets=[0, 8]), MalformedIndexError, "outside"),
    ("wrong-rank", _row(40, offsets=[], shape=[]), MalformedIndexError, "outside"),
    ("overlap", _row(1, offsets=[0, 0]), ckptfs.ShardingError, "overlap"),
    ("range-beyond-file", _row(2, byte_offset=2**40), MalformedIndexError, "beyond"),
    ("absurd-offset", _row(3, offsets=[2**70, 0]), MalformedIndexError, "offsets"),
    ("files-too", lambda d: d.update(files={}), MalformedIndexError, "file_table"),
    # what the one-expression fast path of the parser must leave to the checked path
    ("bool-offset", _row(4, offsets=[True, 0]), MalformedIndexError, "chunks[4]: offsets"),
    ("file-id", _row(6, file=7), MalformedIndexError, "chunks[6]: file id 7"),
    ("short-row", lambda d: d["tensors"]["w"]["chunks"].__setitem__(9, [[1, 1], [1, 1], 0]),
     MalformedIndexError, "chunks[9]: a packed chunk"),
    ("checksum-int", lambda d: d["tensors"]["w"]["chunks"][10].__setitem__(5, 5),
     MalformedIndexError, "chunks[10]: checksum must be a string"),
    ("extra-null", lambda d: d["tensors"]["w"].update(extra=None), MalformedIndexError, "'extra'"),
    ("dtype-unknown", lambda d: d["tensors"]["w"].update(dtype="float7"), MalformedIndexError,
     "float7"),
]


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_hostile_packed_rows_are_refused_before_reading(tmp_path, case):
    """The checks of the object form hold for packed rows: paths through the file table, bounds,
    byte ranges, chunks outside the tensor (also one the rank's region does not meet) and
    overlaps."""
    _, edit, error, fragment = case
    root = tmp_path / "ck"
    d = _packed(root)
    edit(d)
    _write_index(root, d)
    for load in (lambda: ckptfs.load_keys(root),
                 lambda: ckptfs.load({"w": torch.empty(8, 8), "step": 0}, root)):
        with pytest.raises(error, match=re.escape(fragment)):
            load()


def test_tensors_larger_than_memory_are_refused_before_allocation(tmp_path):
    """An index that is well formed but asks load_keys for more memory than the machine has
    (a tensor of 2**31 x 2**20 float32, 8 TiB) is refused before torch allocates."""
    root = tmp_path / "ck"
    d = _unsealed(_saved(root))
    t = d["tensors"]["w"]
    t["shape"] = [2**31, 2**20]
    t["chunks"] = [{"offsets": [0, 0], "shape": [2**31, 2**20]}]
    _write_index(root, d)
    with pytest.raises(MalformedIndexError, match=r"'w'.*memory"):
        ckptfs.load_keys(root)


# -- foreign metadata ------------------------------------------------------------------------------


def _dcp(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "dcp"
    dcp.save({"w": torch.arange(16.0).reshape(4, 4)}, checkpoint_id=str(root), no_dist=True)
    return root


def _rewrite_dcp_metadata(root: Path, edit) -> None:
    # the test's own trusted pickle round trip: the edited metadata is what a hostile writer sends
    md = pickle.loads((root / ".metadata").read_bytes())
    edit(md)
    (root / ".metadata").write_bytes(pickle.dumps(md))


def test_hostile_dcp_metadata_paths_and_sizes(tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    root = _dcp(tmp_path)
    (tmp_path / "escape").write_bytes((root / "__0_0.distcp").read_bytes())

    def escape(md):
        for k, v in md.storage_data.items():
            md.storage_data[k] = _StorageInfo("../escape", v.offset, v.length)

    _rewrite_dcp_metadata(root, escape)
    with pytest.raises(MalformedIndexError, match=r"\.\./escape"):
        ckptfs.load_keys(root)

    root2 = _dcp(tmp_path / "b")

    def huge(md):
        md.state_dict_metadata["w"].size = torch.Size([2**31, 2**31])

    _rewrite_dcp_metadata(root2, huge)
    with pytest.raises(CkptfsError, match="'w'"):
        ckptfs.load_keys(root2)


def test_hostile_megatron_zarr_shapes(tmp_path):
    src = FIXTURES / "mcore-0.15.3-zarr"
    root = tmp_path / "mz"
    shutil.copytree(src / "checkpoint", root)
    zarray = next(root.rglob(".zarray"))
    doc = json.loads(zarray.read_text())
    doc["shape"] = [2**40] * len(doc["shape"])
    doc["chunks"] = [1] * len(doc["chunks"])
    zarray.write_text(json.dumps(doc))
    with pytest.raises(MalformedIndexError, match=r"\.zarray"):
        ckptfs.load_metadata(root)
    doc["shape"], doc["chunks"] = ["4"], [1]
    zarray.write_text(json.dumps(doc))
    with pytest.raises(MalformedIndexError, match=r"\.zarray"):
        ckptfs.load_metadata(root)


def test_hostile_megatron_metadata_json(tmp_path):
    root = tmp_path / "mt"
    shutil.copytree(FIXTURES / "mcore-0.19.2-torch_dist" / "checkpoint", root)
    for bad in (b"\xff\xfe", b"[" * 100_000, b'{"sharded_backend": "torch_dist", "x": NaN}'):
        (root / "metadata.json").write_bytes(bad)
        with pytest.raises(MalformedIndexError, match="metadata.json"):
            ckptfs.load_metadata(root)
    (root / "metadata.json").write_bytes(b'{"sharded_backend": ["torch_dist"]}')
    with pytest.raises(ckptfs.CheckpointNotFoundError):  # no reader claims it
        ckptfs.load_metadata(root)


# -- safetensors headers ---------------------------------------------------------------------------


def _st_file(root: Path, header: bytes | dict, data: bytes = b"\0" * 64,
             length: int | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if length is None else length
    (root / "model.safetensors").write_bytes(struct.pack("<Q", n) + raw + data)
    return root


HEADERS = [
    ("beyond-file", {"w": {"dtype": "F32", "shape": [2**20], "data_offsets": [0, 2**22]}}),
    ("absurd-shape", {"w": {"dtype": "F32", "shape": [2**40, 2**40],
                            "data_offsets": [0, 2**82]}}),
    ("wrong-dtype", {"w": {"dtype": "F33", "shape": [4], "data_offsets": [0, 16]}}),
    ("shape-strings", {"w": {"dtype": "F32", "shape": ["4"], "data_offsets": [0, 16]}}),
    ("deep", b"[" * 100_000 + b"]" * 100_000),
    ("non-utf8", b'{"w\xff": 1}'),
    ("header-longer-than-file", b"{}"),
    ("overlap", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                 "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}),
    ("bool-shape", {"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}),
]


@pytest.mark.parametrize("case", HEADERS, ids=[c[0] for c in HEADERS])
def test_hostile_safetensors_headers(tmp_path, case):
    name, header = case
    root = _st_file(tmp_path / "hf", header, length=2**26 if name == "header-longer-than-file" else None)
    with pytest.raises(CkptfsError, match="model.safetensors"):
        ckptfs.load_keys(root)


class _Bytes:
    """A ByteReader over one in-memory file (what the sniffers read through)."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    async def get_range(self, path: str, start: int, end: int) -> bytes:
        return self.files[path][start:end]

    async def get(self, path: str) -> bytes:
        return self.files[path]

    async def exists(self, path: str) -> bool:
        return path in self.files

    async def size(self, path: str) -> int:
        return len(self.files[path])

    async def list(self, prefix: str = "") -> list[str]:
        return [p for p in self.files if p.startswith(prefix)]


def _sniff_hf(blob: bytes) -> None:
    """Sniff an HF checkpoint of one file, then apply the index rules (as read_index does)."""
    cls = ckptfs.get_backend("hf_safetensors", 1)
    found = asyncio.run(cls.sniff(_Bytes({"model.safetensors": blob})))
    if found is not None:
        Index.from_dict(found.to_dict(), "model.safetensors")


_GOOD_HEADER = json.dumps({
    "__metadata__": {"format": "pt"},
    "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]}}).encode()
_GOOD_ST = struct.pack("<Q", len(_GOOD_HEADER)) + _GOOD_HEADER + bytes(range(32))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_GOOD_ST) - 1), st.integers(0, 255)), max_size=6),
       st.integers(0, len(_GOOD_ST)))
def test_fuzz_safetensors_header_parser(flips, cut):
    """Any damage to a safetensors file (changed bytes, truncation) is sniffed into a valid index
    or refused with a CkptfsError; never another exception."""
    blob = bytearray(_GOOD_ST)
    for pos, b in flips:
        blob[pos] = b
    try:
        _sniff_hf(bytes(blob[:cut] if cut < 8 + len(_GOOD_HEADER) else blob))
    except CkptfsError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                        max_size=4),
                    max_leaves=20))
def test_fuzz_safetensors_header_documents(doc):
    """Any JSON document as a safetensors header, also as one tensor's entry."""
    for header in (doc, {"w": doc}):
        raw = json.dumps(header).encode()
        try:
            _sniff_hf(struct.pack("<Q", len(raw)) + raw + b"\0" * 64)
        except CkptfsError:
            pass


# -- the index parser ----------------------------------------------------------------------------

_INDEX_DOC: dict = {}


def _index_bytes() -> bytes:
    if not _INDEX_DOC:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _INDEX_DOC.update(_unsealed(_saved(Path(d) / "ck")))
    return json.dumps(_INDEX_DOC).encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=8),
       st.floats(0, 1))
def test_fuzz_index_parser_bytes(flips, cut):
    """Changed bytes and truncations of a real index: parsed, or refused with a CkptfsError."""
    blob = bytearray(_index_bytes())
    for where, b in flips:
        blob[int(where * len(blob))] = b
    blob = blob[: max(1, int(cut * len(blob)))] if cut < 1 else blob
    try:
        Index.loads(bytes(blob), check=False)
    except CkptfsError:
        pass


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=6),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                         max_size=3),
                     max_leaves=12)
_FIELDS = ["format_version", "backend", "tensors", "values", "containers", "files", "order",
           "backend_files", "file_checksums", "required_features"]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([*_FIELDS, "tensor", "chunk"]), st.text(min_size=1, max_size=12), _JSON)
def test_fuzz_index_parser_fields(where, name, value):
    """Any JSON value in any field of a real index (or of a tensor or chunk entry)."""
    d = json.loads(_index_bytes())
    if where == "tensor":
        d["tensors"]["w"][name if name in ("dtype", "shape", "chunks", "extra") else "shape"] = value
    elif where == "chunk":
        keys = ("offsets", "shape", "file", "byte_offset", "byte_length", "checksum")
        d["tensors"]["w"]["chunks"][0][name if name in keys else "file"] = value
    else:
        d[where] = value
    try:
        Index.loads(json.dumps(d).encode(), check=False)
    except CkptfsError:
        pass


# -- the zip header parser -------------------------------------------------------------------------


def _blob() -> bytes:
    buf = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.float32), buf)
    return buf.getvalue()


_ZIP = _blob()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(_ZIP) - 1), st.integers(0, 255)), max_size=6),
       st.integers(1, len(_ZIP)), st.booleans())
def test_fuzz_zip_header_parser(flips, cut, tail):
    """Changed bytes and truncations of a torch.save blob: located, or a ZipFormatError."""
    blob = bytearray(_ZIP)
    # damage near the end (where the central directory lives) half of the time
    for pos, b in flips:
        blob[len(blob) - 1 - pos % 200 if tail else pos] = b
    blob = blob[:cut] if cut < len(blob) and not tail else blob
    try:
        run_on_bytes(locate_tensor(len(blob)), bytes(blob))
    except (ZipFormatError, CkptfsError):
        pass


def test_zip_bomb_is_refused_before_inflating():
    """A deflated data.pkl that inflates to 64 MiB: refused when its central directory says
    less (inflating stops at the recorded size) and when it says more than MAX_INFLATE."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\0" * (64 << 20))
    blob = bytearray(buf.getvalue())
    assert len(blob) < 1 << 20
    at = blob.rfind(b"PK\x01\x02") + 24  # the central directory's uncompressed size
    for claimed, why in ((1000, "recorded 1000"), (1 << 30, "above")):
        blob[at:at + 4] = struct.pack("<I", min(claimed, 0xFFFFFFFE))
        with pytest.raises(ZipFormatError, match=why):
            run_on_bytes(locate_tensor(len(blob)), bytes(blob))
        with pytest.raises(MalformedIndexError, match="data.pkl"):
            read_value_blob(bytes(blob), "common.pt")


def test_found_cases():
    """Cases the fuzzers above found (each raised a non-ckptfs exception before the fix), kept
    as plain regression tests."""
    # zip: a central directory cut inside its first entry (was struct.error)
    blob = bytearray(_ZIP)
    eocd = blob.rfind(b"PK\x05\x06")
    struct.pack_into("<I", blob, eocd + 12, 20)
    with pytest.raises(ZipFormatError, match="truncated"):
        run_on_bytes(locate_tensor(len(blob)), bytes(blob))
    # index: a tensor entry or a chunk entry that is not an object (was TypeError)
    for edit in (lambda d: d["tensors"].update(w=None),
                 lambda d: d["tensors"]["w"].update(chunks=[None]),
                 lambda d: d["tensors"]["w"].update(chunks=[[1]])):
        d = json.loads(_index_bytes())
        edit(d)
        with pytest.raises(MalformedIndexError, match="must be a JSON object"):
            Index.loads(json.dumps(d).encode(), check=False)
    # safetensors: a bool in the shape (True passed as the int 1)
    raw = json.dumps({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}).encode()
    with pytest.raises(MalformedIndexError, match="shape"):
        _sniff_hf(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
