"""Whole-checkpoint integrity (formats/README.md §6.1, §6.2): every byte of every file of a
checkpoint is covered by a crc32c in the index, the index by its own; ``ckptfs verify`` finds a
flipped bit anywhere, a truncated, missing or extra file, and names key, chunk and file; loads
still check chunk checksums and refuse a damaged index. Older indexes (the golden checkpoints)
verify with notes, not problems."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import google_crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfs
from ckptfs.layout import checksum as ck
from ckptfs.layout.index import Index, seal

PAIRS = [("safetensors_chunks", 1, {}), ("zarr", 2, {"compressor": "zstd"}), ("zarr", 3, {}),
         ("zarr", 3, {"sharding": True, "inner_chunk_bytes": 256}), ("torch_dist", 1, {}),
         ("npy_chunks", 1, {})]
IDS = [f"{n}-{v}{'-' + '-'.join(o) if o else ''}" for n, v, o in PAIRS]
GOLDEN = Path(ckptfs.__file__).parent / "testing" / "conformance" / "golden"


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {"a": torch.randn(300, generator=g), "m": torch.randn(10, 10, generator=g).bfloat16(),
            "opt": {"step": 3, "lr": 1e-3}}


def _files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos % len(data)] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "version", "options"), PAIRS, ids=IDS)
def test_every_byte_of_every_file_is_covered_and_checked(tmp_path, name, version, options):
    src = tmp_path / "src"
    ckptfs.save(_state(), src, backend=name, backend_version=version, backend_options=options)
    raw = (src / ckptfs.INDEX_FILE).read_bytes()
    index = Index.loads(raw)
    # the index lists every file under the root, each with the crc32c of all its bytes
    assert set(index.all_files) | {ckptfs.INDEX_FILE} == _files(src)
    assert set(index.file_checksums) == set(index.all_files)
    for path, want in index.file_checksums.items():
        data = (src / path).read_bytes()
        assert f"crc32c:{google_crc32c.value(data):08x}" == want, path
        assert len(data) == index.all_files[path], path
    # ... and itself: the member is last, the CRC of the index without it
    body = raw[:raw.rindex(b', "index_checksum"')] + b"}"
    assert raw == seal(body) and index.index_checksum == ck.checksum(body)
    report = ckptfs.verify(src)
    assert report.ok and report.skipped == (), (report.problems, report.skipped)

    rng = random.Random(f"{name}{version}{options}")
    for path in sorted(_files(src)):
        size = (src / path).stat().st_size
        for pos in sorted({0, size - 1, rng.randrange(size)}):
            root = tmp_path / "flip"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(src, root)
            _flip(root / path, pos)
            report = ckptfs.verify(root)
            named = {p.file for p in report.problems}
            assert not report.ok and path in named, (path, pos, report.problems)
            if path == ckptfs.INDEX_FILE:
                assert report.problems[0].kind in ("index-checksum", "index"), report.problems


@pytest.mark.parametrize(("name", "version", "options"), PAIRS[:1] + PAIRS[3:5], ids=[IDS[0], *IDS[3:5]])
def test_truncated_missing_and_extra_files(tmp_path, name, version, options):
    src = tmp_path / "src"
    ckptfs.save(_state(), src, backend=name, backend_version=version, backend_options=options)
    index = ckptfs.load_metadata(src)
    for path in sorted(index.all_files):
        for damage in ("truncate", "delete"):
            root = tmp_path / "d"
            shutil.rmtree(root, ignore_errors=True)
            shutil.copytree(src, root)
            if damage == "truncate":
                (root / path).write_bytes((root / path).read_bytes()[:-1])
            else:
                (root / path).unlink()
            kinds = {p.kind for p in ckptfs.verify(root).problems if p.file == path}
            assert kinds & {"file-size", "missing-file"}, (path, damage, kinds)
    root = tmp_path / "extra"
    shutil.copytree(src, root)
    (root / "data" / "x.bin").parent.mkdir(exist_ok=True)
    (root / "data" / "x.bin").write_bytes(b"x")
    report = ckptfs.verify(root)
    assert [(p.kind, p.file) for p in report.problems] == [("extra-file", "data/x.bin")]


def test_container_bytes_of_torch_dist_are_checked(tmp_path):
    """The issue's case: a flipped byte in the torch.save zip records between tensors (which DCP
    and other readers read) slips past a load, which reads only tensor bytes; verify names the
    file and the keys it holds."""
    sd = {"a": torch.arange(64.0), "b": torch.arange(32, dtype=torch.int32)}
    root = tmp_path / "td"
    ckptfs.save(sd, root, backend="torch_dist")
    meta = ckptfs.load_metadata(root)
    c = meta.tensors["a"].chunks[0]
    pos = c.extra["item_offset"] + 10  # inside the zip's first local header, before the data
    assert pos < c.byte_offset
    _flip(root / c.file, pos)
    back = {"a": torch.zeros(64), "b": torch.zeros(32, dtype=torch.int32)}
    ckptfs.load(back, root)  # chunk checksums: all fine
    assert torch.equal(back["a"], sd["a"])
    (p,) = ckptfs.verify(root).problems
    assert (p.kind, p.file) == ("file-checksum", c.file) and "'a', 'b'" in p.message


def test_a_damaged_index_is_refused_by_every_reader(tmp_path):
    root = tmp_path / "c"
    ckptfs.save({"lr": 0.001, "w": torch.ones(4)}, root)
    path = root / ckptfs.INDEX_FILE
    path.write_bytes(path.read_bytes().replace(b"0.001", b"0.003"))  # still valid JSON
    for read in (lambda: ckptfs.load({"lr": 0.0, "w": torch.zeros(4)}, root),
                 lambda: ckptfs.load_metadata(root), lambda: ckptfs.load_keys(root)):
        with pytest.raises(ckptfs.IntegrityError, match="fails its own checksum.*edited"):
            read()
    report = ckptfs.verify(root)
    assert [p.kind for p in report.problems] == ["index-checksum"]
    # the member must be last: moved elsewhere, the index is malformed
    doc = json.loads(path.read_bytes())
    own = doc.pop("index_checksum")
    path.write_text(json.dumps({"index_checksum": own, **doc}))
    with pytest.raises(ckptfs.MalformedIndexError, match="last member"):
        ckptfs.load_metadata(root)
    # without it, the index reads as one written before it existed
    path.write_text(json.dumps({**doc, "lr": 1}))
    assert ckptfs.load_keys(root)["lr"] == 0.003


#: goldens written before whole-file checksums (index 1.1's golden records them)
OLD_GOLDENS = sorted(p.name for p in GOLDEN.iterdir()
                     if p.name not in ("hf_safetensors-1", "index-1.1", "index-1.2", "index-1.3",
                                       "index-1.4"))


@pytest.mark.parametrize("pair", OLD_GOLDENS)
def test_golden_checkpoints_verify_with_notes_not_problems(pair, tmp_path):
    """Indexes written before whole-file checksums stay valid: verify notes what it could not
    check; a flipped header byte in them is then found by no checksum (why the new ones exist)."""
    report = ckptfs.verify(GOLDEN / pair / "checkpoint")
    assert report.ok, report.problems
    notes = " ".join(report.skipped)
    assert "index checksum: the index records none" in notes
    assert "whole-file checksums: the index records none" in notes


def test_combine_is_the_crc_of_the_concatenation():
    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.binary(max_size=300), max_size=8), st.data())
    def check(parts, data):
        known = ck.memo((p, ck.crc_of(p)) for p in parts if data.draw(st.booleans()))
        want = google_crc32c.value(b"".join(parts))
        # combine_min=1: every known part is combined, however small
        assert ck.crc_of_parts([memoryview(p) for p in parts], known, combine_min=1) == want
        for a in parts:
            for b in parts[:2]:
                assert ck.combine(ck.crc_of(a), ck.crc_of(b), len(b)) == ck.crc_of(a + b)

    check()
    big = os.urandom(3 << 20)  # the real threshold, with a part the engine would combine
    parts = [b"head", memoryview(big), b"tail"]
    assert ck.crc_of_parts(parts, ck.memo([(memoryview(big), ck.crc_of(big))])) == \
        google_crc32c.value(b"head" + big + b"tail")


@pytest.mark.parametrize("library", ["crc32c", "libcrc32c"])
def test_both_crc32c_libraries_give_google_crc32c_values(monkeypatch, library):
    """The crc32c package (where its hardware path is there: the x86-64 and ARM wheels) and
    google-crc32c's libcrc32c give the same CRCs, GIL held or not, on both sides of the
    sizes where the path changes, for any dtype and shape of contiguous array."""
    import numpy as np

    assert ck._fast is not None, "the crc32c package's hardware path is missing"
    if library == "libcrc32c":
        monkeypatch.setattr(ck, "_fast", None)
        monkeypatch.setattr(ck, "_extend_nogil", ck._gil_free_extend())
    rng = np.random.default_rng(7)
    for n in (0, 1, 13, ck.NOGIL_MIN - 1, ck.NOGIL_MIN, ck.PIECE + 5):
        data = rng.integers(0, 256, n, dtype=np.uint8)
        want = google_crc32c.value(data.tobytes())
        assert ck.crc_of(data) == ck.crc_of(data, yielding=True) == want, n
        assert ck.crc_of(memoryview(data.tobytes())) == want, n
        assert ck.extend(ck.crc_of(data[: n // 3]), data[n // 3 :]) == want, n
        if n >= 8:
            words = data[: n - n % 8].view(np.float32).reshape(2, -1)
            assert ck.crc_of(words) == google_crc32c.value(words.tobytes()), n


def _zero_crc_bytes(prefix: bytes) -> bytes:
    """``prefix`` + 4 bytes whose CRC-32C is 0 (the CRC is affine in the data bits over GF(2):
    solve for the 4 bytes by Gaussian elimination)."""
    base = google_crc32c.value(prefix + bytes(4))
    cols = [google_crc32c.value(prefix + (1 << i).to_bytes(4, "little")) ^ base for i in range(32)]
    rows = [(c, 1 << i) for i, c in enumerate(cols)]  # (image, which bits of the suffix)
    want, pick = base, 0
    for bit in range(32):  # eliminate: find x with XOR of images == base
        m = 1 << bit
        j = next((k for k in range(bit, 32) if rows[k][0] & m), None)
        assert j is not None
        rows[bit], rows[j] = rows[j], rows[bit]
        for k in range(32):
            if k != bit and rows[k][0] & m:
                rows[k] = (rows[k][0] ^ rows[bit][0], rows[k][1] ^ rows[bit][1])
    for bit in range(32):
        if want & (1 << bit):
            pick ^= rows[bit][1]
    return prefix + pick.to_bytes(4, "little")


def test_combine_after_a_nonempty_part_whose_crc_is_zero():
    """``combine`` returns crc(B) at once when crc(A) is 0 (the first part of a chunk checked
    in parts): right for a non-empty A whose CRC is 0 too."""
    a = _zero_crc_bytes(b"ckptfs chunk head")
    assert len(a) == 21 and ck.crc_of(a) == 0
    for b in (b"", b"x", os.urandom(1000)):
        assert ck.combine(0, ck.crc_of(b), len(b)) == ck.crc_of(a + b) == ck.crc_of(b)


def test_the_index_1_1_golden_verifies_its_whole_file_checksums():
    """The golden of index 1.1 records the index checksum and every file's checksum: verify
    checks them (no note that they are missing) and finds no problem."""
    report = ckptfs.verify(GOLDEN / "index-1.1" / "checkpoint")
    assert report.ok, report.problems
    notes = " ".join(report.skipped)
    assert "the index records none" not in notes, notes
