"""Megatron-Core interop without Megatron installed (the live test is ``make interop``).

Reading: checkpoints written by the real megatron-core 0.19.2 (torch_dist, common state inside
DCP) and 0.15.3 (torch_dist and zarr, with ``common.pt``) on 3 gloo ranks are committed under
tests/fixtures/megatron/ with their expected contents (tests/fixtures/megatron/make_fixtures.py
writes both, and checked them against Megatron's own readers). ckptfs must read every tensor
bit-exactly, resharded, with the common state at the paths Megatron's ``load`` gives it and each
ShardedObject under its unique key; a strict ``ckptfs.load`` of a Megatron-shaped target works.
Common-state values ckptfs cannot represent are errors naming the file and the class, and a
smuggled global never runs.

Writing: ``backend_options={"megatron": ...}`` writes ``metadata.json`` (last) and the common
state in the form Megatron reads (checked with torch's own readers here, with Megatron in the
live test). Everything runs in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

import ckptfs
from ckptfs.io.local_store import LocalStore
from ckptfs.testing.conformance.cases import assert_same
from ckptfs.testing.conformance.golden import decode
from tests.test_torch_dist import _Evil

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "megatron"
NAMES = ["mcore-0.19.2-torch_dist", "mcore-0.15.3-torch_dist", "mcore-0.15.3-zarr"]
FAST = ckptfs.StoreOptions(max_gap=0)


def fixture(name: str) -> tuple[Path, dict]:
    doc = json.loads((FIXTURES / name / "expected.json").read_text())
    return FIXTURES / name / "checkpoint", decode(doc["state"])


# -- reading what Megatron wrote -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_fixture_reads_as_megatron_wrote_it(name):
    root, want = fixture(name)
    assert_same(ckptfs.load_keys(root), want, name)
    idx = ckptfs.load_metadata(root)
    assert idx.backend == ("zarr" if name.endswith("zarr") else "torch_dist")
    assert {k for k, v in want.items() if isinstance(v, torch.Tensor)} == set(idx.tensors)
    assert idx.values["optimizer/state/0/step"] == 42  # an int key, as Megatron keeps it
    assert idx.values["iteration"] == 100 and idx.containers["optimizer/param_groups/0/betas"] == "tuple"
    assert ckptfs.load_keys(root, ["optimizer/param_groups"]) == {
        "optimizer": {"param_groups": want["optimizer"]["param_groups"]}}


def _blank(v):
    """A target of the same structure with other contents."""
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return type(v)(_blank(x) for x in v)
    return {bool: False, int: -1, float: -1.0, str: "", type(None): "x"}[type(v)]


@pytest.mark.parametrize("name", NAMES)
def test_fixture_resharded_into_megatron_shaped_targets(name):
    """2 and 1 "ranks" with splits Megatron's 3 ranks did not use, each a strict load of a
    target holding every tensor shard and the whole common state."""
    root, want = fixture(name)
    tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    common = {k: v for k, v in want.items() if not isinstance(v, torch.Tensor)}
    for world in (2, 1):
        for rank in range(world):
            target = _blank(common)
            for k, t in tensors.items():
                n = t.shape[0]
                lo, hi = rank * n // world, (rank + 1) * n // world
                target[k] = ckptfs.ShardedTensor(torch.zeros_like(t[lo:hi]), tuple(t.shape),
                                                 (lo, *[0] * (t.dim() - 1)))
            res = ckptfs.load(target, root, store_options=FAST)
            assert not res.missing_keys
            for k, t in tensors.items():
                st = target.pop(k)
                lo = st.global_offset[0]
                assert_same(st.local_tensor, t[lo:lo + st.local_tensor.shape[0]], f"{name} {k}")
            assert_same(target, common, name)


def test_megatron_layout_of_0_19_is_what_the_reader_assumes():
    """0.19 stores the common state as DCP item common_state/shard_0_1 = torch.save([dict])
    and writes no common.pt (so the fixture exercises that path)."""
    root, _ = fixture("mcore-0.19.2-torch_dist")
    md = FileSystemReader(str(root)).read_metadata()
    byte_items = {k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    assert byte_items == {"common_state/shard_0_1", *[f"data_iterator/shard_{r}_3" for r in range(3)]}
    assert not (root / "common.pt").exists()
    assert json.loads((root / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1}


# -- refusing what ckptfs cannot represent ---------------------------------------------------------


class _MCoreLikeSavePlanner(DefaultSavePlanner):
    """As Megatron's MCoreSavePlanner: BytesIO objects are written as they are."""

    def transform_object(self, write_item, object):
        return object


def _mcore_019(path: Path, common: object, objects: dict | None = None) -> Path:
    """A checkpoint with 0.19's layout (DCP, common state as a one-item-list BYTE_IO item)."""
    def blob(obj) -> io.BytesIO:
        bio = io.BytesIO()
        torch.save(obj, bio)
        bio.seek(0)
        return bio

    sd = {"decoder.weight": torch.arange(6.0).reshape(2, 3), "common_state/shard_0_1": blob([common]),
          **{k: blob([v]) for k, v in (objects or {}).items()}}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True, planner=_MCoreLikeSavePlanner())
    (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                    "sharded_backend_version": 1}))
    return path


def test_common_state_values_ckptfs_cannot_represent_are_errors(tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    common = {"iteration": 5, "args": argparse.Namespace(lr=1.0), "rng": torch.ones(2),
              "evil": _Evil(str(marker)), "ok": {"n": 1}}
    d = _mcore_019(tmp_path / "m19", common)
    # torch's weights_only allowlist (importing megatron.core extends it) is not ckptfs's
    with torch.serialization.safe_globals([argparse.Namespace]), \
            pytest.raises(ckptfs.ForbiddenGlobalError) as err:
        ckptfs.load_metadata(d)
    msg = str(err.value)
    assert re.search(r"__0_0\.distcp \(item 'common_state/shard_0_1'\)", msg), msg
    for what in ("args (argparse.Namespace)", "rng (torch.Tensor)",
                 "evil (tests.test_torch_dist._side_effect)", "CKPTFS_MEGATRON_COMMON=skip"):
        assert what in msg, (what, msg)
    with pytest.raises(ckptfs.ForbiddenGlobalError):
        ckptfs.load({"decoder.weight": torch.zeros(2, 3)}, d)
    monkeypatch.setenv("CKPTFS_MEGATRON_COMMON", "skip")
    with pytest.warns(UserWarning, match=r"3 common-state value\(s\) left out"):
        out = ckptfs.load_keys(d)
    assert out["iteration"] == 5 and out["ok"] == {"n": 1} and "args" not in out
    assert not marker.exists()


def test_zarr_common_pt_with_a_smuggled_global_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    root = tmp_path / "z"
    shutil.copytree(FIXTURES / "mcore-0.15.3-zarr" / "checkpoint", root)
    torch.save({"iteration": 1, "evil": _Evil(str(marker))}, root / "common.pt")
    with pytest.raises(ckptfs.ForbiddenGlobalError,
                       match=r"common\.pt: .*evil \(tests\.test_torch_dist\._side_effect\)"):
        ckptfs.load_metadata(root)
    (root / "common.pt").write_bytes(b"not a zip")
    with pytest.raises(ckptfs.MalformedIndexError, match=r"common\.pt: not a torch\.save zip"):
        ckptfs.load_metadata(root)
    assert not marker.exists()
    torch.load(io.BytesIO(_save_bytes(_Evil(str(marker)))), weights_only=False)  # the payload is live
    assert marker.exists()


def _save_bytes(obj) -> bytes:
    bio = io.BytesIO()
    torch.save(obj, bio)
    return bio.getvalue()


def test_sharded_objects_with_foreign_values_are_left_out_with_a_warning(tmp_path):
    marker = tmp_path / "pwned"
    d = _mcore_019(tmp_path / "m19", {"iteration": 1},
                   {"rng/shard_0_1": {"seed": 3}, "te/shard_0_1": _Evil(str(marker))})
    with pytest.warns(UserWarning, match=r"te%2Fshard_0_1 \(tests\.test_torch_dist\._side_effect\)"):
        out = ckptfs.load_keys(d)
    assert out["rng/shard_0_1"] == {"seed": 3} and "te/shard_0_1" not in out
    assert not marker.exists()


# -- writing for Megatron --------------------------------------------------------------------------


def state() -> dict:
    return {
        "decoder": {"weight": torch.arange(12.0).reshape(4, 3), "bias": torch.ones(3)},
        "optimizer": {"state": {0: {"exp_avg": torch.full((4, 3), 0.5), "step": 9}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]},
        "layers": [torch.zeros(2), torch.ones(2)],  # only tensors: left out of the common state
        "step": 9, "nan": math.nan, "empty": {}, "name": "run",
    }


#: what Megatron's save would put in the common state for state() (written out by hand)
COMMON = {"optimizer": {"state": {0: {"step": 9}},
                        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0, 1]}]},
          "step": 9, "nan": math.nan, "empty": {}, "name": "run"}
FQNS = {"decoder.weight", "decoder.bias", "optimizer.state.0.exp_avg", "layers.0", "layers.1"}


@pytest.mark.parametrize("form", [True, "common_state", "common.pt"])
def test_save_for_megatron_writes_what_its_load_reads(tmp_path, form):
    d = tmp_path / "ck"
    ckptfs.save(state(), d, backend="torch_dist", backend_options={"megatron": form})
    expected_form = "common_state" if form is True else form
    cfg = json.loads((d / "metadata.json").read_text())
    assert cfg["sharded_backend"] == "torch_dist" and cfg["sharded_backend_version"] == 1
    assert ("common_backend" in cfg) == (expected_form == "common.pt")
    md = FileSystemReader(str(d)).read_metadata()
    tensors = {k for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    byte_items = set(md.state_dict_metadata) - tensors
    assert tensors == FQNS
    if expected_form == "common_state":  # Megatron's load_common_state_dict, step by step
        assert byte_items == {"common_state/shard_0_1"}
        pyt = {"common_state/shard_0_1": io.BytesIO()}
        dcp.load(pyt, storage_reader=FileSystemReader(str(d)), no_dist=True)
        loaded = pyt["common_state/shard_0_1"]
        if isinstance(loaded, io.BytesIO):
            loaded.seek(0)
            loaded = torch.load(loaded, weights_only=True)
        assert_same(loaded, [COMMON])
        blob = _item_bytes(d, md, "common_state/shard_0_1")
        assert_same(torch.load(io.BytesIO(blob), weights_only=True), [COMMON])
        assert not (d / "common.pt").exists()
    else:
        assert byte_items == set()
        assert_same(torch.load(d / "common.pt", weights_only=True), COMMON)
    # Megatron's torch_dist strategy: flat FQNs, flatten_state_dict=False
    flat = {"decoder.weight": torch.zeros(4, 3), "optimizer.state.0.exp_avg": torch.zeros(4, 3)}
    dcp.load(flat, storage_reader=FileSystemReader(str(d)), no_dist=True,
             planner=DefaultLoadPlanner(flatten_state_dict=False))
    assert torch.equal(flat["decoder.weight"], state()["decoder"]["weight"])
    assert torch.equal(flat["optimizer.state.0.exp_avg"], torch.full((4, 3), 0.5))
    # ckptfs reads it back through its index ...
    assert_same(ckptfs.load_keys(d), state())
    assert ckptfs.load_metadata(d).backend_options["megatron"] == expected_form
    # ... and, without the index, the way it reads a checkpoint Megatron wrote (the tensors
    # nested by DCP's planner_data, the common state at the root)
    (d / "ckptfs.index.json").unlink()
    back = ckptfs.load_keys(d)
    assert_same(back["decoder"], state()["decoder"])
    assert_same({k: back[k] for k in COMMON if k != "optimizer"},
                {k: v for k, v in COMMON.items() if k != "optimizer"})
    assert_same(back["optimizer"]["param_groups"], COMMON["optimizer"]["param_groups"])


def _item_bytes(d: Path, md, fqn: str) -> bytes:
    """A BYTE_IO item's bytes, where .metadata says they are."""
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == fqn]
    with open(d / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


def test_megatron_option_values_and_default_index(tmp_path):
    ckptfs.save({"w": torch.ones(2)}, tmp_path / "plain", backend="torch_dist")
    assert ckptfs.load_metadata(tmp_path / "plain").backend_options == {"files_per_rank": 1}
    assert not (tmp_path / "plain" / "metadata.json").exists()
    ckptfs.save({"w": torch.ones(2)}, tmp_path / "off", backend="torch_dist",
                backend_options={"megatron": False})
    assert ckptfs.load_metadata(tmp_path / "off").backend_options == {"files_per_rank": 1}
    with pytest.raises(ckptfs.BackendOptionsError, match=r"megatron='zarr'"):
        ckptfs.save({"w": torch.ones(2)}, tmp_path / "bad", backend="torch_dist",
                    backend_options={"megatron": "zarr"})
    with pytest.raises(ckptfs.UnsupportedValueError, match=r"key 'mixed'.*renumber"):
        ckptfs.save({"mixed": [torch.ones(2), 3]}, tmp_path / "mixed", backend="torch_dist",
                    backend_options={"megatron": True})
    assert not (tmp_path / "mixed" / "metadata.json").exists()


def test_metadata_json_is_written_after_everything_else(tmp_path, monkeypatch):
    """Megatron takes metadata.json as the mark of a complete checkpoint."""
    events: list[tuple[str, str]] = []
    put = LocalStore.put

    async def recording_put(self, path, parts):
        events.append(("start", path))
        if path == ".metadata":
            await asyncio.sleep(0.2)  # a slow write must still finish before metadata.json starts
        await put(self, path, parts)
        events.append(("end", path))

    monkeypatch.setattr(LocalStore, "put", recording_put)
    ckptfs.save({"w": torch.ones(2), "step": 1}, tmp_path / "ck", backend="torch_dist",
                backend_options={"megatron": True})
    start = events.index(("start", "metadata.json"))
    finished = {p for e, p in events[:start] if e == "end"}
    assert {".metadata", *[p for _, p in events if p.endswith("__values.distcp")]} <= finished
    assert not any(p.endswith(".distcp") and "__values" not in p and e == "start"
                   for e, p in events[start:])
    assert os.path.exists(tmp_path / "ck" / "metadata.json")
