"""Single-process round trips through the public API, for every pair: every dtype, 0-d and empty
tensors, strided tensors, Python values, awkward keys, 10,000 small tensors, metadata, partial
loads, strictness and overwrite refusal."""

from __future__ import annotations

import hashlib
import math
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.testing.conformance.cases import (
    DTYPES,
    LIMIT_CASES,
    MANY,
    TORCH_DTYPES,
    assert_same,
    basic_state,
    canonical_key,
    differences,
    flatten,
    many_state,
    python_values,
    tiling_problems,
    whole_tensors,
    zeros_like_state,
)
from ckptfs.testing.conformance.pairs import Pair
from ckptfs.testing.conformance.reshard import READ_SLACK_PER_CHUNK, WIDE
from ckptfs.testing.conformance.workspace import LIMITS, TIMINGS, Workspace, require_writable

REFERENCE = basic_state()


@pytest.fixture
def basic(pair: Pair, workspace: Workspace) -> Path:
    return workspace.basic(pair)


def test_load_keys_round_trip(basic: Path) -> None:
    assert_same(ckptfs.load_keys(basic), REFERENCE, f"load_keys({basic})")


def test_load_in_place_round_trip(basic: Path) -> None:
    target = zeros_like_state(REFERENCE)
    transposed = target["layout"]["transposed"]
    assert not transposed.is_contiguous()
    res = ckptfs.load(target, basic)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert_same(target, REFERENCE, f"load({basic})")
    assert target["layout"]["transposed"] is transposed, "tensors are filled in place"


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype(basic: Path, dtype: str) -> None:
    key = canonical_key(("dtypes", dtype))
    entry = ckptfs.load_metadata(basic).tensors[key]
    assert (entry.dtype, entry.shape) == (dtype, (3, 5))
    got = ckptfs.load_keys(basic, [key])["dtypes"][dtype]
    assert got.dtype == TORCH_DTYPES[dtype]
    assert_same(got, REFERENCE["dtypes"][dtype], key)


def test_special_float_values(basic: Path) -> None:
    got = ckptfs.load_keys(basic, ["special"])["special"]
    assert_same(got, REFERENCE["special"], "special")
    f32 = got["float32"]
    assert math.isnan(f32[0]) and f32[1] == math.inf and f32[2] == -math.inf
    assert math.copysign(1.0, f32[3].item()) == -1.0, "-0.0 keeps its sign"


def test_zero_d_and_empty_tensors(basic: Path) -> None:
    meta = ckptfs.load_metadata(basic)
    for k, t in REFERENCE["scalars"].items():
        e = meta.tensors[f"scalars/{k}"]
        assert e.shape == () and len(e.chunks) == 1 and e.chunks[0].shape == ()
        assert t.dim() == 0
    for k, t in REFERENCE["empty"].items():
        e = meta.tensors[f"empty/{k}"]
        assert e.shape == tuple(t.shape) and e.chunks == ()
    got = ckptfs.load_keys(basic, ["scalars", "empty"])
    assert_same(got, {"scalars": REFERENCE["scalars"], "empty": REFERENCE["empty"]}, "0-d/empty")


def test_python_values(basic: Path) -> None:
    got = ckptfs.load_keys(basic, ["values"])["values"]
    assert_same(got, python_values(), "values")
    assert got["true"] is True and type(got["zero"]) is int and type(got["float"]) is float
    assert isinstance(got["tuple"], tuple) and isinstance(got["list"], list)
    assert 0 in got["int_keys"] and "00" in got["int_keys"] and -3 in got["int_keys"]


def test_awkward_keys(basic: Path) -> None:
    tensors, values, containers = flatten(REFERENCE)
    meta = ckptfs.load_metadata(basic)
    assert set(meta.tensors) == set(tensors)
    assert set(meta.values) == set(values)
    assert dict(meta.containers) == containers
    for path in (("keys", "with/slash"), ("keys", "a/b/c", "x.y/z"), ("keys", 1, "x"), ("keys", 1, 2),
                 ("keys", ".."), ("keys", ""), ("keys", "ünïcödé 模型 🙂"), ("keys", -4), ("keys", "-05")):
        got = ckptfs.load_keys(basic, [path])
        node: Any = got
        want: Any = REFERENCE
        for c in path:
            node, want = node[c], want[c]
        assert_same(node, want, repr(path))
    assert set(ckptfs.load_keys(basic, [("keys", 1)])["keys"][1]) == {2, "x"}
    assert canonical_key(("keys", "-05")) in meta.values and canonical_key(("keys", -4)) in meta.tensors


def test_load_metadata(pair: Pair, basic: Path) -> None:
    meta = ckptfs.load_metadata(basic)
    assert isinstance(meta, ckptfs.Index)
    assert (meta.backend, meta.backend_version) == (pair.name, pair.version)
    assert meta.format_version == 1
    for key, t in whole_tensors(REFERENCE).items():
        e = meta.tensors[key]
        assert (e.dtype, e.shape) == (canonical_dtype(t), tuple(t.shape)), key
        _assert_tiles(key, e)
    assert set(meta.files) and all((basic / f).is_file() for f in meta.files)


def canonical_dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _assert_tiles(key: str, e: ckptfs.TensorEntry) -> None:
    problems = tiling_problems(e.shape, [(c.offsets, c.shape) for c in e.chunks])
    assert not problems, f"{key}: chunks do not tile the tensor exactly once: {problems}"


def test_load_metadata_reads_no_data(basic: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(basic, copy)
    meta = ckptfs.load_metadata(copy)
    for f in meta.files:
        (copy / f).unlink()
    again = ckptfs.load_metadata(copy)
    assert set(again.tensors) == set(meta.tensors) and dict(again.values) == dict(meta.values)


def test_partial_load(basic: Path) -> None:
    meta = ckptfs.load_metadata(basic)
    target: dict[str, Any] = {"dtypes": {"float32": torch.zeros(3, 5)},
                              "values": {"nan": None, "int_keys": {-3: None}}}
    res = ckptfs.load(target, basic)  # strict: every target key is in the checkpoint
    assert_same(target["dtypes"]["float32"], REFERENCE["dtypes"]["float32"], "dtypes/float32")
    assert math.isnan(target["values"]["nan"]) and target["values"]["int_keys"][-3] == "neg"
    assert res.missing_keys == []
    assert "layout/big" in res.unexpected_keys and "dtypes/int8" in res.unexpected_keys
    assert 0 < res.bytes_read < meta.total_bytes / 2, (res.bytes_read, meta.total_bytes)
    got = ckptfs.load_keys(basic, ["dtypes/bfloat16", ("keys", "with/slash"), "values/tuple"])
    assert_same(got, {"dtypes": {"bfloat16": REFERENCE["dtypes"]["bfloat16"]},
                      "keys": {"with/slash": REFERENCE["keys"]["with/slash"]},
                      "values": {"tuple": REFERENCE["values"]["tuple"]}}, "load_keys subset")


def test_partial_load_reads_only_what_it_needs(pair: Pair, tmp_path: Path) -> None:
    """One process loads the left half of the columns of a 96x512 float32 tensor (one stored
    chunk), without coalescing gaps: it reads at least those bytes and at most
    READ_SLACK_PER_CHUNK more (formats/PLUGINS.md), not the whole chunk. The needed bytes are
    counted here from the target, not taken from ckptfs's accounting."""
    require_writable(pair)
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(*WIDE, generator=g)
    url = tmp_path / "ckpt"
    ckptfs.save({"wide": wide}, url, backend=pair.name, backend_version=pair.version)
    cols = WIDE[1] // 2
    target = ckptfs.ShardedTensor(torch.zeros(WIDE[0], cols), WIDE, (0, 0))
    res = ckptfs.load({"wide": target}, url, store_options=ckptfs.StoreOptions(max_gap=0))
    assert_same(target.local_tensor, wide[:, :cols].contiguous(), "wide[:, :256]")
    needed = WIDE[0] * cols * 4
    chunks = len(ckptfs.load_metadata(url).tensors["wide"].chunks)
    assert res.bytes_needed == needed
    assert needed <= res.bytes_read <= needed + READ_SLACK_PER_CHUNK * chunks, \
        f"read {res.bytes_read} bytes for {needed} over {chunks} chunk(s)"


def test_strict_and_non_strict(basic: Path) -> None:
    target: dict[str, Any] = {"dtypes": {"int32": torch.zeros(3, 5, dtype=torch.int32)},
                              "not_there": torch.zeros(2)}
    with pytest.raises(ckptfs.MissingKeysError, match="not_there"):
        ckptfs.load(target, basic)
    res = ckptfs.load(target, basic, strict=False)
    assert res.missing_keys == ["not_there"]
    assert_same(target["dtypes"]["int32"], REFERENCE["dtypes"]["int32"], "dtypes/int32")
    assert not target["not_there"].any()
    with pytest.raises(ckptfs.MissingKeysError, match="nope"):
        ckptfs.load_keys(basic, ["nope"])


def test_mismatched_target_is_refused(basic: Path) -> None:
    with pytest.raises(ckptfs.MismatchError, match="dtypes/float32"):
        ckptfs.load({"dtypes": {"float32": torch.zeros(3, 5, dtype=torch.float64)}}, basic)
    with pytest.raises(ckptfs.MismatchError, match="layout/big"):
        ckptfs.load({"layout": {"big": torch.zeros(62, 33)}}, basic)


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_overwrite_refused_then_allowed(pair: Pair, tmp_path: Path) -> None:
    require_writable(pair)
    url = tmp_path / "ckpt"
    first = {"w": torch.arange(6.0).reshape(2, 3), "step": 1, "only_first": torch.ones(4)}
    second = {"w": torch.full((2, 3), 9.0), "step": 2}
    kw: dict[str, Any] = {"backend": pair.name, "backend_version": pair.version}
    ckptfs.save(first, url, **kw)
    before = _digests(url)
    with pytest.raises(ckptfs.CheckpointExistsError, match="overwrite"):
        ckptfs.save(second, url, **kw)
    assert _digests(url) == before, "a refused save must not touch the existing checkpoint"
    assert_same(ckptfs.load_keys(url), first, "first checkpoint after the refused save")
    ckptfs.save(second, url, overwrite=True, **kw)
    assert_same(ckptfs.load_keys(url), second, "after overwrite=True")


def test_ten_thousand_small_tensors(pair: Pair, workspace: Workspace) -> None:
    url = workspace.many(pair)
    t0 = time.perf_counter()
    got = ckptfs.load_keys(url)
    TIMINGS[(pair.id, f"load_keys {MANY} tensors")] = time.perf_counter() - t0
    assert len(ckptfs.load_metadata(url).tensors) == MANY
    diffs = differences(got, many_state())
    assert not diffs, diffs[:5]


@pytest.mark.parametrize("case", LIMIT_CASES)
def test_store_exactly_or_refuse_clearly(pair: Pair, case: str, tmp_path: Path) -> None:
    require_writable(pair)
    state = LIMIT_CASES[case]()
    url = tmp_path / "ckpt"
    try:
        ckptfs.save(state, url, backend=pair.name, backend_version=pair.version)
    except ckptfs.UnsupportedValueError as e:
        tensors, values, _ = flatten(state)
        assert any(repr(k) in str(e) or k in str(e) for k in (*tensors, *values)), f"no key named: {e}"
        assert not (url / ckptfs.INDEX_FILE).exists(), "a refused save must commit nothing"
        LIMITS[(pair.id, case)] = f"refused: {e}"
        return
    assert_same(ckptfs.load_keys(url), state, case)
    LIMITS[(pair.id, case)] = "stored exactly"
