"""Golden checkpoints: their bytes are pinned by SHA256SUMS, they load to their expected values in
every release, a changed byte is caught, and they convert to every other backend and back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.testing.conformance.cases import (
    assert_same,
    raw_bytes,
    whole_tensors,
    zeros_like_state,
)
from ckptfs.testing.conformance.golden import CHECKPOINT, GoldenDir, all_golden, locate, manifest_problems
from ckptfs.testing.conformance.pairs import Pair, is_writable, select_pairs
from ckptfs.testing.conformance.workspace import require_writable

FROZEN = ("golden checkpoints are frozen: a format change needs a new backend version and a new "
          "golden directory (python -m ckptfs.testing.conformance.make_golden); never regenerate an existing one")


def test_golden_bytes_are_unchanged(golden: GoldenDir) -> None:
    problems = manifest_problems(golden.path)
    assert not problems, f"{golden.path}: " + "; ".join(problems) + f". {FROZEN}"


def test_golden_loads_to_expected_values(golden: GoldenDir, pair: Pair) -> None:
    doc = golden.expected_doc()
    assert (doc["backend"], doc["version"]) == (pair.name, pair.version)
    meta = ckptfs.load_metadata(golden.checkpoint)
    assert (meta.backend, meta.backend_version) == (pair.name, pair.version)
    expected = golden.expected()
    assert_same(ckptfs.load_keys(golden.checkpoint), expected, f"load_keys({golden.checkpoint})")
    target = zeros_like_state(expected)
    ckptfs.load(target, golden.checkpoint)
    assert_same(target, expected, f"load({golden.checkpoint})")
    if is_writable(pair):
        assert len(meta.tensors["sharded/rows"].chunks) >= 2, "golden data was saved by several ranks"


def test_every_golden_directory_has_a_registered_backend(golden_search: list[Path]) -> None:
    registered = set(select_pairs(None))
    orphans = [p for p in all_golden(golden_search) if p not in registered]
    assert not orphans, (f"golden checkpoints of {[str(p) for p in orphans]} have no registered backend: "
                         "old formats must stay readable")


# ---------------------------------------------------------------------------- tampering
def _needle(expected: dict[str, Any]) -> bytes:
    """16 raw bytes of a random float64 tensor: unique in the data files of a raw layout."""
    tensors = whole_tensors(expected)
    return next(raw_bytes(t)[:16] for t in tensors.values() if t.dtype == torch.float64 and t.numel() > 2)


def flip_data_byte(root: Path, expected: dict[str, Any]) -> Path:
    """Flip one byte of tensor data (found by its raw bytes; else the middle of the largest file)."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != ckptfs.INDEX_FILE]
    needle = _needle(expected)
    target, pos = None, -1
    for f in files:
        pos = f.read_bytes().find(needle)
        if pos >= 0:
            target = f
            break
    if target is None:
        target = max(files, key=lambda p: p.stat().st_size)
        pos = target.stat().st_size // 2
    data = bytearray(target.read_bytes())
    data[pos + 3] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def assert_load_raises_integrity_error(root: Path, like: dict[str, Any]) -> None:
    """Loading a checkpoint with a damaged byte of tensor data raises ckptfs.IntegrityError, from
    load_keys and from an in-place load into a target shaped ``like`` the saved state: never
    wrong values returned in silence."""
    with pytest.raises(ckptfs.IntegrityError):
        ckptfs.load_keys(root)
    with pytest.raises(ckptfs.IntegrityError):
        ckptfs.load(zeros_like_state(like), root)


def test_flipped_byte_fails_hash_check_and_load(golden: GoldenDir, tmp_path: Path) -> None:
    copy = GoldenDir(tmp_path, golden.pair)
    shutil.copytree(golden.path, copy.path)
    assert manifest_problems(copy.path) == []
    expected = copy.expected()
    changed = flip_data_byte(copy.checkpoint, expected)
    rel = changed.relative_to(copy.path).as_posix()
    assert manifest_problems(copy.path) == [f"{rel}: sha256 differs from SHA256SUMS"]
    if not (copy.checkpoint / ckptfs.INDEX_FILE).is_file():
        pytest.skip(f"{golden.pair}: a foreign layout records no checksums for a load to check")
    assert_load_raises_integrity_error(copy.checkpoint, expected)


def test_flipped_data_byte_raises_integrity_error(pair: Pair, tmp_path: Path) -> None:
    """A fresh checkpoint of this pair (no golden needed): one flipped byte of stored tensor data
    makes every load raise IntegrityError (the chunk checksum, or the layout's own check)."""
    require_writable(pair)
    g = torch.Generator().manual_seed(11)
    state = {"dtypes": {"float64": torch.randn(64, 64, generator=g, dtype=torch.float64)}, "step": 1}
    url = tmp_path / "ckpt"
    ckptfs.save(state, url, backend=pair.name, backend_version=pair.version)
    flip_data_byte(url, state)
    assert_load_raises_integrity_error(url, state)


def test_edited_index_fails_hash_check_and_differs(golden: GoldenDir, tmp_path: Path) -> None:
    if not (golden.checkpoint / ckptfs.INDEX_FILE).is_file():
        pytest.skip(f"{golden.pair}: a foreign layout has no {ckptfs.INDEX_FILE} to edit")
    copy = GoldenDir(tmp_path, golden.pair)
    shutil.copytree(golden.path, copy.path)
    index = copy.checkpoint / ckptfs.INDEX_FILE
    doc = json.loads(index.read_text(encoding="utf-8"))
    doc["values"]["values/step"] += 1
    index.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    assert manifest_problems(copy.path) == [f"{CHECKPOINT}/{ckptfs.INDEX_FILE}: sha256 differs from SHA256SUMS"]
    got = ckptfs.load_keys(copy.checkpoint)
    assert got["values"]["step"] == copy.expected()["values"]["step"] + 1
    (copy.checkpoint / "stray.bin").write_bytes(b"x")
    assert f"{CHECKPOINT}/stray.bin: not listed in SHA256SUMS" in manifest_problems(copy.path)


# ---------------------------------------------------------------------------- cross-backend
def convert(src: Path, dst: Path, to: Pair) -> None:
    """The conversion tool (``ckptfs.convert``, streaming)."""
    ckptfs.convert(src, dst, backend=to.name, backend_version=to.version)


def test_convert_to_other_backend_and_back(pair: Pair, other: Pair, golden_search: list[Path],
                                          tmp_path: Path) -> None:
    """Each golden checkpoint converts to the other backend and, when its own backend writes,
    back again, with every value, container and tensor intact."""
    done = 0
    for src, via in ((pair, other), (other, pair)):
        g = locate(golden_search, src)
        if g is None or not is_writable(via):
            continue
        expected = g.expected()
        there, back = tmp_path / f"{src}-to-{via}", tmp_path / f"{src}-to-{via}-to-{src}"
        convert(g.checkpoint, there, via)
        assert ckptfs.load_metadata(there).backend == via.name
        assert_same(ckptfs.load_keys(there), expected, f"{src} golden converted to {via}")
        done += 1
        if not is_writable(src):
            continue
        convert(there, back, src)
        assert_same(ckptfs.load_keys(back), expected, f"{src} golden converted to {via} and back")
        a, b = ckptfs.load_metadata(g.checkpoint), ckptfs.load_metadata(back)
        assert {k: (e.dtype, e.shape) for k, e in a.tensors.items()} == \
               {k: (e.dtype, e.shape) for k, e in b.tensors.items()}
        assert dict(a.containers) == dict(b.containers) and set(a.values) == set(b.values)
    if not done:
        pytest.skip(f"no golden checkpoint of {pair} or {other} converts to a writable backend")
