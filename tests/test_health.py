"""Checkpoint health on real spawned gloo ranks: ``check_finite=True`` refuses NaN and infinity
on every rank and leaves the previous checkpoint as it was (``save`` and ``async_save``), or,
at a fresh target where it is found while written, nothing;
fingerprints (``stats=True``) equal float64 reference values over the whole global tensor for
1, 2 and 3 writers; the golden checkpoint of index 1.1 loads, and its fingerprints match."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.layout.backend import ChunkData
from ckptfs.layout.boxes import full_box
from ckptfs.layout.dtypes import from_torch
from ckptfs.layout.index import Index
from ckptfs.manager.steps import step_dir
from ckptfs.testing.conformance.cases import differences
from ckptfs.testing.conformance.golden import GoldenDir, golden_reference, manifest_problems
from ckptfs.testing.conformance.golden_index import golden_index_dir
from ckptfs.testing.conformance.pairs import Pair
from ckptfs.testing.ranks import run_ranks

ROWS = 11
REPLICATED = 300_000  # float64: 2.4 MB, cut into slices written by several holders


def full_state() -> dict[str, torch.Tensor]:
    """The global tensors every test saves (the same on every rank: built from a seed)."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(ROWS, 5, generator=g) * 3
    rows[2, 1], rows[8, 4], rows[9, 0] = math.nan, math.inf, -math.inf
    return {"rows": rows,
            "half": (torch.randn(ROWS, 3, generator=g) * 100).to(torch.bfloat16),
            "ints": torch.randint(-1000, 1000, (ROWS, 2), generator=g),
            "replicated": torch.randn(REPLICATED, generator=g, dtype=torch.float64),
            "flags": torch.rand(7, generator=g) > 0.5,
            "empty": torch.empty(0, 4)}


def rank_state(rank: int, world: int, full: dict[str, torch.Tensor]) -> dict:
    """Row-sharded tensors (uneven shards: ROWS over ``world``), the rest replicated."""
    out: dict = {}
    bounds = [ROWS * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    for k, t in full.items():
        if k in ("rows", "half", "ints"):
            out[k] = ckptfs.ShardedTensor(t[lo:hi].clone(), tuple(t.shape), (lo, 0))
        else:
            out[k] = t.clone()
    return out


def reference(t: torch.Tensor) -> dict:
    """The fingerprint by its definition (formats/README.md §2.4), over the whole tensor."""
    x = t.reshape(-1).to(torch.float64)
    ok = x[torch.isfinite(x)]
    out = {"count": x.numel(), "nan": int(torch.isnan(x).sum()), "inf": int(torch.isinf(x).sum())}
    if ok.numel():
        out.update(min=float(ok.min()), max=float(ok.max()), mean=float(ok.sum() / ok.numel()))
    out["l2"] = math.sqrt(float((ok * ok).sum()))
    return out


def assert_fingerprints(index: Index, full: dict[str, torch.Tensor]) -> None:
    for key, t in full.items():
        stats, want = index.tensors[key].stats, reference(t)
        for name in ("count", "nan", "inf", "min", "max", "mean", "l2"):
            got, v = getattr(stats, name), want.get(name)
            if name in ("mean", "l2") and v is not None and math.isfinite(v):
                assert got == pytest.approx(v, rel=1e-12, abs=1e-300), (key, name)
            else:
                assert got == v, (key, name)


# ---------------------------------------------------------------------------- spawned ranks


def bad_state(rank: int, world: int) -> dict:
    """The last rank's shard of ``w`` holds one NaN and one infinity; everything else is fine."""
    w = torch.arange(6 * world, dtype=torch.float32).reshape(2 * world, 3)
    mine = w[2 * rank:2 * rank + 2].clone()
    if rank == world - 1:
        mine[0, 1], mine[1, 2] = math.nan, -math.inf
    return {"w": ckptfs.ShardedTensor(mine, tuple(w.shape), (2 * rank, 0)),
            "fine": torch.ones(3)}


def big_bad_state(rank: int, world: int) -> dict:
    """``bad_state`` with 2 MiB shards: the last rank's NaN and infinity are found by the
    writer threads while its chunk is written (engine/save/checked_parts.py)."""
    rows = 1 << 9
    mine = torch.ones(rows, 1024)
    if rank == world - 1:
        mine[3, 5], mine[rows - 1, 1023] = math.nan, math.inf
    return {"w": ckptfs.ShardedTensor(mine, (rows * world, 1024), (rows * rank, 0)),
            "fine": torch.ones(3)}


def refusal(fn) -> dict:
    try:
        fn()
    except ckptfs.NonFiniteError as e:
        return {"type": type(e).__name__, "found": {k: list(v) for k, v in e.found.items()},
                "message": str(e)}
    except Exception as e:  # recorded: the test names what was raised instead
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None}


def cases(rank: int, world: int, root: str) -> None:
    """Every spawned case of one world size; this rank's outcomes go to a JSON file."""
    full = full_state()
    ckptfs.save(rank_state(rank, world, full), f"{root}/stats-{world}", stats=True)
    prev = f"{root}/prev-{world}"
    good = {"w": ckptfs.ShardedTensor(torch.zeros(2, 3), (2 * world, 3), (2 * rank, 0)),
            "fine": torch.ones(3)}
    ckptfs.save(good, prev)
    out = {
        "save": refusal(lambda: ckptfs.save(bad_state(rank, world), prev, overwrite=True,
                                            check_finite=True)),
        "async": refusal(lambda: ckptfs.async_save(bad_state(rank, world), prev, overwrite=True,
                                                   check_finite=True).result(120)),
    }
    if world == 2:  # a fresh target: refused while written, what was written removed
        fresh = f"{root}/fresh-{world}"
        out["fresh"] = refusal(lambda: ckptfs.save(big_bad_state(rank, world), fresh,
                                                   check_finite=True))
        out["fresh-async"] = refusal(lambda: ckptfs.async_save(
            big_bad_state(rank, world), fresh, check_finite=True).result(120))
    # a finite state passes the check and is committed
    ckptfs.save(good, f"{root}/clean-{world}", check_finite=True, stats=True)
    Path(f"{root}/out-{world}-{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("health")
    for world in (2, 3):
        run_ranks(world, cases, str(root), timeout=300)
    return root


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_nan_and_inf_in_one_shard_refuse_the_save_on_every_rank(spawned, world):
    for rank in range(world):
        out = json.loads((spawned / f"out-{world}-{rank}.json").read_text())
        for how in ("save", "async", *(("fresh", "fresh-async") if world == 2 else ())):
            got = out[how]
            assert got["type"] == "NonFiniteError", (rank, how, got)
            assert got["found"] == {"w": [1, 1]}, (rank, how)
            assert "'w' (1 NaN, 1 inf)" in got["message"]
    assert not list((spawned / f"fresh-{world}").rglob("*"))  # nothing left, nothing committed
    # nothing committed over the previous checkpoint: it is still there, as it was
    prev = ckptfs.load_keys(spawned / f"prev-{world}")
    assert torch.equal(prev["w"], torch.zeros(2 * world, 3))
    assert not (spawned / f"prev-{world}" / "ckptfs.lock").exists()
    clean = ckptfs.load_metadata(spawned / f"clean-{world}")
    assert clean.tensors["w"].stats.finite and clean.format_minor_version == 1


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.slow
def test_fingerprints_equal_float64_reference_over_the_global_tensor(spawned, tmp_path, world):
    full = full_state()
    if world == 1:
        ckptfs.save(full, tmp_path / "one", stats=True)
        index = ckptfs.load_metadata(tmp_path / "one")
    else:
        index = ckptfs.load_metadata(spawned / f"stats-{world}")
        # the replicated tensor was written in slices by several ranks, each element once
        assert len(index.tensors["replicated"].chunks) > 1
    assert_fingerprints(index, full)
    assert index.tensors["rows"].stats.nan == 1 and index.tensors["rows"].stats.inf == 2
    assert index.tensors["empty"].stats.to_dict() == {"count": 0, "nan": 0, "inf": 0, "l2": 0.0}


def test_single_process_refusal_leaves_no_trace(tmp_path):
    state = {"a": torch.ones(4), "b": torch.tensor([1.0, math.nan, math.inf, 2.0]).half()}
    with pytest.raises(ckptfs.NonFiniteError, match="'b' \\(1 NaN, 1 inf\\)") as e:
        ckptfs.save(state, tmp_path / "x", check_finite=True)
    assert e.value.found == {"b": (1, 1)} and isinstance(e.value, ckptfs.CkptfsError)
    assert not list((tmp_path / "x").rglob("*"))  # what it wrote is gone, the lock too
    # float8 (no aminmax on CPU) and integer tensors
    f8 = {"f": torch.tensor([1.0, math.nan]).to(torch.float8_e5m2), "i": torch.arange(3)}
    with pytest.raises(ckptfs.NonFiniteError, match="'f'"):
        ckptfs.save(f8, tmp_path / "y", check_finite=True)
    ckptfs.save({"i": torch.arange(3), "c": torch.ones(2, dtype=torch.complex64)},
                tmp_path / "z", check_finite=True, stats=True)
    index = ckptfs.load_metadata(tmp_path / "z")
    assert index.tensors["c"].stats is None and index.tensors["i"].stats.max == 2.0


def test_an_index_without_fingerprints_is_written_as_before(tmp_path):
    ckptfs.save({"a": torch.ones(2)}, tmp_path / "plain")
    raw = json.loads((tmp_path / "plain" / ckptfs.INDEX_FILE).read_text())
    assert "format_minor_version" not in raw and "stats" not in raw["tensors"]["a"]
    assert ckptfs.load_metadata(tmp_path / "plain").format_minor_version == 0


def test_older_readers_see_the_same_checkpoint(tmp_path):
    """An index 1.1 without its 1.1 members reads as the same tensors and values."""
    g = golden_index_dir(1)
    raw = json.loads((g / "checkpoint" / ckptfs.INDEX_FILE).read_text())
    raw.pop("format_minor_version")
    raw.pop("index_checksum")
    for t in raw["tensors"].values():
        t.pop("stats", None)
    old, new = Index.from_dict(raw), ckptfs.load_metadata(g / "checkpoint")
    assert old.format_minor_version == 0 and new.format_minor_version == 1
    assert {k: (t.dtype, t.shape, t.chunks) for k, t in old.tensors.items()} == \
        {k: (t.dtype, t.shape, t.chunks) for k, t in new.tensors.items()}
    assert old.values == new.values


def test_golden_index_1_1_loads_and_its_fingerprints_match():
    g = golden_index_dir(1)
    assert manifest_problems(g) == []
    assert differences(ckptfs.load_keys(g / "checkpoint"), golden_reference()) == []
    index = ckptfs.load_metadata(g / "checkpoint")
    assert index.format_minor_version == 1
    flat = {k: t for k, t in _flat(golden_reference()).items() if not t.is_complex()}
    assert_fingerprints(index, flat)


def test_older_goldens_still_load():
    from ckptfs.testing.conformance.golden import GOLDEN_ROOT

    for pair in [Pair("safetensors_chunks", 1), Pair("zarr", 2), Pair("zarr", 3),
                 Pair("torch_dist", 1)]:
        gd = GoldenDir(GOLDEN_ROOT, pair)
        assert differences(ckptfs.load_keys(gd.checkpoint), gd.expected()) == [], pair
        assert ckptfs.load_metadata(gd.checkpoint).format_minor_version == 0


def _flat(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    from ckptfs.layout.keys import encode_component

    out = {}
    for k, v in tree.items():
        key = f"{prefix}{encode_component(k)}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            out.update(_flat(v, key + "/"))
    return out


def test_manager_refuses_a_non_finite_step_and_finds_the_last_good_one(tmp_path):
    url = tmp_path / "run"
    with ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=()), save=ckptfs.SaveOptions(health=ckptfs.HealthOptions(check_finite=True)))) as m:
        m.save_sync(1, {"w": torch.ones(3)})
        with pytest.raises(ckptfs.NonFiniteError):
            m.save_sync(2, {"w": torch.tensor([1.0, math.nan, 3.0])})
        assert m.latest_step() == 1 and m.steps() == [1]
        assert not (url / step_dir(2) / ckptfs.INDEX_FILE).exists()
    # a manager recording fingerprints only: a non-finite step is committed, but not good
    with ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=()), save=ckptfs.SaveOptions(health=ckptfs.HealthOptions(stats=True)))) as m:
        m.save_sync(3, {"w": torch.full((3,), 3.0)})
        m.save_sync(4, {"w": torch.tensor([4.0, math.inf, 4.0])})
        assert m.latest_step() == 4 and m.last_good_step() == 3
        target = {"w": torch.zeros(3)}
        assert m.restore(target, step="last_good") == 3
        assert torch.equal(target["w"], torch.full((3,), 3.0))
        # a damaged index is passed over too
        index = url / step_dir(3) / ckptfs.INDEX_FILE
        index.write_bytes(index.read_bytes().replace(b'"dtype": "float32"', b'"dtype": "float64"'))
        assert m.last_good_step() == 1


def test_a_manager_with_a_local_tier_refuses_while_writing_and_keeps_nothing(tmp_path):
    """The step goes through the local tier, where its large chunk is searched while written:
    refused, its files removed from the tier and the URL, the previous step still the latest."""
    url, tier = tmp_path / "run", tmp_path / "tier"
    big = torch.ones(1 << 19)  # 2 MiB
    with ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=tier), preemption=ckptfs.PreemptionPolicy(signals=()), save=ckptfs.SaveOptions(health=ckptfs.HealthOptions(check_finite=True)))) as m:
        m.save_sync(1, {"w": big})
        bad = big.clone()
        bad[12345], bad[-1] = math.nan, -math.inf
        with pytest.raises(ckptfs.NonFiniteError) as e:
            m.save_sync(2, {"w": bad})
        assert e.value.found == {"w": (1, 1)}
        assert m.latest_step() == 1 and m.steps() == [1]
    for root in (url, tier):
        assert not [p for p in (root / step_dir(2)).rglob("*") if p.is_file()]


def test_manager_without_good_steps(tmp_path):
    with ckptfs.CheckpointManager(tmp_path / "run", ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=()), save=ckptfs.SaveOptions(health=ckptfs.HealthOptions(stats=True)))) as m:
        assert m.last_good_step() is None
        m.save_sync(1, {"w": torch.tensor([math.nan])})
        assert m.last_good_step() is None
        with pytest.raises(ckptfs.CheckpointNotFoundError, match="no committed step is good"):
            m.restore({"w": torch.zeros(1)}, step="last_good")


def test_schema_and_reader_accept_fingerprints_and_refuse_bad_ones():
    import jsonschema

    from ckptfs.testing.conformance.golden import SCHEMA_FILE

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    raw = json.loads((golden_index_dir(1) / "checkpoint" / ckptfs.INDEX_FILE).read_text())
    validator.validate(raw)
    assert any("$float" in json.dumps(t["stats"]) for t in raw["tensors"].values())
    raw.pop("index_checksum")
    for bad in ({"count": -1, "nan": 0, "inf": 0, "l2": 0.0}, {"count": 1, "nan": 0, "inf": 0},
                {"count": 1, "nan": 0, "inf": 0, "l2": "x"}, [1, 2]):
        doc = json.loads(json.dumps(raw))
        doc["tensors"]["scalar"]["stats"] = bad
        assert not validator.is_valid(doc), bad
        with pytest.raises(ckptfs.MalformedIndexError, match="scalar"):
            Index.from_dict(doc)
    doc = json.loads(json.dumps(raw))
    doc["format_minor_version"] = 7  # a newer minor version is read (§7)
    assert Index.from_dict(doc).format_minor_version == 7


def test_tensors_checked_on_their_device_are_not_checked_again(tmp_path, monkeypatch):
    """CUDA tensors are checked where they live before staging (``check_on_device``) and their
    staged host copies are skipped; on this CPU-only run every tensor stands in for one."""
    import functools

    from ckptfs.engine.save import health

    state = {"w": torch.tensor([1.0, math.nan, math.inf]), "ok": torch.ones(2), "n": 3}
    found = health.check_on_device(state, 0, True, on_device=lambda t: True)
    assert found.keys == {"w", "ok"} and found.found == (("w", 1, 1),)
    assert health.check_on_device(state, 0, False).keys == frozenset()
    assert health.check_on_device(state, 0, True).keys == frozenset()  # no CUDA tensor here
    everywhere = functools.partial(health.check_on_device, on_device=lambda t: True)
    monkeypatch.setattr(health, "check_on_device", everywhere)  # HealthHook.before_stage's
    with pytest.raises(ckptfs.NonFiniteError) as e:
        ckptfs.save(state, tmp_path / "x", check_finite=True)
    assert e.value.found == {"w": (1, 1)}  # counted once, on the "device"


def test_async_save_records_fingerprints(tmp_path):
    ckptfs.async_save({"w": torch.arange(4.0), "b": torch.ones(2)}, tmp_path / "a",
                      stats=True, check_finite=True).result(120)
    stats = ckptfs.load_metadata(tmp_path / "a").tensors["w"].stats
    assert (stats.count, stats.min, stats.max, stats.mean) == (4, 0.0, 3.0, 1.5)
    assert stats.l2 == pytest.approx(math.sqrt(14.0), rel=1e-15)


def _chunk(key: str, t: torch.Tensor) -> ChunkData:
    return ChunkData(key, from_torch(t.dtype, key), tuple(t.shape), full_box(t.shape), t)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64,
                                   torch.float8_e5m2, torch.float8_e4m3fn])
def test_the_quick_pass_clears_exactly_the_finite_tensors(dtype, monkeypatch):
    """The quick test of CPU tensors (a float sum, then bit patterns), in pieces over threads
    and blocks within them: every finite extreme passes it (a sum that overflows too) (no false alarm to count), every NaN and infinity of
    either sign anywhere fails it."""
    from ckptfs.engine.save import health

    monkeypatch.setattr(health, "PIECE_BYTES", 64)  # many pieces, dealt over the threads
    monkeypatch.setattr(health, "BLOCK_BYTES", 24)  # several blocks per piece, a short last one
    fi = torch.finfo(dtype)
    finite = torch.tensor([0.0, -0.0, fi.max, -fi.max, fi.tiny, -fi.tiny, fi.eps, 1.0] * 40,
                          dtype=torch.float64).to(dtype)
    assert health.non_finite([_chunk("x", finite)]) == ()
    assert health.non_finite([_chunk("col", finite.reshape(40, 8)[:, 2:5])]) == ()  # strided
    assert health._suspects([finite]) == [False]
    overflowing = torch.full((320,), fi.max, dtype=dtype)  # finite, but its sum is infinite
    assert health._suspects([overflowing]) == [False]
    both = finite.clone()
    both[[3, 5]] = torch.tensor([math.inf, -math.inf], dtype=torch.float64).to(dtype)
    assert health._suspects([both]) == [dtype != torch.float8_e4m3fn]  # adds up to NaN
    for where in (0, 137, 319):
        for value in (math.nan, -math.nan, math.inf, -math.inf):
            x = finite.clone()
            x[where] = torch.tensor(value, dtype=torch.float64).to(dtype)  # e4m3fn has no inf
            nan, inf = int(torch.isnan(x.double()).sum()), int(torch.isinf(x.double()).sum())
            assert nan + inf == 1 or (dtype == torch.float8_e4m3fn and math.isinf(value))
            want = (("x", nan, inf),) if nan + inf else ()
            assert health.non_finite([_chunk("x", x), _chunk("ok", finite)]) == want
            assert health._suspects([x]) == [bool(nan + inf)]
            x = finite.abs()  # no sign bit set anywhere but here: one reduction per block
            assert health._suspects([x]) == [False]
            x[where] = torch.tensor(value, dtype=torch.float64).to(dtype)
            assert health._suspects([x]) == [bool(nan + inf)]
