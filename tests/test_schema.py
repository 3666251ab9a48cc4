"""The index JSON Schema (formats/index.schema.json) against real indexes and malformed ones.

Every index written here (one rich state dict per importable built-in backend, in one process and
on 2 spawned gloo ranks) must validate and round-trip; the example in formats/README.md must
validate and parse; malformed indexes must be rejected by the schema, and by the reader where it
checks the same thing. ``validate_index`` is importable by other tests.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

import ckptfs
from ckptfs.errors import FormatVersionError, MalformedIndexError
from ckptfs.layout.dtypes import BY_NAME
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.testing.conformance.cases import tiling_problems
from ckptfs.testing.ranks import run_ranks
from tests import spec_audit

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((ROOT / "formats" / "index.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def validate_index(index: dict[str, Any] | str | Path) -> dict[str, Any]:
    """Validate an index (a dict, or a checkpoint root / index file path) against the schema."""
    if not isinstance(index, dict):
        p = Path(index)
        index = json.loads((p / INDEX_FILE if p.is_dir() else p).read_text())
    errors = sorted(VALIDATOR.iter_errors(index), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])
    return index


def importable_backends() -> list[tuple[str, int]]:
    """Built-in writable backends (classes inside ckptfs) whose modules import; plugins are not
    ours, and read-only ones (hf_safetensors) have no index of their own to validate."""
    out = []
    for name, version in ckptfs.available_backends():
        try:
            cls = ckptfs.get_backend(name, version)
        except ImportError:
            continue
        if cls.__module__.startswith("ckptfs.") and cls.writable:
            out.append((name, version))
    return out


BACKENDS = importable_backends()
NONFINITE = (math.nan, math.inf, -math.inf)


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name, dt in BY_NAME.items():
        if dt.torch == torch.bool:
            t = torch.randint(0, 2, (5, 3), generator=g).bool()
        elif dt.torch.is_complex:
            t = torch.randn(5, 3, generator=g, dtype=dt.torch)
        elif dt.torch.is_floating_point:
            t = (torch.randn(5, 3, generator=g) * 4).to(dt.torch)
        else:
            t = torch.randint(-100 if dt.torch != torch.uint8 else 0, 100, (5, 3), generator=g).to(dt.torch)
        out[name] = t
    return out


def rich_state(dcp_fqns: bool = False) -> dict[str, Any]:
    """Nested dicts/lists/tuples, int and awkward str keys, non-finite floats, every dtype,
    0-d and empty tensors: everything a v1 index can describe except sharding.

    ``dcp_fqns`` leaves out the str keys "0" and "-1" that share a DCP name ("keys.0") with
    the int keys 0 and -1: DCP joins paths with '.', so torch_dist cannot store both."""
    g = torch.Generator().manual_seed(0)
    keys: dict[str | int, Any] = {
        "a/b": 1, "100%": 2, "%41": 3, "0": "str zero", 0: "int zero", -1: "int neg",
        "-1": "str neg", "dots.in.key": 4.0, "ünï cødé": "x", "": "empty key"}
    if dcp_fqns:
        del keys["0"], keys["-1"]
    return {
        "model": {"layers.0.weight": torch.randn(8, 4, generator=g),
                  "layers.0.bias": torch.randn(8, generator=g).to(torch.bfloat16)},
        "dtypes": every_dtype(),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(8, 4, generator=g)},
                      1: {"step": torch.tensor(7.0), "exp_avg": torch.randn(8, generator=g)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "amsgrad": False,
                              "foreach": None, "params": [0, 1]}],
        },
        "keys": keys,
        "floats": [*NONFINITE, 1e300, -0.0, 5e-324, 0.1],
        "big": 2**70,
        "nested": [[], {}, (), ((1, 2), [3, {"x": None}])],
        "flags": (True, False, None),
    }


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Exact equality: types (int vs str keys, list vs tuple), tensor bits, float bits."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist(), where
    elif isinstance(a, dict):
        assert list(map(repr, sorted(a, key=repr))) == list(map(repr, sorted(b, key=repr))), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k!r}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, float):
        assert (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b)), where
    else:
        assert a == b, where


# -- real indexes -------------------------------------------------------------------------------

def test_schema_is_valid_draft_2020_12():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(SCHEMA["$defs"]["dtype"]["enum"]) == set(BY_NAME)


@pytest.mark.parametrize("backend", BACKENDS, ids=[f"{n}-{v}" for n, v in BACKENDS])
def test_rich_state_index_validates_and_round_trips(tmp_path, backend):
    name, version = backend
    dcp_fqns = name == "torch_dist"
    sd = rich_state(dcp_fqns)
    url = tmp_path / "ck"
    ckptfs.save(sd, url, backend=name, backend_version=version)
    d = validate_index(url)
    assert d["backend"]["name"] == name and d["backend"]["version"] == version
    # the awkward keys are stored in their canonical form, and their values JSON-encoded
    assert d["values"]["keys/a%2Fb"] == 1 and d["values"]["keys/%2541"] == 3
    assert d["values"]["keys/0"] == "int zero" and d["values"]["keys/-1"] == "int neg"
    if not dcp_fqns:
        assert d["values"]["keys/%30"] == "str zero" and d["values"]["keys/%2D1"] == "str neg"
    assert [d["values"][f"floats/{i}"] for i in range(3)] == [{"$float": s} for s in ("nan", "inf", "-inf")]
    assert d["containers"]["flags"] == "tuple" and d["containers"]["nested/0"] == "list"
    assert d["tensors"]["empty"]["chunks"] == []
    assert d["tensors"]["scalar"]["shape"] == [] and len(d["tensors"]["scalar"]["chunks"]) == 1
    assert {d["tensors"][f"dtypes/{n}"]["dtype"] for n in BY_NAME} == set(BY_NAME)
    assert_same(ckptfs.load_keys(url), rich_state(dcp_fqns))


def _save_sharded(rank: int, world: int, root: str, backends: list[tuple[str, int]]) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(7, 5, generator=g), torch.randn(7, 5, generator=g).to(torch.bfloat16)
    lo, hi = (0, 1) if rank == 0 else (1, 4)  # uneven hand-made split of 4 rows
    for name, version in backends:
        sd = {"rows": distribute_tensor(w, mesh, [Shard(0)]),
              "cols": distribute_tensor(b, mesh, [Shard(1)]),
              "rep": distribute_tensor(w, mesh, [Replicate()]),
              "hand": ckptfs.ShardedTensor(torch.arange(lo * 3, hi * 3).reshape(-1, 3), (4, 3), (lo, 0)),
              "step": 5}
        ckptfs.save(sd, f"{root}/{name}-{version}", backend=name, backend_version=version)


@pytest.mark.slow
def test_sharded_indexes_validate(tmp_path):
    run_ranks(2, _save_sharded, str(tmp_path), BACKENDS)
    if spec_audit.enabled():  # the session audit read these saves in the spawned coordinator
        checks = {x["url"]: x for x in spec_audit.collect(os.environ[spec_audit.ENV])[0]}
        for name, version in BACKENDS:
            check = checks[f"{tmp_path}/{name}-{version}"]
            assert check["detail"] == "ok" and check["pid"] != os.getpid(), check
    for name, version in BACKENDS:
        d = validate_index(tmp_path / f"{name}-{version}")
        assert d["writer"]["world_size"] == 2
        for key, t in d["tensors"].items():  # the chunks tile each tensor, element by element
            problems = tiling_problems(tuple(t["shape"]), [(c["offsets"], c["shape"]) for c in t["chunks"]])
            assert not problems, (key, problems)
        assert {tuple(c["offsets"]) for c in d["tensors"]["hand"]["chunks"]} >= {(0, 0), (1, 0)}


def test_spec_example_validates_and_parses():
    text = (ROOT / "formats" / "README.md").read_text()
    blocks = re.findall(r"```json\n(\{\n.*?\n\})\n```", text, flags=re.S)
    assert blocks, "formats/README.md has no example index"
    example = json.loads(blocks[-1])
    validate_index(example)
    index = Index.from_dict(example)
    assert index.tensors["model/embed.weight"].shape == (4, 3)


# -- malformed and extended indexes --------------------------------------------------------------

def _example() -> dict[str, Any]:
    return {
        "format": "ckptfs", "format_version": 1, "required_features": [],
        "backend": {"name": "safetensors_chunks", "version": 1, "options": {}},
        "containers": {"model": "dict"},
        "values": {"step": 3, "scale": {"$float": "inf"}},
        "tensors": {"model/w": {"dtype": "float32", "shape": [4, 3], "chunks": [
            {"offsets": [0, 0], "shape": [4, 3], "file": "data/x/r00000-000.safetensors",
             "byte_offset": 128, "byte_length": 48, "checksum": "crc32c:0123abcd"}]}},
        "files": {"data/x/r00000-000.safetensors": 176},
    }


def _mutate(path: tuple | str, value: Any, example: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of ``example`` (default: the example index) with the field at ``path`` set to
    ``value`` (or deleted)."""
    d = copy.deepcopy(_example() if example is None else example)
    *parents, last = (path,) if isinstance(path, str) else path
    node: Any = d
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return d


_DELETE = object()
W = ("tensors", "model/w")
C0 = (*W, "chunks", 0)

# rejected by the schema AND by Index.from_dict (MalformedIndexError or FormatVersionError)
BOTH = {
    "missing format_version": ("format_version", _DELETE),
    "missing tensors": ("tensors", _DELETE),
    "missing backend name": (("backend", "name"), _DELETE),
    "shape is a string": ((*W, "shape"), "4x3"),
    "shape has a negative": ((*W, "shape"), [-4, 3]),
    "shape has a fraction": ((*W, "shape"), [4.5, 3]),
    "offsets is a number": ((*C0, "offsets"), 0),
    "chunk without shape": ((*C0, "shape"), _DELETE),
    "backend version is a string": (("backend", "version"), "1"),
    "byte_offset is a string": ((*C0, "byte_offset"), "128"),
    "format is foreign": ("format", "dcp"),
    "required_features not a list": ("required_features", "zstd"),
    "values not an object": ("values", [1, 2]),
}
# structurally valid for the reader's first pass; the schema catches them up front
SCHEMA_ONLY = {
    "unknown dtype": ((*W, "dtype"), "float128"),
    "checksum of another algorithm": ((*C0, "checksum"), "md5:0123abcd"),
    "checksum in upper case": ((*C0, "checksum"), "crc32c:0123ABCD"),
    "value is an array": (("values", "step"), [1, 2]),
    "bad non-finite float": (("values", "scale"), {"$float": "NaN"}),
    "unknown container kind": (("containers", "model"), "set"),
    "file escapes the root": ((*C0, "file"), "../../etc/passwd"),
    "absolute file": ((*C0, "file"), "/etc/passwd"),
    "negative file size": (("files", "data/x/r00000-000.safetensors"), -1),
    "bad percent escape in key": (("values", "a%zz"), 1),
}


def test_example_is_valid():
    validate_index(_example())
    Index.from_dict(_example())


@pytest.mark.parametrize("case", list(BOTH))
def test_malformed_rejected_by_schema_and_reader(case):
    d = _mutate(*BOTH[case])
    assert not VALIDATOR.is_valid(d), case
    with pytest.raises((MalformedIndexError, FormatVersionError)):
        Index.from_dict(d)


@pytest.mark.parametrize("case", list(SCHEMA_ONLY))
def test_malformed_rejected_by_schema(case):
    assert not VALIDATOR.is_valid(_mutate(*SCHEMA_ONLY[case])), case


def test_unknown_optional_fields_are_legal_everywhere():
    d = _example()
    d["future_field"] = {"anything": [1, 2]}
    d["backend"]["future"] = True
    d["writer"] = {"library": "ckptfs", "world_size": 2, "future": "x"}
    d["tensors"]["model/w"]["future"] = 1
    d["tensors"]["model/w"]["chunks"][0]["future"] = {"a": 1}
    validate_index(d)
    index = Index.from_dict(d)
    assert index.extra == {"future_field": {"anything": [1, 2]}}
    assert index.tensors["model/w"].chunks[0].byte_offset == 128


# -- packed chunks (required feature "packed_chunks", formats/README.md §2.3) ------------------

def _packed() -> dict[str, Any]:
    d = _example()
    d["required_features"] = ["packed_chunks"]
    d["file_table"] = {"prefix": "data/x/", "files": [["r00000-000.safetensors", 176]]}
    del d["files"]
    d["tensors"]["model/w"]["chunks"] = [[[0, 0], [4, 3], 0, 128, 48, "0123abcd"]]
    return d


def test_packed_example_is_valid_and_reads_as_the_unpacked_one():
    validate_index(_packed())
    packed, plain = Index.from_dict(_packed()), Index.from_dict(_example())
    assert packed.tensors == plain.tensors and packed.files == plain.files


PACKED_BAD = {
    "row too short": ((*C0,), [[0, 0], [4, 3], 0, 128, 48]),
    "file id outside the table": ((*C0,), [[0, 0], [4, 3], 1, 128, 48, "0123abcd"]),
    "shape is a string": ((*C0,), [[0, 0], "4x3", 0, 128, 48, "0123abcd"]),
    "negative byte offset": ((*C0,), [[0, 0], [4, 3], 0, -1, 48, "0123abcd"]),
    "no file table": (("file_table",), _DELETE),
    "file escapes the root": (("file_table", "prefix"), "../"),
    "file size is a string": (("file_table", "files", 0, 1), "176"),
    "a chunk object in a packed index": ((*C0,), {"offsets": [0, 0], "shape": [4, 3]}),
    "files beside the file table": (("files",), {"data/x/r00000-000.safetensors": 176}),
    # the hostile-input rules hold for packed rows too (§2.1 bounds, §2.3)
    "byte range beyond the file": ((*C0,), [[0, 0], [4, 3], 0, 160, 48, "0123abcd"]),
    "byte offset beyond 2**62": ((*C0,), [[0, 0], [4, 3], 0, 2**62 + 1, 48, "0123abcd"]),
    "offset beyond 2**62": ((*C0,), [[2**62 + 1, 0], [4, 3], 0, 128, 48, "0123abcd"]),
    "a file twice in the table": (("file_table", "files"), [["r00000-000.safetensors", 176]] * 2),
    "file id is a bool": ((*C0,), [[0, 0], [4, 3], True, 128, 48, "0123abcd"]),
    "a checksum of a file in no table": (("file_checksums",),
                                         {"data/x/other.safetensors": "crc32c:0123abcd"}),
}


@pytest.mark.parametrize("case", list(PACKED_BAD))
def test_malformed_packed_rejected(case):
    path, value = PACKED_BAD[case]
    d = _mutate(path, value, _packed())
    reader_only = ("file id outside the table", "file escapes the root", "byte range beyond the "
                   "file", "a file twice in the table", "a checksum of a file in no table")
    assert not VALIDATOR.is_valid(d) or case in reader_only, case  # the reader's checks
    with pytest.raises(MalformedIndexError):
        Index.from_dict(d)


def test_packed_rows_need_the_feature():
    """A packed row in an index that does not name packed_chunks is malformed (§2.3): an old
    reader would find a list where it expects a chunk object."""
    d = _example()
    d["tensors"]["model/w"]["chunks"] = [[[0, 0], [4, 3], None, 128, 48, "0123abcd"]]
    assert not VALIDATOR.is_valid(d)
    with pytest.raises(MalformedIndexError):
        Index.from_dict(d)


def test_large_indexes_are_written_packed_and_read_back(tmp_path, monkeypatch):
    """Past PACK_MIN_CHUNKS chunks the index packs its chunks (and says so in
    required_features); below it stays plain, readable without the feature."""
    import ckptfs.layout.index as index_mod

    sd = {f"t{i}": torch.full((3,), float(i)) for i in range(40)}
    ckptfs.save(sd, tmp_path / "plain")
    plain = validate_index(tmp_path / "plain")
    assert "packed_chunks" not in plain["required_features"]
    monkeypatch.setattr(index_mod, "PACK_MIN_CHUNKS", 32)
    ckptfs.save(sd, tmp_path / "packed")
    packed = validate_index(tmp_path / "packed")
    assert packed["required_features"] == ["packed_chunks"] and packed["file_table"]["files"]
    assert isinstance(packed["tensors"]["t7"]["chunks"][0], list)
    # safetensors_chunks-1: chunk objects carry extra.name as 0.1 wrote it; packed rows leave
    # the derived name out
    assert plain["tensors"]["t7"]["chunks"][0]["extra"] == {"name": "t7@0"}
    assert len(packed["tensors"]["t7"]["chunks"][0]) == 6
    assert len((tmp_path / "packed" / INDEX_FILE).read_bytes()) < \
        0.7 * len((tmp_path / "plain" / INDEX_FILE).read_bytes())
    back = ckptfs.load_keys(tmp_path / "packed")
    assert all(torch.equal(back[k], v) for k, v in sd.items())
    # the whole-checkpoint checksum members fit the packed form: file_checksums by full path (prefix + name) for
    # every file of the table, the seal over the packed document, and verify checks them
    raw = (tmp_path / "packed" / INDEX_FILE).read_bytes()
    table = [packed["file_table"]["prefix"] + n for n, _ in packed["file_table"]["files"]]
    assert set(packed["file_checksums"]) == set(table) | set(packed.get("backend_files", {}))
    assert list(packed)[-1] == "index_checksum" and "files" not in packed
    assert Index.loads(raw).index_checksum == packed["index_checksum"]
    assert ckptfs.verify(tmp_path / "packed").ok
    flipped = raw.replace(b'"t7"', b'"u7"', 1)  # still valid JSON, another key
    assert flipped != raw
    with pytest.raises(ckptfs.IntegrityError, match="fails its own checksum"):
        Index.loads(flipped)
    data = tmp_path / "packed" / table[0]
    data.write_bytes(data.read_bytes()[:-1] + bytes([data.read_bytes()[-1] ^ 1]))
    found = {(p.kind, p.file) for p in ckptfs.verify(tmp_path / "packed").problems}
    assert ("file-checksum", table[0]) in found, found
    a = ckptfs.load_metadata(tmp_path / "plain").tensors["t7"].chunks[0]
    b = ckptfs.load_metadata(tmp_path / "packed").tensors["t7"].chunks[0]
    assert (a.offsets, a.shape, a.byte_length, a.checksum) == (b.offsets, b.shape, b.byte_length,
                                                               b.checksum)
