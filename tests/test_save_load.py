"""Single-process save/load: dtypes, values, optimizer state, errors, overwrite, integrity."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import ckptfs
from ckptfs.layout.dtypes import NAMES, from_name


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {}
    for name in NAMES:
        dt = from_name(name).torch
        base = torch.randn(3, 4, generator=g) * 5
        if dt == torch.bool:
            t = base > 0
        elif dt == torch.complex64:
            t = torch.complex(base, -base)
        else:
            t = base.to(dt)
        out[name] = t
    return out


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def adamw_state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_every_dtype_and_value_round_trips(tmp_path):
    sd = {
        "t": every_dtype(),
        "zero_d": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "values": {"none": None, "b": True, "i": -(2**62), "f": 0.1, "nan": math.nan,
                   "inf": math.inf, "ninf": -math.inf, "s": "héllo/wörld.x", 7: "int key",
                   "0": "str key that looks like an int", "tup": (1, (2, [3, {}])), "l": []},
        "odd/key.with.dots": torch.arange(3),
    }
    ckptfs.save(sd, tmp_path / "c")
    back = ckptfs.load_keys(tmp_path / "c")
    assert same(sd, back)
    assert back["values"][7] == "int key" and back["values"]["0"].startswith("str")
    meta = ckptfs.load_metadata(tmp_path / "c")
    assert meta.backend == "safetensors_chunks" and meta.backend_version == 1
    assert meta.tensors["t/bfloat16"].dtype == "bfloat16"
    assert meta.tensors["odd%2Fkey.with.dots"].shape == (3,)
    assert meta.tensors["empty"].chunks == ()


def test_adamw_round_trip_with_types(tmp_path):
    model, opt = adamw_state()
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    ckptfs.save(sd, tmp_path / "c")
    back = ckptfs.load_keys(tmp_path / "c", ["optim"])
    want = opt.state_dict()
    assert list(back) == ["optim"]
    assert set(back["optim"]["state"]) == {0, 1, 2, 3}  # int keys stay ints
    assert back["optim"]["param_groups"][0]["betas"] == want["param_groups"][0]["betas"]
    assert isinstance(back["optim"]["param_groups"][0]["betas"], tuple)
    assert same(want["state"], back["optim"]["state"])

    # in place, into a fresh model and an optimizer that has stepped once (state allocated)
    model2, opt2 = adamw_state()
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    opt2.param_groups[0]["lr"] = 0.5
    target = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    res = ckptfs.load(target, tmp_path / "c")
    assert res.missing_keys == [] and res.unexpected_keys == []
    opt2.load_state_dict(target["optim"])
    assert opt2.param_groups[0]["lr"] == 1e-3
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert same(opt.state_dict()["state"], opt2.state_dict()["state"])


def test_missing_and_unexpected_keys(tmp_path):
    ckptfs.save({"a": torch.ones(2), "b": torch.ones(3), "v": 1}, tmp_path / "c")
    target = {"a": torch.zeros(2), "c": torch.zeros(1), "w": 0}
    with pytest.raises(ckptfs.MissingKeysError, match="'c'") as e:
        ckptfs.load(target, tmp_path / "c")
    assert e.value.keys == ["c", "w"]
    assert torch.equal(target["a"], torch.zeros(2))  # strict refuses before reading anything
    res = ckptfs.load(target, tmp_path / "c", strict=False)
    assert res.missing_keys == ["c", "w"] and res.unexpected_keys == ["b", "v"]
    assert torch.equal(target["a"], torch.ones(2)) and target["w"] == 0


@pytest.mark.parametrize("target,match", [
    ({"a": torch.zeros(2, 3)}, r"key 'a'.*float32 \[2, 2\].*float32 \[2, 3\]"),
    ({"a": torch.zeros(2, 2, dtype=torch.float64)}, r"key 'a'.*float32.*float64"),
    ({"a": 3}, r"key 'a': the target holds a value"),
    ({"v": torch.zeros(1)}, r"key 'v': the target holds a tensor"),
])
def test_mismatch_errors_name_the_key(tmp_path, target, match):
    ckptfs.save({"a": torch.ones(2, 2), "v": "x"}, tmp_path / "c")
    with pytest.raises(ckptfs.MismatchError, match=match):
        ckptfs.load(target, tmp_path / "c", strict=False)


def test_unsupported_values_name_the_key(tmp_path):
    with pytest.raises(ckptfs.UnsupportedValueError, match=r"key 'opt/sched'.*object"):
        ckptfs.save({"opt": {"sched": object()}}, tmp_path / "c")
    with pytest.raises(ckptfs.UnsupportedValueError, match=r"key 'x'.*uint16"):
        ckptfs.save({"x": torch.zeros(2, dtype=torch.uint16)}, tmp_path / "c")
    with pytest.raises(ckptfs.UnsupportedValueError, match="dict keys must be str or int"):
        ckptfs.save({"m": {(1, 2): 3}}, tmp_path / "c")
    assert not os.path.exists(tmp_path / "c" / ckptfs.INDEX_FILE)


def test_overwrite_refused_and_first_checkpoint_intact(tmp_path):
    url = tmp_path / "c"
    ckptfs.save({"a": torch.ones(4)}, url)
    before = {p: open(os.path.join(d, p), "rb").read()
              for d, _, fs in os.walk(url) for p in fs}
    with pytest.raises(ckptfs.CheckpointExistsError, match="overwrite=True"):
        ckptfs.save({"a": torch.zeros(4)}, url)
    after = {p: open(os.path.join(d, p), "rb").read() for d, _, fs in os.walk(url) for p in fs}
    assert before == after
    t = {"a": torch.zeros(4)}
    ckptfs.load(t, url)
    assert torch.equal(t["a"], torch.ones(4))
    # overwrite replaces it and removes the old data files
    ckptfs.save({"a": torch.full((4,), 2.0)}, url, overwrite=True)
    ckptfs.load(t, url)
    assert torch.equal(t["a"], torch.full((4,), 2.0))
    files = [os.path.join(d, p) for d, _, fs in os.walk(url) for p in fs]
    assert len(files) == 2, files  # new data file + index


def test_missing_index_and_unknown_versions(tmp_path):
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="ckptfs.index.json"):
        ckptfs.load({"a": torch.zeros(1)}, tmp_path / "nothing")
    url = tmp_path / "c"
    ckptfs.save({"a": torch.ones(1)}, url)
    path = url / ckptfs.INDEX_FILE
    good = json.loads(path.read_text())

    def with_(**change):
        d = json.loads(json.dumps(good))
        d.pop("index_checksum")  # edited by hand: no longer sealed
        for k, v in change.items():
            d[k] = v
        path.write_text(json.dumps(d))

    with_(format_version=2)
    with pytest.raises(ckptfs.FormatVersionError, match=r"format_version 2.*supported format versions: \[1\]"):
        ckptfs.load_metadata(url)
    with_(required_features=["sparse-chunks"])
    with pytest.raises(ckptfs.FormatVersionError, match=r"'sparse-chunks'.*known features"):
        ckptfs.load({"a": torch.zeros(1)}, url)
    with_(backend={"name": "safetensors_chunks", "version": 9})
    with pytest.raises(ckptfs.UnknownBackendError, match=r"safetensors_chunks-9.*registered backends:.*safetensors_chunks-1"):
        ckptfs.load({"a": torch.zeros(1)}, url)
    with_(some_future_optional_field={"x": 1})
    t = {"a": torch.zeros(1)}
    ckptfs.load(t, url)
    assert t["a"].item() == 1.0
    path.write_text("{not json")
    with pytest.raises(ckptfs.MalformedIndexError, match="not valid JSON"):
        ckptfs.load_metadata(url)


def test_corrupted_chunk_is_detected(tmp_path):
    url = tmp_path / "c"
    ckptfs.save({"a": torch.arange(100, dtype=torch.float32)}, url)
    chunk = ckptfs.load_metadata(url).tensors["a"].chunks[0]
    p = url / chunk.file
    raw = bytearray(p.read_bytes())
    raw[chunk.byte_offset + 17] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(ckptfs.IntegrityError, match=r"key 'a'.*checksum"):
        ckptfs.load({"a": torch.zeros(100)}, url)
    t = {"a": torch.zeros(100)}
    ckptfs.load(t, url, options=ckptfs.LoadOptions(verify=False))  # opt-out reads the (corrupt) bytes
    assert not torch.equal(t["a"], torch.arange(100, dtype=torch.float32))


def test_a_chunk_read_in_waves_is_checked_whole(tmp_path):
    """A chunk larger than a wave is read into its target in parts whose CRCs are combined as
    they arrive: every part is read, a flipped byte in any part fails the whole chunk."""
    waves = ckptfs.LoadOptions(read_wave=256)
    url = tmp_path / "c"
    src = {"a": torch.randn(1000), "b": torch.randn(10)}  # "a": 4000 bytes, 16 parts
    ckptfs.save(src, url)
    t = {"a": torch.zeros(1000), "b": torch.zeros(10)}
    res = ckptfs.load(t, url, options=waves)
    assert torch.equal(t["a"], src["a"]) and torch.equal(t["b"], src["b"])
    assert res.read_requests >= 16  # one request per wave at least
    chunk = ckptfs.load_metadata(url).tensors["a"].chunks[0]
    p = url / chunk.file
    good = p.read_bytes()
    for pos in (0, 1500, 3999):
        raw = bytearray(good)
        raw[chunk.byte_offset + pos] ^= 0x10
        p.write_bytes(bytes(raw))
        with pytest.raises(ckptfs.IntegrityError, match=r"key 'a'.*fails its checksum"):
            ckptfs.load({"a": torch.zeros(1000), "b": torch.zeros(10)}, url, options=waves)
    p.write_bytes(good)


def test_truncated_file_names_the_file(tmp_path):
    url = tmp_path / "c"
    ckptfs.save({"a": torch.arange(1000, dtype=torch.float32)}, url)
    chunk = ckptfs.load_metadata(url).tensors["a"].chunks[0]
    p = url / chunk.file
    p.write_bytes(p.read_bytes()[:-100])
    with pytest.raises(ckptfs.IntegrityError, match=rf"key\(s\) 'a': {chunk.file}: the data file is truncated"):
        ckptfs.load({"a": torch.zeros(1000)}, url)


def test_memory_url_and_views(memfs):
    big = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    sd = {"view": big[2:4], "col": big[:, 3], "t": big.t()}
    ckptfs.save(sd, "memory://ck/one")
    back = ckptfs.load_keys("memory://ck/one")
    assert torch.equal(back["view"], big[2:4]) and torch.equal(back["col"], big[:, 3])
    assert torch.equal(back["t"], big.t())
    # only the view's bytes are stored, not its whole backing storage
    assert ckptfs.load_metadata("memory://ck/one").tensors["view"].chunks[0].byte_length == 64
    # load into non-contiguous targets
    target = {"view": torch.zeros(8, 2).t(), "col": torch.zeros(8), "t": torch.zeros(8, 8)}
    ckptfs.load(target, "memory://ck/one")
    assert torch.equal(target["view"], big[2:4]) and torch.equal(target["t"], big.t())
    assert ckptfs.delete("memory://ck/one") == 2
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata("memory://ck/one")


def test_sharded_tensor_must_tile(tmp_path):
    st = ckptfs.ShardedTensor(torch.ones(2, 4), (4, 4), (0, 0))
    with pytest.raises(ckptfs.ShardingError, match=r"key 'w'.*cover 8 of 16 elements"):
        ckptfs.save({"w": st}, tmp_path / "c")
    with pytest.raises(ckptfs.ShardingError, match="does not fit"):
        ckptfs.ShardedTensor(torch.ones(3, 4), (4, 4), (2, 0))
    assert not (tmp_path / "c" / ckptfs.INDEX_FILE).exists()


def test_unknown_backend_lists_registered(tmp_path):
    with pytest.raises(ckptfs.UnknownBackendError, match="registered backends:.*safetensors_chunks-1"):
        ckptfs.save({"a": torch.ones(1)}, tmp_path / "c", backend="nope")
    assert ("safetensors_chunks", 1) in ckptfs.available_backends()


def test_scratch_memory_is_bounded(tmp_path):
    """Targets that cannot be filled in place get scratch buffers, at most the budget at once
    (LoadOptions.scratch_bytes); LoadResult.scratch_peak reports the most held."""
    src = {f"w{i}": torch.randn(16, 16) for i in range(6)}  # 1 KiB each
    ckptfs.save(src, tmp_path / "c")
    target = {k: torch.zeros(16, 16).t() for k in src}  # transposed: never contiguous in place
    res = ckptfs.load(target, tmp_path / "c", options=ckptfs.LoadOptions(scratch_bytes=3000))
    assert all(torch.equal(target[k], src[k]) for k in src)
    assert 1024 <= res.scratch_peak <= 3000
    unbounded = ckptfs.load(target, tmp_path / "c")
    assert unbounded.scratch_peak == 6 * 1024  # one file, one batch: all six at once
    contiguous = ckptfs.load({k: torch.zeros(16, 16) for k in src}, tmp_path / "c")
    assert contiguous.scratch_peak == 0  # read in place


def test_scratch_budget_holds_while_files_are_read_at_once(tmp_path):
    """Six files read concurrently (one 1 KiB tensor each), into transposed targets that need
    scratch: with a 3000-byte budget the reads of different files wait for each other's
    scratch, so at most 2 KiB is held at once (more than one file at a time, never three)."""
    src = {f"w{i}": torch.randn(16, 16) for i in range(6)}
    ckptfs.save(src, tmp_path / "c", backend_options={"max_file_bytes": 1500})
    assert len(ckptfs.load_metadata(tmp_path / "c").files) == 6
    target = {k: torch.zeros(16, 16).t() for k in src}
    res = ckptfs.load(target, tmp_path / "c", options=ckptfs.LoadOptions(scratch_bytes=3000))
    assert all(torch.equal(target[k], src[k]) for k in src)
    assert 1024 < res.scratch_peak <= 3000, res.scratch_peak
    unbounded = ckptfs.load(target, tmp_path / "c")
    assert unbounded.scratch_peak == 6 * 1024  # without the bound, all six files' at once


def test_index_paths_cannot_leave_the_root(tmp_path):
    url = tmp_path / "c"
    ckptfs.save({"a": torch.ones(3)}, url)
    path = url / ckptfs.INDEX_FILE
    d = json.loads(path.read_text())
    d.pop("index_checksum")  # edited by hand: no longer sealed
    (tmp_path / "secret.bin").write_bytes(b"\0" * 64)
    for bad in ("../secret.bin", "/etc/passwd", "data/../../secret.bin", "a//b"):
        d["tensors"]["a"]["chunks"][0]["file"] = bad
        path.write_text(json.dumps(d))
        with pytest.raises(ckptfs.MalformedIndexError, match=r"tensors\['a'\].chunks\[0\].file"):
            ckptfs.load({"a": torch.zeros(3)}, url)


def test_bad_backend_option_is_a_ckptfs_error(tmp_path):
    with pytest.raises(ckptfs.BackendOptionsError, match=r"unknown option\(s\) \['nope'\]"):
        ckptfs.save({"a": torch.ones(1)}, tmp_path / "c", backend_options={"nope": 1})


def test_overwrite_with_another_backend_leaves_no_stale_files(tmp_path):
    url = tmp_path / "c"
    ckptfs.save({"a": torch.ones(4), "v": 1}, url, backend="torch_dist")
    ckptfs.save({"a": torch.full((4,), 3.0)}, url, backend="zarr", backend_version=3,
                overwrite=True)
    files = sorted(str(p.relative_to(url)) for p in url.rglob("*") if p.is_file())
    assert not any(f.endswith(".distcp") or f == ".metadata" for f in files), files
    back = ckptfs.load_keys(url)
    assert list(back) == ["a"] and torch.equal(back["a"], torch.full((4,), 3.0))


def test_str_keyed_checkpoint_fills_int_keyed_target(tmp_path):
    # DCP and other str-keyed writers store optimizer state under "0", "1", ...
    ckptfs.save({"state": {"0": {"m": torch.ones(2)}, "1": {"step": 5}}}, tmp_path / "c")
    target = {"state": {0: {"m": torch.zeros(2)}, 1: {"step": 0}}}
    res = ckptfs.load(target, tmp_path / "c")
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert torch.equal(target["state"][0]["m"], torch.ones(2)) and target["state"][1]["step"] == 5


@pytest.fixture
def own_registry():
    """Backends registered by a test are gone after it."""
    from ckptfs.layout import registry
    from ckptfs.runtime import RUNTIME

    with RUNTIME.swapped(registry.BACKENDS, registry.BackendRegistry()):
        yield


def test_local_commit_is_create_if_absent(tmp_path, own_registry):
    """Another writer's index appears at the root between the save's check and its commit (a
    backend's finalize hook plants it, the last step before the commit): the commit refuses to
    replace it, the rival index is left as it was, and this save's data files are removed."""
    from ckptfs.layout.backend import FileWrite, FinalFiles
    from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend

    rival = b'{"written by": "another save"}'

    class CommitRace(SafetensorsChunksBackend):
        name, version = "commit_race", 1

        def finalize(self, index, *args):
            return FinalFiles(super().finalize(index, *args).all(),
                              FileWrite(ckptfs.INDEX_FILE, (rival,)))

    ckptfs.register_backend("commit_race", 1, CommitRace)
    url = tmp_path / "c"
    with pytest.raises(ckptfs.CheckpointExistsError, match=f"{ckptfs.INDEX_FILE} appeared"):
        ckptfs.save({"w": torch.ones(8)}, url, backend="commit_race")
    assert (url / ckptfs.INDEX_FILE).read_bytes() == rival
    assert [p.name for p in url.rglob("*") if p.is_file()] == [ckptfs.INDEX_FILE]


def test_file_urls(tmp_path):
    url = f"file://{tmp_path}/c"
    sd = {"w": torch.arange(5.0), "step": 3}
    ckptfs.save(sd, url)
    assert (tmp_path / "c" / ckptfs.INDEX_FILE).is_file()  # the path after file://
    tgt = {"w": torch.zeros(5), "step": 0}
    ckptfs.load(tgt, tmp_path / "c")
    assert torch.equal(tgt["w"], sd["w"]) and tgt["step"] == 3
    assert torch.equal(ckptfs.load_keys(url)["w"], sd["w"])
    assert ckptfs.load_metadata(url).tensors["w"].shape == (5,)
    assert ckptfs.delete(url) == 2
    assert not [p for p in (tmp_path / "c").rglob("*") if p.is_file()]


def test_progress_bar(tmp_path, capsys):
    """progress=True shows a byte-counting bar for the save on stderr; the default shows none."""
    sd = {"w": torch.ones(1000)}
    ckptfs.save(sd, tmp_path / "quiet")
    assert "ckptfs save" not in capsys.readouterr().err
    ckptfs.save(sd, tmp_path / "loud", progress=True)
    err = capsys.readouterr().err
    assert f"ckptfs save {tmp_path / 'loud'}" in err, err
