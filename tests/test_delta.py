"""Delta checkpoints (formats/README.md §2.5, docs/guide/delta.md): chunks of equal content
hash referenced in a base checkpoint, not rewritten; loads read them from the base through the
ranged-read engine, bit-exact and checked."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.errors import FormatVersionError, IntegrityError, MalformedIndexError
from ckptfs.layout import index as index_mod
from ckptfs.layout.index import Index
from ckptfs.testing.ranks import run_ranks


def _index(path: Path) -> dict:
    return json.loads((path / ckptfs.INDEX_FILE).read_text())


def _chunks(path: Path, key: str) -> list[dict]:
    return _index(path)["tensors"][key]["chunks"]


def _state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"frozen": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "adapter": torch.randn(8, 8, generator=g), "step": 1,
            "table": torch.arange(40, dtype=torch.int32)}


def _saved_pair(tmp_path: Path) -> tuple[Path, Path, dict]:
    base, delta = tmp_path / "step_1", tmp_path / "step_2"
    state = _state()
    ckptfs.save(state, base, options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][3, 4] += 1.0  # changed in place by one element
    state["table"] = torch.arange(40, dtype=torch.int32)  # a new tensor of equal values
    state["step"] = 2
    ckptfs.save(state, delta, base=base)
    return base, delta, state


def test_a_delta_references_unchanged_chunks_and_rewrites_changed_ones(tmp_path):
    base, delta, state = _saved_pair(tmp_path)
    idx = _index(delta)
    assert "chunk_refs" in idx["required_features"] and idx["format_minor_version"] == 2
    assert idx["bases"] == [{"url": "../step_1"}]
    frozen, adapter, table = (_chunks(delta, k)[0] for k in ("frozen", "adapter", "table"))
    assert frozen["base"] == 0 and frozen == {**_chunks(base, "frozen")[0], "base": 0}
    assert table["base"] == 0  # equal values, a new tensor: the same bytes, referenced
    assert "base" not in adapter and adapter["hash"] != _chunks(base, "adapter")[0]["hash"]
    # only the changed tensor's bytes were written
    written = sum(idx["files"].values())
    assert 8 * 8 * 4 <= written < 8 * 8 * 4 + 1024 < 64 * 32 * 2
    out = ckptfs.load_keys(delta)
    for k in ("frozen", "adapter", "table"):
        assert torch.equal(out[k], state[k]) and out[k].dtype == state[k].dtype
    assert out["step"] == 2
    target = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
              for k, v in state.items()}
    result = ckptfs.load(target, delta)
    assert torch.equal(target["frozen"].view(torch.int16), state["frozen"].view(torch.int16))
    assert result.bytes_read == result.bytes_needed  # the bases' reads count too


def test_a_default_save_records_no_hash_and_a_hashless_base_is_never_referenced(tmp_path):
    state = _state()
    ckptfs.save(state, tmp_path / "plain")
    assert all("hash" not in c for t in _index(tmp_path / "plain")["tensors"].values()
               for c in t["chunks"])
    assert "format_minor_version" not in _index(tmp_path / "plain")
    ckptfs.save(state, tmp_path / "d", base=tmp_path / "plain")
    idx = _index(tmp_path / "d")
    assert "bases" not in idx and "chunk_refs" not in idx["required_features"]
    assert all("hash" in c and "base" not in c for t in idx["tensors"].values()
               for c in t["chunks"])


def test_a_changed_dtype_or_box_with_equal_bytes_is_rewritten(tmp_path):
    ckptfs.save({"x": torch.zeros(8, dtype=torch.int32)}, tmp_path / "b",
                options=ckptfs.SaveOptions(hashes=True))
    ckptfs.save({"x": torch.zeros(8, dtype=torch.float32)}, tmp_path / "d1", base=tmp_path / "b")
    ckptfs.save({"x": torch.zeros(2, 4, dtype=torch.int32)}, tmp_path / "d2", base=tmp_path / "b")
    for d in ("d1", "d2"):
        assert "base" not in _chunks(tmp_path / d, "x")[0]


def test_a_delta_of_a_delta_references_the_first_base_directly(tmp_path):
    _, delta, state = _saved_pair(tmp_path)
    third = tmp_path / "later" / "step_3"
    ckptfs.save(state, third, base=delta)
    idx = _index(third)
    urls = [b["url"] for b in idx["bases"]]
    assert sorted(urls) == ["../../step_1", "../../step_2"]
    frozen = _chunks(third, "frozen")[0]
    assert urls[frozen["base"]] == "../../step_1"
    assert urls[_chunks(third, "adapter")[0]["base"]] == "../../step_2"
    out = ckptfs.load_keys(third)
    assert all(torch.equal(out[k], state[k]) for k in ("frozen", "adapter", "table"))


def test_a_missing_base_file_raises_naming_the_key_and_the_base(tmp_path):
    base, delta, _ = _saved_pair(tmp_path)
    file = _chunks(base, "frozen")[0]["file"]
    os.remove(base / file)
    with pytest.raises(IntegrityError, match=r"'frozen'.*step_1/" + file):
        ckptfs.load_keys(delta, ["frozen"])


def test_a_base_changed_after_the_fact_fails_its_checksum(tmp_path):
    base, delta, _ = _saved_pair(tmp_path)
    c = _chunks(base, "frozen")[0]
    with open(base / c["file"], "r+b") as f:
        f.seek(c["byte_offset"] + 10)
        f.write(b"\x5a")
    with pytest.raises(IntegrityError, match="frozen"):
        ckptfs.load_keys(delta, ["frozen"])


def test_a_reader_without_the_feature_refuses_a_delta(tmp_path, monkeypatch):
    _, delta, _ = _saved_pair(tmp_path)
    monkeypatch.setattr(index_mod, "KNOWN_FEATURES", frozenset({"packed_chunks"}))
    with pytest.raises(FormatVersionError, match=r"\['chunk_refs'\] are unknown"):
        ckptfs.load_metadata(delta)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["tensors"]["frozen"]["chunks"][0].update(base=3), "base 3 is not a position"),
    (lambda d: d["tensors"]["frozen"]["chunks"][0].pop("hash"), "lacks 'hash'"),
    (lambda d: d["tensors"]["adapter"]["chunks"][0].update(hash="xxh3-128:12"), "not 'xxh3-128:'"),
    (lambda d: d.update(required_features=[]), "'bases' without the required feature"),
    (lambda d: d.pop("bases"), "required field 'bases'"),
])
def test_malformed_references_are_refused_naming_the_field(tmp_path, edit, message):
    _, delta, _ = _saved_pair(tmp_path)
    doc = _index(delta)
    doc.pop("index_checksum")
    edit(doc)
    with pytest.raises(MalformedIndexError, match=message):
        Index.from_dict(doc)


def test_an_index_with_references_round_trips(tmp_path):
    _, delta, _ = _saved_pair(tmp_path)
    raw = (delta / ckptfs.INDEX_FILE).read_bytes()
    index = Index.loads(raw)
    assert index.bases == ("../step_1",) and index.references
    assert Index.loads(index.dumps()).tensors == index.tensors


# -- 2 ranks save a base and a delta, 3 ranks load it ------------------------------------------

_ROWS = 12


def _full(changed: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    out = {"rows": torch.randn(_ROWS, 6, generator=g), "moving": torch.randn(_ROWS, 3, generator=g)}
    if changed:
        out["moving"][_ROWS - 1, 0] += 1.0
    return out


def _slices(world: int, rank: int) -> tuple[int, int]:
    per = -(-_ROWS // world)
    lo = min(rank * per, _ROWS)
    return lo, min(lo + per, _ROWS)


def _save_pair(rank: int, world: int, root: str) -> None:
    lo, hi = _slices(world, rank)
    for name, changed, base in (("step_1", False, None), ("step_2", True, f"{root}/step_1")):
        state = {k: ckptfs.ShardedTensor(v[lo:hi].clone(), tuple(v.shape), (lo, 0))
                 for k, v in _full(changed).items()}
        ckptfs.save(state, f"{root}/{name}", base=base,
                    options=ckptfs.SaveOptions(hashes=True))


def _load_three(rank: int, world: int, root: str) -> None:
    lo, hi = _slices(world, rank)
    full = _full(True)
    target = {k: ckptfs.ShardedTensor(torch.zeros(hi - lo, v.shape[1]), tuple(v.shape), (lo, 0))
              for k, v in full.items()}
    ckptfs.load(target, f"{root}/step_2")
    for k, v in full.items():
        assert torch.equal(target[k].local_tensor, v[lo:hi]), (rank, k)


@pytest.mark.slow
def test_two_ranks_save_a_delta_that_three_ranks_load_resharded(tmp_path):
    run_ranks(2, _save_pair, str(tmp_path))
    rows = _chunks(tmp_path / "step_2", "rows")
    moving = _chunks(tmp_path / "step_2", "moving")
    assert len(rows) == 2 and all(c["base"] == 0 for c in rows)
    # the rank whose slice holds the changed element rewrote its chunk; the other referenced
    assert [("base" in c) for c in moving] == [True, False]
    run_ranks(3, _load_three, str(tmp_path))


def test_the_schema_takes_a_delta_index_and_refuses_broken_references(tmp_path):
    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "formats" / "index.schema.json").read_text())
    check = jsonschema.Draft202012Validator(schema)
    _, delta, _ = _saved_pair(tmp_path)
    doc = _index(delta)
    assert check.is_valid(doc), list(check.iter_errors(doc))[:3]
    no_hash = json.loads(json.dumps(doc))
    del no_hash["tensors"]["frozen"]["chunks"][0]["hash"]
    no_feature = {**doc, "required_features": []}
    packed_too = {**doc, "required_features": ["chunk_refs", "packed_chunks"]}
    no_bases = {k: v for k, v in doc.items() if k != "bases"}
    for bad in (no_hash, no_feature, packed_too, no_bases):
        assert not check.is_valid(bad)


# -- the golden pair (index 1.2) and the tools ---------------------------------------------------

def test_the_golden_delta_loads_forever_and_references_its_base():
    from ckptfs.testing.conformance.cases import differences
    from ckptfs.testing.conformance.golden import decode, manifest_problems
    from ckptfs.testing.conformance.golden_index import delta_reference, golden_index_dir

    g = golden_index_dir(2)
    assert manifest_problems(g) == []
    expected = decode(json.loads((g / "expected.json").read_text(encoding="utf-8"))["state"])
    assert differences(expected, delta_reference()) == []
    assert differences(ckptfs.load_keys(g / "checkpoint"), expected) == []
    index = ckptfs.load_metadata(g / "checkpoint")
    assert index.bases == ("../base",) and index.format_minor_version == 2
    written = [k for k, t in index.tensors.items() for c in t.chunks if c.base is None]
    assert sorted(written) == ["keys/layers.0.weight", "sharded/rows"]
    assert ckptfs.load_metadata(g / "base").references is False


def test_the_golden_delta_reads_with_the_spec_reader():
    from ckptfs.testing.conformance.golden_index import delta_reference, golden_index_dir
    from tests import spec_reader

    root = golden_index_dir(2) / "checkpoint"
    idx = spec_reader.audit_index((root / ckptfs.INDEX_FILE).read_bytes())
    data = spec_reader.audit_data(str(root), idx)
    rows = delta_reference()["sharded"]["rows"]
    assert data["sharded/rows"] == rows.numpy().tobytes()


def test_verify_follows_references_and_checks_the_bytes_they_name(tmp_path):
    base, delta, _ = _saved_pair(tmp_path)
    report = ckptfs.verify(delta)
    assert report.ok, report.problems
    assert report.chunks_checksummed == report.chunks == 3
    c = _chunks(base, "frozen")[0]
    with open(base / c["file"], "r+b") as f:
        f.seek(c["byte_offset"] + 3)
        f.write(b"\x01\x02")
    report = ckptfs.verify(delta)
    assert [(p.kind, p.key) for p in report.problems] == [("checksum", "frozen")]
    assert report.problems[0].file == f"../step_1/{c['file']}"
    os.remove(base / c["file"])
    report = ckptfs.verify(delta)
    assert [p.kind for p in report.problems] == ["missing-file"]
    assert "base '../step_1'" in report.problems[0].message


def test_inspect_shows_bytes_written_and_referenced(tmp_path):
    from ckptfs.tools.describe import describe, render

    _, delta, _ = _saved_pair(tmp_path)
    doc = describe(str(delta), ckptfs.load_metadata(delta), False)
    refs = doc["references"]
    assert refs["written_bytes"] == 8 * 8 * 4
    assert refs["referenced_bytes"] == 64 * 32 * 2 + 40 * 4 and refs["referenced_chunks"] == 2
    assert refs["bases"] == {"../step_1": 64 * 32 * 2 + 40 * 4}
    assert "referenced in base(s) ../step_1" in render(doc)
    plain = describe("p", ckptfs.load_metadata(tmp_path / "step_1"), False)
    assert "references" not in plain


def test_convert_materializes_a_self_contained_copy(tmp_path):
    base, delta, state = _saved_pair(tmp_path)
    ckptfs.convert(delta, tmp_path / "copy", backend="safetensors_chunks")
    idx = _index(tmp_path / "copy")
    assert "bases" not in idx and "chunk_refs" not in idx["required_features"]
    for p in base.rglob("*"):
        if p.is_file():
            p.unlink()
    out = ckptfs.load_keys(tmp_path / "copy")
    assert all(torch.equal(out[k], state[k]) for k in ("frozen", "adapter", "table"))


# -- retention never deletes a step a kept step references --------------------------------------

def test_manager_retention_keeps_the_base_of_a_kept_delta(tmp_path):
    from ckptfs.manager.steps import step_dir

    url = str(tmp_path / "run")
    mgr = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(
        retention=ckptfs.Retention(keep_last=2),
        preemption=ckptfs.PreemptionPolicy(signals=())))
    try:
        state = _state()
        ckptfs.save(state, f"{url}/{step_dir(1)}", options=ckptfs.SaveOptions(hashes=True))
        state["adapter"] += 1.0
        ckptfs.save(state, f"{url}/{step_dir(2)}", base=f"{url}/{step_dir(1)}")
        mgr.save_sync(3, state)  # keeps 2 and 3; 2 references 1: 1 stays
        assert mgr.steps() == [1, 2, 3]
        out = ckptfs.load_keys(f"{url}/{step_dir(2)}")
        assert torch.equal(out["frozen"], state["frozen"])
        mgr.save_sync(4, state)  # keeps 3 and 4: neither references 1 or 2
        assert mgr.steps() == [3, 4]
    finally:
        mgr.close()


def test_manager_steps_saved_on_a_fixed_base_keep_it_through_retention(tmp_path):
    from ckptfs.manager.steps import step_dir

    url = str(tmp_path / "run")
    state = _state()

    def manager(save: ckptfs.SaveOptions) -> ckptfs.CheckpointManager:
        return ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(
            retention=ckptfs.Retention(keep_last=1), save=save,
            preemption=ckptfs.PreemptionPolicy(signals=())))

    first = manager(ckptfs.SaveOptions(hashes=True))
    try:
        first.save_sync(1, state)  # the frozen base, with hashes
    finally:
        first.close()
    assert all("hash" in c for c in _chunks(Path(url) / step_dir(1), "frozen"))
    later = manager(ckptfs.SaveOptions(base=f"{url}/{step_dir(1)}"))
    try:
        for step in (2, 3):
            state["adapter"] += 1.0
            later.save_sync(step, state)
        assert later.steps() == [1, 3]  # 3 is kept and references 1; 2 went
    finally:
        later.close()
    assert _chunks(Path(url) / step_dir(3), "frozen")[0]["base"] == 0
    assert _index(Path(url) / step_dir(3))["bases"] == [{"url": f"../{step_dir(1)}"}]
    out = ckptfs.load_keys(Path(url) / step_dir(3))
    assert torch.equal(out["adapter"], state["adapter"]) and torch.equal(out["frozen"], state["frozen"])


@pytest.mark.slow
@pytest.mark.parametrize("writer", ["thread", "process"])
def test_an_asynchronous_delta_save_references_as_a_synchronous_one(tmp_path, writer):
    state = _state()
    ckptfs.save(state, tmp_path / "b", options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][0, 0] += 1.0
    h = ckptfs.async_save(state, tmp_path / "d", writer=writer,
                          options=ckptfs.SaveOptions(base=str(tmp_path / "b")))
    h.result()
    ckptfs.close()
    assert "base" in _chunks(tmp_path / "d", "frozen")[0]
    assert "base" not in _chunks(tmp_path / "d", "adapter")[0]
    assert torch.equal(ckptfs.load_keys(tmp_path / "d")["adapter"], state["adapter"])


def test_an_index_of_many_hashed_chunks_is_written_with_chunk_objects():
    from ckptfs.layout.index import PACK_MIN_CHUNKS, ChunkEntry, TensorEntry

    n = PACK_MIN_CHUNKS
    chunks = tuple(ChunkEntry((i,), (1,), "data/f.safetensors", 8 + 4 * i, 4, "crc32c:00000000",
                              hash="xxh3-128:" + "0" * 32) for i in range(n))
    index = Index("safetensors_chunks", 1, {"x": TensorEntry("x", "float32", (n,), chunks)},
                  files={"data/f.safetensors": 8 + 4 * n},
                  file_checksums={"data/f.safetensors": "crc32c:00000000"})
    doc = json.loads(index.dumps()[:-1].rsplit(b', "index_checksum"', 1)[0] + b"}")
    assert "file_table" not in doc and "packed_chunks" not in doc["required_features"]
    assert Index.loads(index.dumps()).tensors["x"].chunks == chunks


def test_a_save_naming_itself_as_its_base_is_refused_and_the_checkpoint_kept(tmp_path):
    state = _state()
    ckptfs.save(state, tmp_path / "c", options=ckptfs.SaveOptions(hashes=True))
    with pytest.raises(ckptfs.ConfigError, match="names itself as its base"):
        ckptfs.save(state, tmp_path / "c", base=tmp_path / "c", overwrite=True)
    assert torch.equal(ckptfs.load_keys(tmp_path / "c")["frozen"], state["frozen"])


def test_diff_of_a_delta_and_its_base_reads_only_the_rewritten_chunks(tmp_path):
    base, delta, _ = _saved_pair(tmp_path)
    report = ckptfs.diff(delta, base)
    by_key = {k.key: k for k in report.keys}
    assert by_key["frozen"].status == "equal" and by_key["frozen"].from_checksums
    assert by_key["table"].status == "equal"
    assert by_key["adapter"].status == "differs" and by_key["adapter"].differing == 1
    assert report.bytes_read == 2 * 8 * 8 * 4  # the adapter, from both sides; nothing else


@pytest.mark.slow
def test_a_delta_on_s3_references_its_base_in_the_same_bucket(s3):
    base, delta = f"{s3.url}/run/step_1", f"{s3.url}/run/step_2"
    state = _state()
    ckptfs.save(state, base, storage_options=s3.options, options=ckptfs.SaveOptions(hashes=True))
    state["adapter"][0, 0] += 1.0
    ckptfs.save(state, delta, storage_options=s3.options, base=base)
    index = ckptfs.load_metadata(delta, storage_options=s3.options)
    assert index.bases == ("../step_1",)
    assert [k for k, t in index.tensors.items() for c in t.chunks if c.base is None] == ["adapter"]
    out = ckptfs.load_keys(delta, storage_options=s3.options)
    assert all(torch.equal(out[k], state[k]) for k in ("frozen", "adapter", "table"))
    report = ckptfs.verify(delta, storage_options=s3.options)
    assert report.ok and report.chunks_checksummed == 3, report.problems


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_pre_download_brings_the_bases_referenced_files_and_the_load_reads_them_there(tmp_path):
    base, delta, state = _saved_pair(tmp_path)
    work = tmp_path / "work"
    opts = ckptfs.LoadOptions(pre_download=True, work_dir=str(work))
    target = _zeros(state)
    result = ckptfs.load(target, delta, options=opts)
    for k in ("frozen", "adapter", "table"):
        assert torch.equal(target[k].view(torch.uint8), state[k].view(torch.uint8)), k
    assert result.bytes_read == result.bytes_needed  # read from the caches, references too
    # the base's referenced file lies in the base's own cache directory, beside the delta's
    from ckptfs.io.cache import cache_dir, read_marker
    marker = read_marker(cache_dir(work, str(base.resolve())))
    frozen = _chunks(delta, "frozen")[0]
    assert marker is not None and frozen["file"] in marker.files
    # the data files gone at the URL: a second load reads every byte from the caches
    for root in (base, delta):
        os.rename(root / "data", root / "gone")
    again = _zeros(state)
    ckptfs.load(again, delta, options=opts)
    for k in ("frozen", "adapter", "table"):
        assert torch.equal(again[k].view(torch.uint8), state[k].view(torch.uint8)), k
    # without the caches the load needs the URL's files, and says which one is missing
    os.rename(delta / "gone", delta / "data")
    with pytest.raises(IntegrityError, match="step_1"):
        ckptfs.load(_zeros(state), delta)


class _Read:
    def __init__(self, n: int) -> None:
        self.n = n

    def get(self) -> int:
        return self.n


class _CuFile:
    """``kvikio.CuFile`` as ``DirectReads`` uses it, reading into a CPU byte tensor."""

    def __init__(self, path: str, mode: str) -> None:
        self.f = open(path, "rb")  # closed by __exit__

    def __enter__(self) -> _CuFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()

    def pread(self, dst: torch.Tensor, n: int, offset: int) -> _Read:
        data = os.pread(self.f.fileno(), n, offset)
        dst[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _Read(len(data))


class _Kvikio:
    CuFile = _CuFile


def test_gds_reads_a_reference_from_its_base_file_and_leaves_a_remote_base_to_the_ring(tmp_path):
    from ckptfs.engine.load.bases import BasesStore, with_bases
    from ckptfs.engine.load.gds import DirectReads, gds_unavailable
    from ckptfs.engine.load.pre_download import CachedStore
    from ckptfs.io import open_store, run_sync
    from ckptfs.io.local_store import LocalStore
    from ckptfs.layout.boxes import full_box
    from ckptfs.planning.load_plan import plan_reads

    base, delta, state = _saved_pair(tmp_path)
    index = Index.loads((delta / ckptfs.INDEX_FILE).read_bytes())
    keys = ("frozen", "adapter")

    async def go() -> None:
        store = await open_store(str(delta))
        entries = [index.tensors[k] for k in keys]
        routed = await with_bases(store, [plan_reads(e, full_box(e.shape)) for e in entries])
        assert routed is not None
        bases, pieces = routed
        direct = DirectReads(store, _Kvikio()).through(bases)
        got = {}
        for k, (p,) in zip(keys, pieces, strict=True):
            got[k] = torch.empty(state[k].numel() * state[k].element_size(), dtype=torch.uint8)
            assert direct.take(p.chunk.file, p.chunk.byte_offset, got[k])
        assert direct.paths[pieces[0][0].chunk.file] == str(base / _chunks(delta, "frozen")[0]["file"])
        await direct.run(bases, lambda *a: AssertionError(a), {})
        for k in keys:
            assert torch.equal(got[k], state[k].reshape(-1).view(torch.uint8)), k
        # a base served by a store of another kind is not read directly (the ring reads it)
        memory = await open_store("memory://gds-base")
        far = BasesStore(store, {pieces[0][0].chunk.file: (memory, "x")}, ())
        assert not DirectReads(store, _Kvikio()).through(far).take(
            pieces[0][0].chunk.file, 0, torch.empty(4, dtype=torch.uint8))
        await bases.close()
        await store.close()

    run_sync(go())
    # a pre-downloaded delta is served from local files: GDS may read it
    cached = CachedStore(LocalStore(str(tmp_path)), str(delta), {})
    assert "not a local filesystem" not in (gds_unavailable(cached, verify=False) or "")


def test_chunks_are_hashed_on_helper_threads_with_the_hashes_one_thread_gives(monkeypatch):
    import threading

    from ckptfs.engine.save import delta as delta_mod
    from ckptfs.layout.backend import ChunkData
    from ckptfs.layout.boxes import full_box
    from ckptfs.layout.content_hash import content_hash
    from ckptfs.layout.dtypes import from_torch
    from ckptfs.layout.tensor_bytes import tensor_bytes

    g = torch.Generator().manual_seed(9)
    tensors = {f"big{i}": torch.randn(2**18 + i, generator=g) for i in range(3)}  # 1 MiB and more
    tensors |= {f"small{i}": torch.randn(100, generator=g) for i in range(4)}
    tensors["bf16"] = torch.randn(2**20, generator=g).bfloat16()
    chunks = [ChunkData(k, from_torch(t.dtype, k), tuple(t.shape), full_box(t.shape), t)
              for k, t in tensors.items()]
    where: dict[int, int] = {}

    def spying(data):
        where[memoryview(data).nbytes] = threading.get_ident()
        return content_hash(data)

    monkeypatch.setattr(delta_mod, "content_hash", spying)
    got = delta_mod.hash_chunks(chunks, threads=2)
    assert got == {(c.key, c.box.offsets, c.box.shape): content_hash(tensor_bytes(c.data))
                   for c in chunks}
    me = threading.get_ident()
    assert all(where[t.nbytes] != me for k, t in tensors.items() if not k.startswith("small"))
    assert all(where[t.nbytes] == me for k, t in tensors.items() if k.startswith("small"))
    assert delta_mod.hash_chunks(chunks, threads=1) == got
