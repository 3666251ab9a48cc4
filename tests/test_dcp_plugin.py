"""``ckptfs.dcp``: PyTorch DCP's ``save`` / ``async_save`` / ``load`` through ckptfs's storage
plug-in, on spawned gloo ranks. Two ranks save a DTensor-sharded state (DCP's default planner,
its options, plan caching, asynchronous saves in a thread and in DCP's saving process, ckptfs
backends, moto's S3 server, DCP's own FileSystemWriter beside them); ckptfs reads what the
plug-in wrote; three ranks load every checkpoint back through the reader (a 2 -> 3 reshard),
bit-exact, reading no more than the bytes they need; errors reach the caller as ckptfs errors
inside DCP's CheckpointException."""

from __future__ import annotations

import json
import os

import ckptfs.dcp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckptfs.dcp.items import OPAQUE
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptfs
from ckptfs.testing.ranks import run_ranks
from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

PLACEMENTS = {"w": Shard(0), "emb": Shard(1), "b": Replicate()}
#: checkpoints the two saving ranks write through the plug-in: name -> backend
PLUGIN = {"plain": "safetensors_chunks", "async": "safetensors_chunks",
          "dedup": "safetensors_chunks", "cache1": "safetensors_chunks",
          "cache2": "safetensors_chunks", "torch_dist": "torch_dist", "zarr": "zarr",
          "retry": "safetensors_chunks", "process": "safetensors_chunks"}
LOADED = [*PLUGIN, "s3", "fs"]


def full(name: str, shift: float = 0.0) -> torch.Tensor:
    """The global tensors of the saved state (the same on every rank)."""
    g = torch.Generator().manual_seed(len(name))
    if name == "w":
        # rows of 1 KiB: what a rank skips in a 2 -> 3 reshard is wider than the store's
        # max_gap, so it is not read through
        return torch.randn(768, 256, generator=g) + shift
    if name == "emb":
        return (torch.randn(32, 40, generator=g) + shift).to(torch.bfloat16)
    return torch.randn(96, generator=g) + shift


def state(mesh, shift: float = 0.0, objects: bool = True) -> dict:
    model = {k: distribute_tensor(full(k, shift), mesh, [p]) for k, p in PLACEMENTS.items()}
    sd = {"model": model, "optim": {"step": 3, "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}}
    if objects:
        sd["extra"] = {"tags": {"a", "b"}}  # not a plain value: DCP's own bytes, kept opaque
    return sd


def target(mesh, objects: bool = True) -> dict:
    model = {k: distribute_tensor(torch.zeros_like(full(k)), mesh, [p])
             for k, p in PLACEMENTS.items()}
    sd = {"model": model, "optim": {"step": 0, "param_groups": [{"lr": 0.0, "betas": [0.0, 0.0]}]}}
    if objects:
        sd["extra"] = {"tags": None}
    return sd


def check(sd: dict, mesh, shift: float = 0.0, objects: bool = True) -> None:
    for k, p in PLACEMENTS.items():
        want = distribute_tensor(full(k, shift), mesh, [p]).to_local()
        got = sd["model"][k].to_local()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), k
    assert sd["optim"]["step"] == 3
    assert sd["optim"]["param_groups"] == [{"lr": 0.1, "betas": [0.9, 0.99]}]
    if objects:
        assert sd["extra"]["tags"] == {"a", "b"}


class FailingPlanner(DefaultSavePlanner):
    """Rank 1 cannot take its data (a write that fails after the coordinator claimed the root)."""

    def resolve_data(self, write_item):
        if torch.distributed.get_rank() == 1:
            raise ckptfs.StorageError("rank 1: no space left on the device")
        return super().resolve_data(write_item)


def failure(fn) -> BaseException:
    """The first rank's exception inside the CheckpointException ``fn`` raises."""
    try:
        fn()
    except CheckpointException as e:
        return next(iter(e.failures.values()))[0]
    raise AssertionError("no CheckpointException")


def _save(rank: int, world: int, root: str, endpoint: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    sd = state(mesh)

    def writer(name: str, **kw) -> ckptfs.dcp.StorageWriter:
        return ckptfs.dcp.StorageWriter(f"{root}/{name}", backend=PLUGIN[name], **kw)

    for name in ("plain", "torch_dist", "zarr"):
        dcp.save(sd, storage_writer=writer(name))
    dcp.save(sd, storage_writer=ckptfs.dcp.StorageWriter(
        f"s3://{BUCKET}/dcp", storage_options=s3_options(endpoint)))
    dcp.save(state(mesh, objects=False), storage_writer=FileSystemWriter(f"{root}/fs"))
    dcp.async_save(sd, storage_writer=writer("async")).result()
    # DCP's saving process: the writer is pickled and runs there on its own process group
    dcp.async_save(sd, storage_writer=writer("process"),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    dcp.save(sd, storage_writer=writer("dedup"),
             planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    dcp.save(sd, storage_writer=writer("cache1"), planner=DefaultSavePlanner(enable_plan_caching=True))
    moved = state(mesh, shift=1.0)
    dcp.save(moved, storage_writer=writer("cache2"),
             planner=DefaultSavePlanner(enable_plan_caching=True))
    # errors: a committed checkpoint is refused (overwrite=False); a rank failing after the claim leaves the root
    # free for the next save
    err = failure(lambda: dcp.save(sd, storage_writer=writer("plain", overwrite=False)))
    assert isinstance(err, ckptfs.CheckpointExistsError), err
    assert "Checkpoint already exists" in str(err) and "overwrite=True" in str(err), err
    err = failure(lambda: dcp.save(sd, storage_writer=writer("retry"), planner=FailingPlanner()))
    if rank == 1:
        assert isinstance(err, ckptfs.StorageError) and "no space left" in str(err), err
    dcp.save(sd, storage_writer=writer("retry"))
    dcp.save(sd, storage_writer=writer("plain", overwrite=True))


def _load(rank: int, world: int, root: str, endpoint: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in LOADED:
        url = f"s3://{BUCKET}/dcp" if name == "s3" else f"{root}/{name}"
        opts = s3_options(endpoint) if name == "s3" else None
        objects = name != "fs"  # DCP's pickled set: ckptfs does not unpickle objects
        sd = target(mesh, objects)
        reader = ckptfs.dcp.StorageReader(url, storage_options=opts)
        dcp.load(sd, storage_reader=reader)
        check(sd, mesh, 1.0 if name == "cache2" else 0.0, objects)
        out[name] = [reader.stats.bytes_read, reader.stats.bytes_needed]
    sd = target(mesh, objects=False)  # ckptfs's own load reads what the plug-in wrote
    ckptfs.load(sd, f"{root}/plain", strict=False)
    check(sd, mesh, objects=False)
    with open(os.path.join(root, f"load{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def saved(tmp_path_factory, moto_server):
    root = str(tmp_path_factory.mktemp("dcp"))
    reset_bucket(moto_server)
    run_ranks(2, _save, root, moto_server, timeout=600)
    return root, moto_server


@pytest.fixture(scope="module")
def loaded(saved):
    root, endpoint = saved
    run_ranks(3, _load, root, endpoint, timeout=600)
    out = []
    for r in range(3):
        with open(os.path.join(root, f"load{r}.json")) as f:
            out.append(json.load(f))
    return out


def test_ckptfs_reads_what_the_writer_wrote(saved):
    root, _ = saved
    for name, backend in PLUGIN.items():
        md = ckptfs.load_metadata(f"{root}/{name}")
        assert md.backend == backend, name
        shift = 1.0 if name == "cache2" else 0.0
        got = ckptfs.load_keys(f"{root}/{name}", ["model", "optim"])
        for k in PLACEMENTS:
            assert torch.equal(got["model"][k].view(torch.uint8),
                               full(k, shift).view(torch.uint8)), (name, k)
        assert got["optim"] == {"step": 3, "param_groups": [{"lr": 0.1, "betas": [0.9, 0.99]}]}
        # the set is DCP's torch.save bytes, never unpickled by ckptfs
        tags = md.tensors["extra/tags"]
        assert tags.dtype == "uint8" and tags.chunks[0].extra.get(OPAQUE) is True
        assert ckptfs.verify(f"{root}/{name}").ok, name


def test_writer_commits_a_ckptfs_index_and_no_pickle(saved):
    root, _ = saved
    files = sorted(os.path.relpath(os.path.join(d, f), f"{root}/plain")
                   for d, _, fs in os.walk(f"{root}/plain") for f in fs)
    assert files[0] == "ckptfs.index.json" and all(f.endswith(".safetensors") for f in files[1:])
    md = ckptfs.load_metadata(f"{root}/plain")
    assert {c.shape for c in md.tensors["model/w"].chunks} == {(384, 256)}  # DCP's two shards
    assert all(c.checksum for t in md.tensors.values() for c in t.chunks)


def test_dedup_planner_option_writes_replicas_on_the_lowest_rank(saved):
    root, _ = saved
    md = ckptfs.load_metadata(f"{root}/dedup")
    (chunk,) = md.tensors["model/b"].chunks
    assert "/r00000-" in chunk.file


def test_s3_checkpoint_is_a_ckptfs_checkpoint(saved):
    _, endpoint = saved
    md = ckptfs.load_metadata(f"s3://{BUCKET}/dcp", storage_options=s3_options(endpoint))
    assert md.backend == "safetensors_chunks" and "model/emb" in md.tensors


def test_every_checkpoint_loads_resharded_2_to_3(loaded):
    assert all(set(r) == set(LOADED) for r in loaded)


def test_resharded_load_reads_at_most_5_percent_more_than_needed(loaded):
    for name in PLUGIN:
        read = sum(r[name][0] for r in loaded)
        needed = sum(r[name][1] for r in loaded)
        assert needed > 0 and read <= 1.05 * needed, (name, read, needed)


def test_errors_stay_ckptfs_errors(tmp_path):
    sd = {"w": torch.zeros(4)}
    err = failure(lambda: dcp.load(sd, storage_reader=ckptfs.dcp.StorageReader(tmp_path / "none"),
                                   no_dist=True))
    assert isinstance(err, ckptfs.CheckpointNotFoundError) and "none" in str(err)
    url = tmp_path / "c"
    dcp.save({"w": torch.arange(4.0)}, storage_writer=ckptfs.dcp.StorageWriter(url), no_dist=True)
    (data,) = [os.path.join(d, f) for d, _, fs in os.walk(url / "data") for f in fs]
    with open(data, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    err = failure(lambda: dcp.load(sd, storage_reader=ckptfs.dcp.StorageReader(url), no_dist=True))
    assert isinstance(err, ckptfs.IntegrityError) and "'w'" in str(err), err
    bad = {"z": torch.zeros(2, dtype=torch.complex128)}
    err = failure(lambda: dcp.save(bad, storage_writer=ckptfs.dcp.StorageWriter(tmp_path / "z"),
                                   no_dist=True))
    assert isinstance(err, ckptfs.UnsupportedValueError) and "'z'" in str(err), err
    # the failed save gave the root back: the next one commits
    dcp.save({"z": torch.ones(2)}, storage_writer=ckptfs.dcp.StorageWriter(tmp_path / "z"),
             no_dist=True)
    assert ckptfs.load_keys(tmp_path / "z")["z"].tolist() == [1.0, 1.0]


def test_writer_refuses_a_read_only_backend():
    with pytest.raises(ckptfs.ConfigError, match="read-only"):
        ckptfs.dcp.StorageWriter("x", backend="hf_safetensors")


def test_reader_serves_a_hugging_face_safetensors_directory(tmp_path):
    from safetensors.torch import save_file

    w = torch.randn(6, 4)
    save_file({"model.w": w, "model.b": torch.arange(4, dtype=torch.int32)},
              str(tmp_path / "model.safetensors"))
    md = ckptfs.load_metadata(tmp_path)
    assert md.backend == "hf_safetensors"
    sd = {key: torch.zeros(md.tensors[key].shape, dtype=t) for key, t in
          (("model.w", torch.float32), ("model.b", torch.int32))}
    reader = ckptfs.dcp.StorageReader(tmp_path)
    dcp.load(sd, storage_reader=reader, no_dist=True)
    assert torch.equal(sd["model.w"], w) and sd["model.b"].tolist() == [0, 1, 2, 3]
    assert reader.stats.bytes_read == reader.stats.bytes_needed == 6 * 4 * 4 + 4 * 4
