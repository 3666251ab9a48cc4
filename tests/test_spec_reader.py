"""The independent reader (tests/spec_reader.py) itself: it reads every golden checkpoint to the
contents its expected.json records (decoded here without ckptfs), it notices a planted fault of
each kind it checks. (That the session audit sees saves made in spawned ranks is checked by
tests/test_schema.py::test_sharded_indexes_validate, which spawns ranks anyway.)"""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path

import pytest
import torch

import ckptfs
from tests import spec_audit, spec_reader

REPO = Path(__file__).resolve().parents[1]
GOLDEN = [p for p in sorted((REPO / "ckptfs" / "testing" / "conformance" / "golden").glob("*/checkpoint")) +
          sorted((REPO / "examples" / "npy_plugin" / "golden").glob("*/checkpoint"))
          if (p / "ckptfs.index.json").is_file()]  # read-only pairs' goldens are foreign layouts


def _expected(doc):
    """expected.json's typed encoding (ckptfs/testing/conformance/golden.py), read without ckptfs."""
    if isinstance(doc, list):
        return [_expected(v) for v in doc]
    if isinstance(doc, dict):
        (tag, body), = doc.items()
        if tag == "$tensor":
            return ("tensor", body["dtype"], tuple(body["shape"]), base64.b64decode(body["base64"]))
        if tag == "$dict":
            return {k: _expected(v) for k, v in body}
        if tag == "$tuple":
            return tuple(_expected(v) for v in body)
        return float.fromhex(body)
    return doc


def _same(got, want, where=""):
    if isinstance(got, spec_reader.TensorLeaf):
        assert want[0] == "tensor" and (got.dtype, got.shape) == want[1:3], where
        if got.data is not None:
            assert got.data == want[3], where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), where  # goldens predate `order`
        for k in want:
            _same(got[k], want[k], f"{where}/{k!r}")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{where}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert isinstance(got, float) and math.isnan(got), where
    else:
        assert type(got) is type(want) and got == want, where


@pytest.mark.parametrize("root", GOLDEN, ids=[p.parent.name for p in GOLDEN])
def test_spec_reader_reads_every_golden_checkpoint(root):
    idx = spec_reader.audit_index((root / "ckptfs.index.json").read_bytes(),
                                  spec_reader.local_reader(root))
    data = spec_reader.audit_data(str(root), idx)
    tree = spec_reader.read_tree(idx, data)
    _same(tree, _expected(json.loads((root.parent / "expected.json").read_text())["state"]))
    if idx.doc["backend"]["name"] in ("safetensors_chunks", "torch_dist", "zarr"):
        assert len(data) == len(idx.doc["tensors"])  # read, not skipped


def _saved(tmp_path, **kw) -> Path:
    sd = {"model": {"w": torch.arange(12.0).reshape(4, 3), "b": torch.ones(3, dtype=torch.bfloat16)},
          "step": 3}
    ckptfs.save(sd, tmp_path / "ck", **kw)
    return tmp_path / "ck"


def _audit(root: Path):
    idx = spec_reader.audit_index((root / "ckptfs.index.json").read_bytes(),
                                  spec_reader.local_reader(root))
    return spec_reader.read_tree(idx, spec_reader.audit_data(str(root), idx))


def _edit_index(root: Path, fn) -> None:
    p = root / "ckptfs.index.json"
    d = json.loads(p.read_bytes())
    fn(d)
    d.pop("index_checksum", None)  # edited by hand: no longer sealed
    p.write_text(json.dumps(d, ensure_ascii=False), encoding="utf-8")


@pytest.mark.parametrize("fault, words", [
    ("flip a data byte", "crc32c"),
    ("non-canonical key", "not canonical"),
    ("order misses a key", "permutation"),
    ("chunks overlap", "overlap"),
    ("file not listed", "not listed in files"),
    ("wrong file checksum", "file_checksums"),
    ("index bytes changed", "index_checksum says"),
    ("zarr fill_value spelled 0", "fill_value"),
    ("safetensors header name", "extra.name"),
])
def test_spec_reader_notices_planted_faults(tmp_path, fault, words):
    backend = {"zarr fill_value spelled 0": dict(backend="zarr", backend_version=2)}.get(fault, {})
    root = _saved(tmp_path, **backend)
    _audit(root)  # sound before the fault
    if fault == "flip a data byte":
        idx = json.loads((root / "ckptfs.index.json").read_bytes())
        c = idx["tensors"]["model/w"]["chunks"][0]
        f = root / c["file"]
        data = bytearray(f.read_bytes())
        data[c["byte_offset"]] ^= 1
        f.write_bytes(bytes(data))
    elif fault == "non-canonical key":
        _edit_index(root, lambda d: d["values"].update({"01": 1}) or d["order"].append("01"))
    elif fault == "order misses a key":
        _edit_index(root, lambda d: d["order"].remove("step"))
    elif fault == "chunks overlap":
        def overlap(d):
            chunks = d["tensors"]["model/w"]["chunks"]
            chunks[0]["shape"] = [2, 3]
            chunks.append({**chunks[0], "offsets": [1, 0], "shape": [2, 3]})  # still 12 elements
        _edit_index(root, overlap)
    elif fault == "file not listed":
        _edit_index(root, lambda d: d.update(files={}, file_checksums={}))
    elif fault == "wrong file checksum":
        _edit_index(root, lambda d: d["file_checksums"].update(
            {p: "crc32c:00000000" for p in d["file_checksums"]}))
    elif fault == "index bytes changed":  # same JSON, other bytes: the seal no longer matches
        p = root / "ckptfs.index.json"
        p.write_bytes(p.read_bytes().replace(b'"format_version": 1', b'"format_version":  1', 1))
    elif fault == "zarr fill_value spelled 0":
        p = root / "model" / "w" / ".zarray"
        p.write_text(p.read_text().replace('"fill_value": 0.0', '"fill_value": 0'))
    elif fault == "safetensors header name":
        _edit_index(root, lambda d: d["tensors"]["model/w"]["chunks"][0]["extra"].update(name="x@0,0"))
    with pytest.raises(spec_reader.SpecError, match=words):
        _audit(root)


def test_compare_notices_a_reordered_dict():
    saved = {"a": 1, "b": 2}
    spec_audit._compare(saved, {"a": 1, "b": 2}, "")
    with pytest.raises(spec_reader.SpecError, match="keys"):
        spec_audit._compare(saved, {"b": 2, "a": 1}, "")
    with pytest.raises(spec_reader.SpecError, match="-0.0"):
        spec_audit._compare({"x": -0.0}, {"x": 0.0}, "")
