"""The checkpoint manager's delta steps (``SaveOptions(delta=True)``, docs/guide/delta.md): each
step at the URL references the step committed before it, retention keeps every step a kept step
references (transitively), the node-local tier's rules, and ``ckptfs.delete`` / ``ckptfs clean``
of a referenced checkpoint."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.manager.steps import step_dir
from ckptfs.testing.ranks import run_ranks


def _index(path: Path) -> dict:
    return json.loads((path / ckptfs.INDEX_FILE).read_text())


def _chunk(path: Path, key: str) -> dict:
    return _index(path)["tensors"][key]["chunks"][0]


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"frozen": torch.randn(256, 64, generator=g).to(torch.bfloat16),
            "slow": torch.randn(32, 8, generator=g),
            "adapter": torch.randn(16, 8, generator=g), "step": 0}


def _manager(url: str | Path, keep_last: int | None = 3, **tiers) -> ckptfs.CheckpointManager:
    return ckptfs.CheckpointManager(str(url), ckptfs.ManagerOptions(
        retention=ckptfs.Retention(keep_last=keep_last),
        tiers=ckptfs.TierOptions(**tiers),
        save=ckptfs.SaveOptions(delta=True),
        preemption=ckptfs.PreemptionPolicy(signals=())))


def _copy(state: dict) -> dict:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _equal(out: dict, want: dict) -> bool:
    return all(torch.equal(out[k].view(torch.uint8) if out[k].dtype == torch.bfloat16 else out[k],
                           v.view(torch.uint8) if v.dtype == torch.bfloat16 else v)
               for k, v in want.items() if isinstance(v, torch.Tensor))


def _data_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()
               and p.name != ckptfs.INDEX_FILE)


def test_each_step_references_the_step_before_and_retention_keeps_what_kept_steps_need(tmp_path):
    url = tmp_path / "run"
    state, saved = _state(), {}
    with _manager(url, keep_last=2) as mgr:
        for step in range(1, 7):
            state["adapter"] += 1.0  # changes at every step
            if step == 3:
                state["slow"][0, 0] += 1.0  # changes once
            state["step"] = step
            mgr.save_sync(step, state)
            saved[step] = _copy(state)
        # 6 keeps 5 (kept anyway), 3 (``slow``'s bytes) and 1 (``frozen``'s): 2 and 4 went
        assert mgr.steps() == [1, 3, 5, 6]
        assert _index(url / step_dir(1)).get("bases") is None  # the first step is whole
        assert sorted(b["url"] for b in _index(url / step_dir(6))["bases"]) == [
            f"../{step_dir(1)}", f"../{step_dir(3)}"]
        assert "base" not in _chunk(url / step_dir(6), "adapter")
        for step in mgr.steps():
            out = ckptfs.load_keys(url / step_dir(step))
            assert _equal(out, saved[step]) and out["step"] == step, step
        restored = _copy(_state())
        assert mgr.restore(restored) == 6 and _equal(restored, saved[6])
    # the frozen bytes lie once on disk: steps 3, 5 and 6 wrote the changed tensors only
    frozen = 256 * 64 * 2
    assert _data_bytes(url / step_dir(1)) >= frozen
    for step in (5, 6):
        assert _data_bytes(url / step_dir(step)) < 16 * 8 * 4 + 4096 < frozen


def test_delta_with_a_fixed_base_a_single_save_or_another_backend_is_refused(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="delta=True"):
        ckptfs.SaveOptions(delta=True, base=str(tmp_path / "b"))
    with pytest.raises(ckptfs.ConfigError, match="names its base"):
        ckptfs.save(_state(), tmp_path / "x", options=ckptfs.SaveOptions(delta=True))
    assert not (tmp_path / "x" / ckptfs.INDEX_FILE).exists()
    with pytest.raises(ckptfs.ConfigError, match="needs backend"):
        ckptfs.CheckpointManager(str(tmp_path / "z"), ckptfs.ManagerOptions(
            save=ckptfs.SaveOptions(delta=True)), backend="npy_chunks")


def test_a_step_after_a_restart_references_the_newest_committed_step(tmp_path):
    url = tmp_path / "run"
    state = _state()
    with _manager(url) as first:
        first.save_sync(1, state)
    state["adapter"] += 1.0
    with _manager(url) as again:  # a new process: the base comes from the URL's listing
        assert again.restore(_copy(_state())) == 1
        again.save_sync(2, state)
    assert _index(url / step_dir(2))["bases"] == [{"url": f"../{step_dir(1)}"}]
    assert _equal(ckptfs.load_keys(url / step_dir(2)), state)


def _flip(path: Path, chunk: dict) -> None:
    """Change one byte of ``chunk``'s range in the file under ``path``."""
    with open(path / chunk["file"], "r+b") as f:
        f.seek(chunk["byte_offset"] + 10)
        byte = f.read(1)
        f.seek(chunk["byte_offset"] + 10)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_delta_step_restores_its_references_from_the_nodes_copy_of_the_base(tmp_path):
    url, local = tmp_path / "run", tmp_path / "node"
    state, saved = _state(), {}
    with _manager(url, local_dir=str(local)) as mgr:
        for step in (1, 2):
            state["adapter"] += 1.0
            mgr.save_sync(step, state)
            saved[step] = _copy(state)
    assert (local / step_dir(2)).is_dir() and (local / step_dir(1)).is_dir()
    frozen = _chunk(url / step_dir(2), "frozen")
    assert frozen["base"] == 0
    base_file = f"../{step_dir(1)}/{frozen['file']}"
    # the URL's base files gone: the node's copy of step 1 serves the references
    moved = tmp_path / "moved"
    os.rename(url / step_dir(1) / "data", moved)
    with _manager(url, local_dir=str(local)) as mgr:
        target = _copy(_state())
        assert mgr.restore(target) == 2 and _equal(target, saved[2])
        r = mgr.last_restore
        assert base_file in r.local_files and not r.remote_files
        assert r.remote_bytes == 0 and r.local_bytes >= 256 * 64 * 2
    os.rename(moved, url / step_dir(1) / "data")
    # the node's copy spoiled: its chunk fails its CRC-32C and is read again from the URL
    _flip(local / step_dir(1), frozen)
    with _manager(url, local_dir=str(local)) as mgr:
        target = _copy(_state())
        assert mgr.restore(target) == 2 and _equal(target, saved[2])
        r = mgr.last_restore
        assert base_file in r.remote_files and base_file in r.rejected
        assert r.remote_bytes >= 256 * 64 * 2
    # spoiled at the URL too: the reference's checksum catches it, naming the key
    _flip(url / step_dir(1), frozen)
    with _manager(url, local_dir=str(local)) as mgr, pytest.raises(ckptfs.IntegrityError,
                                                                   match="frozen"):
        mgr.restore(_copy(_state()), 2)
    # no node copy of the base: its references are read at the URL (restored, then absent)
    _flip(url / step_dir(1), frozen)
    shutil.rmtree(local / step_dir(1))
    with _manager(url, local_dir=str(local)) as mgr:
        target = _copy(_state())
        assert mgr.restore(target) == 2 and _equal(target, saved[2])
        r = mgr.last_restore
        assert r.local_files == (f"data/{_chunk(url / step_dir(2), 'adapter')['file'][5:]}",)
        assert r.remote_bytes >= 256 * 64 * 2 > r.local_bytes > 0


def test_local_steps_are_whole_and_persistent_steps_reference_persistent_ones(tmp_path):
    url, local = tmp_path / "run", tmp_path / "node"
    state, saved = _state(), {}
    mgr = ckptfs.CheckpointManager(str(url), ckptfs.ManagerOptions(
        save_interval_steps=2, retention=ckptfs.Retention(keep_last=2),
        tiers=ckptfs.TierOptions(local_dir=str(local), local_interval_steps=1, replicas=0),
        save=ckptfs.SaveOptions(delta=True), preemption=ckptfs.PreemptionPolicy(signals=())))
    with mgr:
        for step in (2, 3, 4, 5):
            state["adapter"] += 1.0
            mgr.save_sync(step, state)
            saved[step] = _copy(state)
        assert mgr.steps() == [2, 4]
        # a local step references nothing (it travels to other nodes and may be persisted alone)
        idx5 = _index(local / step_dir(5))
        assert "bases" not in idx5 and all("hash" in c for t in idx5["tensors"].values()
                                           for c in t["chunks"])
        assert _index(url / step_dir(4))["bases"] == [{"url": f"../{step_dir(2)}"}]
        target = _copy(_state())
        assert mgr.restore(target) == 5 and _equal(target, saved[5])
        assert mgr.last_restore.source == "local"


# -- ckptfs.delete and ckptfs clean of a referenced checkpoint ---------------------------------


def test_delete_refuses_a_checkpoint_a_sibling_references_naming_it(tmp_path):
    base, delta = tmp_path / "step_1", tmp_path / "step_2"
    state = _state()
    ckptfs.save(state, base, options=ckptfs.SaveOptions(hashes=True))
    state["adapter"] += 1.0
    ckptfs.save(state, delta, base=base)
    with pytest.raises(ckptfs.ReferencedCheckpointError, match="step_2") as e:
        ckptfs.delete(base)
    assert str(delta) in str(e.value) and (base / ckptfs.INDEX_FILE).exists()
    assert _equal(ckptfs.load_keys(delta), state)
    ckptfs.delete(delta)  # nothing references the delta
    assert ckptfs.delete(base) > 0  # nor its base, once the delta is gone
    assert not base.exists() or not any(base.rglob("*"))


def test_delete_with_force_removes_a_referenced_base_and_the_delta_then_names_it(tmp_path):
    base, delta = tmp_path / "step_1", tmp_path / "step_2"
    state = _state()
    ckptfs.save(state, base, options=ckptfs.SaveOptions(hashes=True))
    ckptfs.save(state, delta, base=base)
    assert ckptfs.delete(base, force=True) > 0
    with pytest.raises(ckptfs.IntegrityError, match="step_1"):
        ckptfs.load_keys(delta)


def test_delete_of_a_manager_step_a_kept_delta_step_references_is_refused(tmp_path):
    url = tmp_path / "run"
    state = _state()
    with _manager(url, keep_last=None) as mgr:
        for step in (1, 2):
            state["adapter"] += 1.0
            mgr.save_sync(step, state)
    with pytest.raises(ckptfs.ReferencedCheckpointError, match=step_dir(2)):
        ckptfs.delete(url / step_dir(1))
    result = ckptfs.clean(url / step_dir(1))  # a committed base: its files are all listed
    assert result.removed == () and _equal(ckptfs.load_keys(url / step_dir(2)), state)



# -- reuse_hashes: the hashes of tensors unchanged since the last save -------------------------


def _counting(monkeypatch) -> list[int]:
    from ckptfs.engine.save import delta

    calls = [0]
    real = delta.content_hash

    def counted(data):
        calls[0] += 1
        return real(data)

    monkeypatch.setattr(delta, "content_hash", counted)
    return calls


def test_reuse_hashes_skips_hashing_unchanged_tensors_and_sees_in_place_changes(tmp_path,
                                                                               monkeypatch):
    from ckptfs.engine.save.hash_memo import default_memo

    calls = _counting(monkeypatch)
    state = _state()
    opts = ckptfs.SaveOptions(hashes=True, reuse_hashes=True)
    ckptfs.save(state, tmp_path / "s1", options=opts)
    assert calls[0] == 3 and len(default_memo()) >= 3
    state["adapter"][0, 0] += 1.0  # in place: its version counter moves
    state["slow"] = state["slow"].clone()  # a new tensor object of equal values
    ckptfs.save(state, tmp_path / "s2", base=tmp_path / "s1", options=opts)
    assert calls[0] == 3 + 2  # adapter and slow hashed again, frozen not
    idx = _index(tmp_path / "s2")
    assert [k for k, t in idx["tensors"].items() if "base" in t["chunks"][0]] == ["frozen", "slow"]
    assert _chunk(tmp_path / "s2", "frozen")["hash"] == _chunk(tmp_path / "s1", "frozen")["hash"]
    with torch.no_grad():
        state["frozen"].mul_(1)  # same values, but an in-place op: hashed again, still equal
    ckptfs.save(state, tmp_path / "s3", base=tmp_path / "s2", options=opts)
    assert calls[0] == 5 + 1 and "base" in _chunk(tmp_path / "s3", "frozen")
    assert _equal(ckptfs.load_keys(tmp_path / "s3"), state)


def test_reuse_hashes_does_not_see_writes_through_data_as_documented(tmp_path, monkeypatch):
    from tests import spec_audit

    # the delta saved with the memo holds the documented wrong bytes: not for the audit
    monkeypatch.setenv(spec_audit.ENV, "off")
    state = _state()
    for reuse in (False, True):
        opts = ckptfs.SaveOptions(hashes=True, reuse_hashes=reuse)
        ckptfs.save(state, tmp_path / f"a{reuse}", options=opts)
        state["adapter"].data[0, 0] += 1.0  # bypasses the version counter
        ckptfs.save(state, tmp_path / f"b{reuse}", base=tmp_path / f"a{reuse}", options=opts)
        got = ckptfs.load_keys(tmp_path / f"b{reuse}")["adapter"]
        # without the memo the change is found; with it the old bytes are referenced
        assert torch.equal(got, state["adapter"]) is not reuse


def test_a_manager_with_reuse_hashes_keeps_a_memo_of_its_own(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    state = _state()
    mgr = ckptfs.CheckpointManager(str(tmp_path / "run"), ckptfs.ManagerOptions(
        save=ckptfs.SaveOptions(delta=True, reuse_hashes=True),
        preemption=ckptfs.PreemptionPolicy(signals=())))
    with mgr:
        for step in (1, 2, 3):
            state["adapter"] += 1.0
            mgr.save_sync(step, state)
    assert calls[0] == 3 + 1 + 1 and len(mgr._memo) == 3
    assert _equal(ckptfs.load_keys(tmp_path / "run" / step_dir(3)), state)


# -- object stores: a base in another bucket -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("client", ["fsspec", "obstore"])
def test_a_delta_on_a_base_in_another_bucket_reads_it_with_the_deltas_options(s3, client):
    import boto3

    s3_client = boto3.client("s3", endpoint_url=s3.direct, region_name="us-east-1")
    s3_client.create_bucket(Bucket="frozen")
    so = ckptfs.StoreOptions(client=client)
    base, delta = "s3://frozen/model", f"{s3.url}/run/step_2"
    state = _state()
    ckptfs.save(state, base, storage_options=s3.options, store_options=so,
                options=ckptfs.SaveOptions(hashes=True))
    state["adapter"] += 1.0
    ckptfs.save(state, delta, storage_options=s3.options, store_options=so, base=base)
    index = ckptfs.load_metadata(delta, storage_options=s3.options, store_options=so)
    assert index.bases == (base,)  # another bucket: recorded as given
    assert _equal(ckptfs.load_keys(delta, storage_options=s3.options, store_options=so), state)
    report = ckptfs.verify(delta, storage_options=s3.options, store_options=so)
    assert report.ok, report.problems
    # a base these options cannot reach (here: its bucket is gone) is named, never misread
    keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket="frozen")["Contents"]]
    s3_client.delete_objects(Bucket="frozen", Delete={"Objects": [{"Key": k} for k in keys]})
    s3_client.delete_bucket(Bucket="frozen")
    with pytest.raises(ckptfs.CkptfsError, match="frozen"):
        ckptfs.load_keys(delta, storage_options=s3.options, store_options=so)


@pytest.mark.slow
def test_a_delta_in_the_same_bucket_through_obstore(s3):
    so = ckptfs.StoreOptions(client="obstore")
    base, delta = f"{s3.url}/run/step_1", f"{s3.url}/run/step_2"
    state = _state()
    ckptfs.save(state, base, storage_options=s3.options, store_options=so,
                options=ckptfs.SaveOptions(hashes=True))
    state["adapter"] += 1.0
    ckptfs.save(state, delta, storage_options=s3.options, store_options=so, base=base)
    assert ckptfs.load_metadata(delta, storage_options=s3.options).bases == ("../step_1",)
    assert _equal(ckptfs.load_keys(delta, storage_options=s3.options, store_options=so), state)
    with pytest.raises(ckptfs.ReferencedCheckpointError, match="step_2"):
        ckptfs.delete(base, storage_options=s3.options, store_options=so)


# -- ranks: the base is agreed, the steps reshard ----------------------------------------------

_ROWS = 12


def _full(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {"frozen": torch.randn(_ROWS, 16, generator=g), "moving": torch.randn(_ROWS, 4, generator=g)}
    out["moving"] += step
    return out


def _sharded(world: int, rank: int, full: dict[str, torch.Tensor]) -> dict:
    per = -(-_ROWS // world)
    lo, hi = min(rank * per, _ROWS), min(rank * per + per, _ROWS)
    return {k: ckptfs.ShardedTensor(v[lo:hi].clone(), tuple(v.shape), (lo, 0)) for k, v in full.items()}


def _save_steps(rank: int, world: int, url: str, local_dir: str | None = None) -> None:
    options = ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_last=2),
                                    save=ckptfs.SaveOptions(delta=True, reuse_hashes=True),
                                    tiers=ckptfs.TierOptions(local_dir=local_dir),
                                    preemption=ckptfs.PreemptionPolicy(signals=()))
    with ckptfs.CheckpointManager(url, options) as mgr:
        state = _sharded(world, rank, _full(0))
        for step in (1, 2, 3):
            state["moving"].local_tensor.copy_(_sharded(world, rank, _full(step))["moving"].local_tensor)
            mgr.save_sync(step, state)


def _restore_three(rank: int, world: int, url: str) -> None:
    options = ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=()))
    target = _sharded(world, rank, {k: torch.zeros_like(v) for k, v in _full(0).items()})
    with ckptfs.CheckpointManager(url, options) as mgr:
        assert mgr.restore(target) == 3
    want = _sharded(world, rank, _full(3))
    for k, v in want.items():
        assert torch.equal(target[k].local_tensor, v.local_tensor), (rank, k)


def _restore_from_node(rank: int, world: int, url: str, local_dir: str) -> None:
    options = ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=local_dir),
                                    preemption=ckptfs.PreemptionPolicy(signals=()))
    target = _sharded(world, rank, {k: torch.zeros_like(v) for k, v in _full(0).items()})
    with ckptfs.CheckpointManager(url, options) as mgr:
        assert mgr.restore(target) == 3
        r = mgr.last_restore
    for k, v in _sharded(world, rank, _full(3)).items():
        assert torch.equal(target[k].local_tensor, v.local_tensor), (rank, k)
    assert r is not None and r.remote_bytes == 0, r
    assert any(f.startswith(f"../{step_dir(1)}/") for f in r.local_files), r.local_files


@pytest.mark.slow
def test_two_ranks_save_delta_steps_that_three_ranks_restore(tmp_path):
    """Two ranks save through the node-local tier; three ranks restore from the URL, then,
    the URL's files of the base step removed, from the node's copy of the base (chunks read
    in part, so checked whole first)."""
    url, local = str(tmp_path / "run"), str(tmp_path / "node")
    run_ranks(2, _save_steps, url, local)
    assert sorted(os.listdir(url)) == [step_dir(1), step_dir(2), step_dir(3)]  # 1: frozen bytes
    frozen = _index(Path(url) / step_dir(3))["tensors"]["frozen"]["chunks"]
    assert len(frozen) == 2 and all("base" in c for c in frozen)
    assert _index(Path(url) / step_dir(3))["bases"] == [{"url": f"../{step_dir(1)}"}]
    run_ranks(3, _restore_three, url)
    shutil.rmtree(Path(url) / step_dir(1) / "data")
    run_ranks(3, _restore_from_node, url, local)


def test_a_step_after_one_of_another_backend_is_whole(tmp_path):
    url = tmp_path / "run"
    state = _state()
    zarr = ckptfs.CheckpointManager(str(url), ckptfs.ManagerOptions(
        preemption=ckptfs.PreemptionPolicy(signals=())), backend="zarr")
    with zarr:
        zarr.save_sync(1, state)
    state["adapter"] += 1.0
    with _manager(url) as mgr:
        mgr.save_sync(2, state)
        state["adapter"] += 1.0
        mgr.save_sync(3, state)
    assert "bases" not in _index(url / step_dir(2))  # whole: step 1 is no raw layout
    assert _index(url / step_dir(3))["bases"] == [{"url": f"../{step_dir(2)}"}]
    assert _equal(ckptfs.load_keys(url / step_dir(3)), state)


def test_a_promoted_preemption_step_is_whole_and_the_next_step_references_it(tmp_path):
    import signal

    url, local = tmp_path / "run", tmp_path / "node"
    policy = ckptfs.PreemptionPolicy(signals=(signal.SIGUSR1,), exit=False, persist=True)
    mgr = ckptfs.CheckpointManager(str(url), ckptfs.ManagerOptions(
        save_interval_steps=10**6, preemption=policy, save=ckptfs.SaveOptions(delta=True),
        tiers=ckptfs.TierOptions(local_dir=str(local), local_interval_steps=10**6, replicas=0)))
    state = _state()
    with mgr:
        mgr.save_sync(1, state)  # a persistent step (the first: whole)
        os.kill(os.getpid(), signal.SIGUSR1)
        step = 2
        while not mgr.should_save(step):
            step += 1
        state["adapter"] += 1.0
        mgr.save(step, state).result()  # a local step, then persisted at the URL
        assert mgr.preempted and mgr.steps() == [1, step]
        promoted = _index(url / step_dir(step))
        assert "bases" not in promoted  # a local step references nothing: it carries its bytes
        assert _equal(ckptfs.load_keys(url / step_dir(step)), state)
        state["adapter"] += 1.0
        mgr.save_sync(step + 1, state)
    assert _index(url / step_dir(step + 1))["bases"] == [{"url": f"../{step_dir(step)}"}]
    assert _equal(ckptfs.load_keys(url / step_dir(step + 1)), state)
