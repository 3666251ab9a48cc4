"""The bytes on disk: the index validates against formats/index.schema.json, the data files open
in their backend's native reader, and the compatibility policy (formats/README.md §7) holds."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

import ckptfs
from ckptfs.layout.backend import FinalFiles
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import from_name
from ckptfs.layout.plan import PlannedChunk, TensorPlan
from ckptfs.layout.registry import get_backend
from ckptfs.testing.conformance import reshard
from ckptfs.testing.conformance.cases import assert_same, basic_state, whole_tensors, zeros_like_state
from ckptfs.testing.conformance.golden import SCHEMA_FILE, locate
from ckptfs.testing.conformance.native import NATIVE_CHECKS
from ckptfs.testing.conformance.pairs import Pair
from ckptfs.testing.conformance.workspace import Workspace, require_writable

SCHEMA = SCHEMA_FILE
INDEX = ckptfs.INDEX_FILE
REFERENCE = basic_state()


def _checkpoint(which: str, pair: Pair, workspace: Workspace, usable_pairs: list[Pair],
                golden_search: list[Path]) -> tuple[Path, dict[str, Any]]:
    """(root, expected whole state) of the basic, sharded or golden checkpoint of ``pair``."""
    if which == "basic":
        return workspace.basic(pair), REFERENCE
    if which == "sharded":
        require_writable(pair)
        run = workspace.reshard(usable_pairs)[pair]
        if run.errors("save", reshard.SAVE_WORLD):
            pytest.fail(f"the {reshard.SAVE_WORLD}-rank save failed (see test_save_uneven_shards)")
        return run.url, reshard.reference()
    g = locate(golden_search, pair)
    if g is None:
        pytest.skip(f"no golden checkpoint for {pair} (see the golden tests)")
    return g.checkpoint, g.expected()


CHECKPOINTS = ("basic", "sharded", "golden")


@pytest.mark.parametrize("which", CHECKPOINTS)
def test_index_matches_schema(which: str, pair: Pair, workspace: Workspace, usable_pairs: list[Pair],
                              golden_search: list[Path]) -> None:
    if not SCHEMA.is_file():
        pytest.skip(f"{SCHEMA} does not exist yet")
    import jsonschema

    schema = json.loads(SCHEMA.read_text(encoding="utf-8"))
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    root, _ = _checkpoint(which, pair, workspace, usable_pairs, golden_search)
    if (root / INDEX).is_file():
        doc = json.loads((root / INDEX).read_text(encoding="utf-8"))
    else:  # a foreign checkpoint: the index its backend builds from the files must be valid
        doc = ckptfs.load_metadata(root).to_dict()
    errors = sorted(validator_cls(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("which", CHECKPOINTS)
def test_every_chunk_has_a_checksum(which: str, pair: Pair, workspace: Workspace,
                                    usable_pairs: list[Pair], golden_search: list[Path]) -> None:
    """ckptfs writes a crc32c for every stored chunk with elements (formats/README.md §6); a
    backend storing one planned chunk as several entries must set theirs."""
    root, _ = _checkpoint(which, pair, workspace, usable_pairs, golden_search)
    if not (root / INDEX).is_file():
        pytest.skip(f"{pair}: a foreign layout has no {INDEX} to record checksums in")
    doc = json.loads((root / INDEX).read_text(encoding="utf-8"))
    bad = [(key, c["offsets"]) for key, t in doc["tensors"].items() for c in t["chunks"]
           if math.prod(c["shape"]) and not re.fullmatch(r"crc32c:[0-9a-f]{8}", c.get("checksum", ""))]
    assert not bad, f"{len(bad)} chunk(s) without a crc32c checksum, e.g. {bad[:5]}"


def test_finalize_names_its_marker(pair: Pair, workspace: Workspace) -> None:
    """``Backend.finalize`` returns ``FinalFiles``: its files and its marker (written last, after
    every other file) are in the committed checkpoint and recorded in the index."""
    require_writable(pair)
    root = workspace.basic(pair)
    index = ckptfs.load_metadata(root)
    backend = get_backend(pair.name, pair.version)(index.backend_options)
    plans = {k: TensorPlan(k, t.dtype, t.shape, from_name(t.dtype, k).itemsize,
                           tuple(PlannedChunk(Box(c.offsets, c.shape), 0, (0,)) for c in t.chunks))
             for k, t in index.tensors.items()}
    final = backend.finalize(index, plans)
    assert isinstance(final, FinalFiles), f"finalize returned {type(final).__name__}"
    paths = [f.path for f in final.all()]
    assert len(set(paths)) == len(paths), paths
    missing = [p for p in paths if p not in index.backend_files or not (root / p).is_file()]
    assert not missing, f"final files not in the committed checkpoint: {missing}"


@pytest.mark.parametrize("which", CHECKPOINTS)
def test_native_reader(which: str, pair: Pair, workspace: Workspace, usable_pairs: list[Pair],
                       golden_search: list[Path]) -> None:
    check = NATIVE_CHECKS.get(pair.name)
    if check is None:
        pytest.skip(f"no native reader check registered for backend {pair.name!r} (ckptfs/testing/conformance/native.py)")
    root, expected = _checkpoint(which, pair, workspace, usable_pairs, golden_search)
    check(root, ckptfs.load_metadata(root), whole_tensors(expected))


# ---------------------------------------------------------------------------- version policy
@pytest.fixture
def edited(pair: Pair, workspace: Workspace, golden_search: list[Path], tmp_path: Path):
    """A copy of the pair's golden checkpoint (or of its basic one, for pairs without golden
    data) and a function that rewrites its index; yields (root, expected, edit)."""
    g = locate(golden_search, pair)
    src, expected = (g.checkpoint, g.expected()) if g else (workspace.basic(pair), REFERENCE)
    if not (src / INDEX).is_file():
        pytest.skip(f"{pair}: the checkpoint has no {INDEX} to edit (a foreign layout)")
    root = tmp_path / "ckpt"
    shutil.copytree(src, root)

    def edit(fn) -> None:
        doc = json.loads((root / INDEX).read_text(encoding="utf-8"))
        fn(doc)
        doc.pop("index_checksum", None)  # edited by hand: no longer sealed (formats/README.md §6.2)
        (root / INDEX).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")

    return root, expected, edit


def _all_loads_refuse(root: Path, expected: dict, error: type, *needles: str) -> None:
    for what, call in (("load_metadata", lambda: ckptfs.load_metadata(root)),
                       ("load_keys", lambda: ckptfs.load_keys(root)),
                       ("load", lambda: ckptfs.load(zeros_like_state(expected), root))):
        with pytest.raises(error) as info:
            call()
        for needle in needles:
            assert needle in str(info.value), f"{what}: {needle!r} not in {info.value}"


def test_newer_format_version_is_refused(edited) -> None:
    root, expected, edit = edited
    edit(lambda d: d.update(format_version=2))
    _all_loads_refuse(root, expected, ckptfs.FormatVersionError,
                      "format_version 2", "supported format versions: [1]", INDEX)


def test_unknown_required_feature_is_refused(edited) -> None:
    root, expected, edit = edited
    edit(lambda d: d.update(required_features=["chunk-deltas-v9"]))
    _all_loads_refuse(root, expected, ckptfs.FormatVersionError, "chunk-deltas-v9", "known features")


def test_unknown_backend_version_is_refused(edited, pair: Pair) -> None:
    root, expected, edit = edited
    edit(lambda d: d["backend"].update(version=999))
    for call in (lambda: ckptfs.load_keys(root), lambda: ckptfs.load(zeros_like_state(expected), root)):
        with pytest.raises(ckptfs.UnknownBackendError) as info:
            call()
        msg = str(info.value)
        assert f"{pair.name}-999" in msg and pair.id in msg, msg  # names it, lists the registered
    assert ckptfs.load_metadata(root).backend_version == 999, "the index alone stays readable"


def test_unknown_optional_fields_are_ignored(edited) -> None:
    root, expected, edit = edited

    def add_fields(d: dict) -> None:
        d["a_future_field"] = {"nested": [1, 2, {"x": None}]}
        d["backend"]["a_future_backend_field"] = "ignored"
        d["writer"]["a_future_writer_field"] = 1
        for t in d["tensors"].values():
            t["a_future_tensor_field"] = {"any": "thing"}
            for c in t["chunks"]:
                c["a_future_chunk_field"] = [0, "x"]

    edit(add_fields)
    meta = ckptfs.load_metadata(root)
    assert "a_future_field" in meta.extra
    assert_same(ckptfs.load_keys(root), expected, "load_keys with unknown optional fields")
    target = zeros_like_state(expected)
    ckptfs.load(target, root)
    assert_same(target, expected, "load with unknown optional fields")
