"""The per-tensor hot paths of a state of many small tensors (the bench's W4): byte views, the
garbage collector paused while metadata is built, zarr's metadata documents."""

from __future__ import annotations

import gc
import json

import pytest
import torch

import ckptfs
from ckptfs.layout.backends import torch_dist, zarr_backend
from ckptfs.layout.nogc import paused_gc
from ckptfs.layout.tensor_bytes import tensor_bytes

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.uint16,
          torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 0, 4)])
def test_tensor_bytes_is_the_tensor_memory_for_every_dtype(dtype, shape):
    t = torch.empty(shape, dtype=dtype).view(-1).view(torch.uint8)
    t.copy_((torch.arange(t.numel()) * 37 % 251).to(torch.uint8))
    t = t.view(dtype).reshape(shape)
    mv = tensor_bytes(t)
    assert mv.format == "B" and mv.ndim == 1
    assert bytes(mv) == t.reshape(-1).view(torch.uint8).numpy().tobytes()
    if t.numel():  # a view, not a copy
        mv2 = tensor_bytes(t)
        t.view(-1).view(torch.uint8)[0] ^= 0xFF
        assert mv2[0] == mv[0] and mv[0] == t.reshape(-1).view(torch.uint8)[0].item()


def test_tensor_bytes_refuses_what_has_no_plain_bytes():
    with pytest.raises(ValueError, match="contiguous"):
        tensor_bytes(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="CPU"):
        tensor_bytes(torch.zeros(4, device="meta"))


def test_paused_gc_restores_the_collector():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), paused_gc():
        raise KeyError("x")
    assert gc.isenabled()
    gc.disable()  # a caller that runs without the collector keeps it off
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_staging_leaves_no_collection_to_the_caller(tmp_path):
    """When ``staged`` resolves, the young objects of staging thousands of tensors (made with
    the collector paused) are collected already: the caller's next allocation does not
    traverse them in one long hold of the GIL."""
    state = {f"p{i}": torch.randn(4) for i in range(2000)}
    young: list[int] = []
    h = ckptfs.async_save(state, str(tmp_path / "c"))
    h.staged.add_done_callback(lambda _: young.append(gc.get_count()[0]))  # in the saving thread
    h.result(timeout=60)
    ckptfs.close()
    assert young and young[0] < 1000, young  # tens of thousands without the catch-up


@pytest.mark.parametrize("backend,version,hook", [
    ("zarr", 3, (zarr_backend._ZarrBackend, "prepare")),
    ("torch_dist", 1, (torch_dist.TorchDistBackend, "finalize")),
])
def test_backend_metadata_is_built_with_the_collector_paused(tmp_path, monkeypatch, backend,
                                                           version, hook):
    """zarr's per-array documents (prepare) and DCP's .metadata (finalize) allocate a few
    objects per tensor; the collector is paused meanwhile and running again after the save."""
    seen: list[bool] = []
    cls, name = hook
    orig = getattr(cls, name)

    def spy(self, *a, **k):
        seen.append(gc.isenabled())
        return orig(self, *a, **k)

    monkeypatch.setattr(cls, name, spy)
    state = {f"t.{i}": torch.full((3 + i,), float(i)) for i in range(5)}
    ckptfs.save(state, str(tmp_path / "c"), backend=backend, backend_version=version)
    assert seen == [False]
    assert gc.isenabled()
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    ckptfs.load(back, str(tmp_path / "c"))
    assert all(torch.equal(back[k], state[k]) for k in state)


@pytest.mark.parametrize("version", [2, 3])
def test_zarr_documents_of_one_layout_keep_their_own_attributes(tmp_path, version):
    """Arrays of the same shape and dtype share one template document; each array's own
    attributes (its key) must still be its own, and the template must stay unchanged."""
    state = {f"w.{i}": torch.full((4,), float(i)) for i in range(3)}
    root = tmp_path / "z"
    ckptfs.save(state, str(root), backend="zarr", backend_version=version)
    keys = []
    for i in range(3):
        if version == 3:
            doc = json.loads((root / f"w.{i}" / "zarr.json").read_text())
            attrs = doc["attributes"]
            assert doc["shape"] == [4] and doc["node_type"] == "array"
        else:
            assert json.loads((root / f"w.{i}" / ".zarray").read_text())["shape"] == [4]
            attrs = json.loads((root / f"w.{i}" / ".zattrs").read_text())
        keys.append(attrs["ckptfs"]["key"])
    assert keys == ["w.0", "w.1", "w.2"]
    import zarr

    group = zarr.open_group(str(root), mode="r")
    for i in range(3):
        assert group[f"w.{i}"][:].tolist() == [float(i)] * 4


def test_dcp_metadata_shares_its_repeated_values_and_dcp_loads_it(tmp_path):
    """torch_dist's .metadata (DCP's pickle) holds one TensorProperties per dtype and one
    torch.Size per distinct tuple, shared by the items; DCP itself reads it and loads the data."""
    import torch.distributed.checkpoint as dcp

    state = {f"t.{i}": torch.arange(4 + i % 2, dtype=torch.float32) + i for i in range(6)}
    state["h"] = torch.ones(5, dtype=torch.bfloat16)
    ckptfs.save(state, str(tmp_path / "c"), backend="torch_dist", backend_version=1)
    md = dcp.FileSystemReader(str(tmp_path / "c")).read_metadata()
    items = md.state_dict_metadata
    f32 = {id(items[f"t.{i}"].properties) for i in range(6)}
    assert len(f32) == 1 and items["h"].properties.dtype == torch.bfloat16
    assert items["t.0"].properties.dtype == torch.float32
    assert items["t.0"].size is items["t.2"].size and items["t.0"].size == torch.Size([4])
    assert items["t.1"].size == torch.Size([5]) and items["t.1"].size is not items["t.0"].size
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "c")))
    assert all(torch.equal(back[k], state[k]) for k in state)


def _many(n: int = 70) -> dict[str, torch.Tensor]:
    return {f"s.{i}": torch.arange(3 + i % 5, dtype=torch.float32) * (i + 1) for i in range(n)}


def _zeros(state):
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _spy(monkeypatch, cls, name, seen) -> None:
    """``cls.name`` (an async method) calls ``seen(*args)`` first, then the real one."""
    real = getattr(cls, name)

    async def spy(self, *args):
        seen(*args)
        return await real(self, *args)

    monkeypatch.setattr(cls, name, spy)


def test_many_small_files_are_read_in_groups(tmp_path, monkeypatch):
    """zarr writes a chunk file per array: 70 of them are read in groups (Store.read_files, one
    worker thread per group in a local store), not with a read_into each."""
    from ckptfs.io.local_store import LocalStore

    calls = {"files": [], "into": 0}
    _spy(monkeypatch, LocalStore, "read_files", lambda items: calls["files"].append(len(items)))
    _spy(monkeypatch, LocalStore, "read_into", lambda *_: calls.update(into=calls["into"] + 1))
    state = _many()
    ckptfs.save(state, str(tmp_path / "z"), backend="zarr", backend_version=3)
    back = _zeros(state)
    res = ckptfs.load(back, str(tmp_path / "z"))
    assert all(torch.equal(back[k], state[k]) for k in state)
    assert sorted(calls["files"]) == [6, 64] and calls["into"] == 0
    assert res.bytes_read == sum(v.nbytes for v in state.values())
    few = {k: state[k] for k in list(state)[:10]}  # below a group: one read_into per file
    back = _zeros(few)
    ckptfs.load(back, str(tmp_path / "z"))
    assert all(torch.equal(back[k], few[k]) for k in few) and calls["into"] == 10


def test_many_small_files_are_written_in_groups_each_fsynced(tmp_path, monkeypatch):
    """zarr's 70 array documents and 70 chunk files are written in groups (Store.put_files, one
    worker thread per group in a local store), not with a put each, dealt over the store's 16
    request slots (so their fsyncs run side by side); every file is still fsynced before the
    index is committed."""
    import os

    from ckptfs.io.local_store import LocalStore

    calls = {"files": [], "put": 0, "fsync": 0}
    _spy(monkeypatch, LocalStore, "put_files", lambda items: calls["files"].append(len(items)))
    _spy(monkeypatch, LocalStore, "put", lambda *_: calls.update(put=calls["put"] + 1))
    fsync = os.fsync

    def spy_fsync(fd):
        calls["fsync"] += 1
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    state = _many()
    root = tmp_path / "z"
    ckptfs.save(state, str(root), backend="zarr", backend_version=3)
    # prepare: 70 array documents + the root group's (15 groups); data: 70 chunk files (14)
    assert sorted(calls["files"]) == [1] + [5] * 28 and calls["put"] == 0, calls
    written = [p for p in root.rglob("*") if p.is_file() and p.name != ckptfs.INDEX_FILE]
    assert len(written) == 141 and calls["fsync"] >= 141 + 1, calls  # + the index
    back = _zeros(state)
    ckptfs.load(back, str(root))
    assert all(torch.equal(back[k], state[k]) for k in state)
    few = {k: state[k] for k in list(state)[:10]}  # below a group: a put per file
    ckptfs.save(few, str(tmp_path / "few"), backend="zarr", backend_version=3)
    assert calls["put"] == 21 and len(calls["files"]) == 29, calls


def test_a_file_of_a_group_that_cannot_be_written_fails_the_save_naming_it(tmp_path):
    state = _many()
    root = tmp_path / "z"
    (root / "s.37" / "c" / "0").mkdir(parents=True)  # a directory where the chunk file goes
    with pytest.raises(ckptfs.CkptfsError, match=r"s\.37/c/0"):
        ckptfs.save(state, str(root), backend="zarr", backend_version=3)
    assert not (root / ckptfs.INDEX_FILE).exists()


def test_prefixed_store_writes_a_group_under_its_prefix(tmp_path):
    from ckptfs.io.local_store import LocalStore
    from ckptfs.io.loop import run_sync
    from ckptfs.io.prefixed import PrefixedStore

    base = LocalStore(str(tmp_path))
    run_sync(PrefixedStore(base, "tier/a").put_files([(f"d/{i}", (b"ab", bytes([i]))) for i in range(3)]))
    assert [(tmp_path / "tier" / "a" / "d" / str(i)).read_bytes() for i in range(3)] == \
        [b"ab" + bytes([i]) for i in range(3)]
    assert base.stats.write_requests == 3 and base.stats.bytes_written == 9
    run_sync(base.close())


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped"])
def test_a_damaged_small_file_in_a_group_names_its_key(tmp_path, damage):
    state = _many()
    root = tmp_path / "z"
    ckptfs.save(state, str(root), backend="zarr", backend_version=3)
    chunk = root / "s.37" / "c" / "0"
    if damage == "missing":
        chunk.unlink()
    elif damage == "truncated":
        chunk.write_bytes(chunk.read_bytes()[:-4])
    else:
        data = bytearray(chunk.read_bytes())
        data[5] ^= 0x10
        chunk.write_bytes(bytes(data))
    with pytest.raises(ckptfs.IntegrityError, match=r"s\.37") as e:
        ckptfs.load(_zeros(state), str(root))
    if damage != "flipped":
        assert damage in str(e.value) and "s.37/c/0" in str(e.value)


def test_many_small_files_from_a_store_without_its_own_grouping(memfs):
    """Any other store reads a group with a read_into per file (Store.read_files' default)."""
    state = _many()
    ckptfs.save(state, "memory://many", backend="zarr", backend_version=3)
    back = _zeros(state)
    ckptfs.load(back, "memory://many")
    assert all(torch.equal(back[k], state[k]) for k in state)
    fs = memfs
    fs.rm_file("/many/s.3/c/0")
    with pytest.raises(ckptfs.IntegrityError, match=r"s\.3.*missing"):
        ckptfs.load(_zeros(state), "memory://many")
