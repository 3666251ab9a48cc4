"""DCP's own behaviours through ``ckptfs.dcp``, beside DCP's ``FileSystemWriter`` /
``FileSystemReader`` doing the same, on spawned gloo ranks.

Each scenario runs once with DCP's storage classes and once with ckptfs's in their place, the
same calls with the same arguments, and the two outcomes are compared: a second save to one path
replaces the first (DCP's default ``overwrite``), ``overwrite=False`` refuses in DCP's words,
``dcp.async_save`` in DCP's saving process, ``cache_staged_state_dict``, and an FSDP2 model and
optimizer saved on 2 ranks and loaded on 3. Where ckptfs differs on purpose it is asserted
too: DCP's stream transforms (a gzip ``StreamTransformExtension``, the kind ``ZStandard`` is) are
refused by name instead of applied, and a replaced checkpoint stays loadable until the new index
commits (while a save to it runs, and after that save failed).
"""

from __future__ import annotations

import gzip
import json
import os
from typing import IO

import ckptfs.dcp
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import ckptfs
from ckptfs.testing.ranks import run_ranks

KINDS = ("dcp", "ckptfs")


class Gzip(StreamTransformExtension):
    """A stream transform as DCP's ``ZStandard`` is one (gzip: in the standard library)."""

    @staticmethod
    def registry_name() -> str:
        return "stream.gzip"

    @staticmethod
    def from_descriptor(version: str) -> Gzip:
        return Gzip()

    def get_descriptor(self) -> str:
        return f"{self.registry_name()}/1"

    def transform_to(self, output: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=output, mode="wb")  # type: ignore[return-value]

    def transform_from(self, input: IO[bytes]) -> IO[bytes]:
        return gzip.GzipFile(fileobj=input, mode="rb")  # type: ignore[return-value]


def writer(kind: str, path: str, **kw):
    return FileSystemWriter(path, **kw) if kind == "dcp" else ckptfs.dcp.StorageWriter(path, **kw)


def reader(kind: str, path: str, **kw):
    return FileSystemReader(path, **kw) if kind == "dcp" else ckptfs.dcp.StorageReader(path, **kw)


def plain(shift: float) -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(12, 8, generator=g) + shift, "step": int(shift)}


def loaded(kind: str, path: str, **kw) -> dict:
    sd = {"w": torch.zeros(12, 8), "step": -1}
    dcp.load(sd, storage_reader=reader(kind, path, **kw))
    return sd


def same(sd: dict, shift: float) -> bool:
    want = plain(shift)
    return torch.equal(sd["w"], want["w"]) and sd["step"] == want["step"]


def refusal(fn) -> str:
    """The words of the first rank's error inside the CheckpointException ``fn`` raises."""
    try:
        fn()
    except CheckpointException as e:
        return " ".join(str(err) for err, _ in e.failures.values())
    return ""


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8))


def sharded(world: int):
    """An FSDP2 model and its Adam optimizer on ``world`` ranks; stepped once where
    ``world == 2`` (the saved state), untouched otherwise (the target of the load)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    m = model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    if world == 2:
        m(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()
    else:
        m(torch.zeros(1, 16)).sum().backward()  # Adam's state exists, to be filled by the load
        opt.step()
    return m, opt


def full_state(m, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True,
                                                               cpu_offload=True))
    return {"model": msd, "optim": osd}


def cached_staging(kind: str, path: str) -> str:
    """Two ``async_save`` calls through one writer staging into its cached (pinned) copy: "ok",
    or the error both raise where pinned memory needs an accelerator the host lacks."""
    cached = writer(kind, path, cache_staged_state_dict=True)
    try:
        for shift in (5.0, 6.0):
            dcp.async_save(plain(shift), storage_writer=cached).result()
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "ok" if same(loaded(kind, path), 6.0) else "wrong values"


def behaviours(kind: str, base: str) -> dict:
    """The outcome of each behaviour with the ``kind`` of storage, under ``base``."""
    path = f"{base}/twice"
    got = {}
    dcp.save(plain(0.0), storage_writer=writer(kind, path))
    dcp.save(plain(1.0), storage_writer=writer(kind, path))
    got["second_save_replaces"] = same(loaded(kind, path), 1.0)
    words = refusal(lambda: dcp.save(plain(2.0), storage_writer=writer(kind, path,
                                                                       overwrite=False)))
    got["refused_in_dcp_words"] = "Checkpoint already exists" in words
    got["refusal_kept_checkpoint"] = same(loaded(kind, path), 1.0)
    dcp.async_save(plain(4.0), storage_writer=writer(kind, f"{base}/process"),
                   async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
    got["async_process"] = same(loaded(kind, f"{base}/process"), 4.0)
    got["cached_staging"] = cached_staging(kind, f"{base}/cached")
    return got


def _save(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out = {}
    for kind in KINDS:
        out[kind] = behaviours(kind, f"{root}/{kind}")
        m, opt = sharded(world)
        msd, osd = get_state_dict(m, opt)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer(kind, f"{root}/{kind}/fsdp"))
        full = full_state(m, opt)
        if rank == 0:
            torch.save(full, f"{root}/fsdp-{kind}.pt")
    with open(f"{root}/save{rank}.json", "w") as f:
        json.dump(out, f)


def _load(rank: int, world: int, root: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for kind in KINDS:
        m, opt = sharded(world)
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, storage_reader=reader(kind, f"{root}/{kind}/fsdp"))
        set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        got = full_state(m, opt)
        if rank == 0:
            torch.save(got, f"{root}/fsdp-{kind}-loaded.pt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("parity"))
    run_ranks(2, _save, root, timeout=600)
    out = []
    for r in range(2):
        with open(f"{root}/save{r}.json") as f:
            out.append(json.load(f))
    return root, out


@pytest.mark.slow
def test_each_behaviour_has_the_same_outcome_as_dcps_own_storage(saved):
    _, out = saved
    for rank in out:
        assert rank["ckptfs"] == rank["dcp"], rank
        assert all(rank["ckptfs"].values()), rank
        assert rank["ckptfs"]["cached_staging"] == "ok" or (
            not torch.accelerator.is_available() and "accelerator" in rank["ckptfs"]["cached_staging"])


def flat(sd, prefix: str = "") -> dict:
    if isinstance(sd, dict):
        return {k: v for key, sub in sd.items() for k, v in flat(sub, f"{prefix}{key}/").items()}
    if isinstance(sd, list):
        return {k: v for i, sub in enumerate(sd) for k, v in flat(sub, f"{prefix}{i}/").items()}
    return {prefix: sd}


@pytest.mark.slow
def test_fsdp2_state_saved_on_2_ranks_loads_on_3_as_with_dcp(saved):
    root, _ = saved
    run_ranks(3, _load, root, timeout=600)
    want = flat(torch.load(f"{root}/fsdp-dcp.pt", weights_only=True))
    assert flat(torch.load(f"{root}/fsdp-ckptfs.pt", weights_only=True)).keys() == want.keys()
    for kind in KINDS:
        got = flat(torch.load(f"{root}/fsdp-{kind}-loaded.pt", weights_only=True))
        assert got.keys() == want.keys(), kind
        for k, v in want.items():
            assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, (kind, k)
    assert any(k.startswith("optim/state/") for k in want)


def test_extensions_are_applied_by_dcp_and_refused_by_name_by_ckptfs(tmp_path):
    registry = ExtensionRegistry()
    registry.register(Gzip)
    dcp.save(plain(1.0), storage_writer=FileSystemWriter(tmp_path / "dcp", _extensions=[Gzip()]),
             no_dist=True)
    assert same(loaded("dcp", str(tmp_path / "dcp"), _extension_registry=registry), 1.0)
    with pytest.raises(ckptfs.ConfigError, match=r"_extensions=\['stream.gzip/1'\].*compressor"):
        ckptfs.dcp.StorageWriter(tmp_path / "c", _extensions=[Gzip()])
    assert not (tmp_path / "c").exists()
    # DCP's transformed tensors, read through ckptfs's reader: refused, naming the transform
    # (a transformed value is left out of the index with a warning naming it)
    target = {"w": torch.zeros(12, 8)}
    with pytest.warns(UserWarning, match=r"step \(DCP transforms \['stream.gzip/1'\]\)"):
        err = refusal(lambda: dcp.load(target, storage_reader=ckptfs.dcp.StorageReader(
            tmp_path / "dcp", _extension_registry=registry), no_dist=True))
    assert "'w'" in err and "stream.gzip/1" in err, err


def test_writer_arguments_are_mapped_or_refused_by_name(tmp_path):
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    w = ckptfs.dcp.StorageWriter(tmp_path, sync_files=False, thread_count=64)
    assert w.store_options is not None
    assert not w.store_options.fsync and w.store_options.max_concurrency == 64
    assert ckptfs.dcp.StorageWriter(tmp_path).store_options is None  # the defaults: unchanged
    w = ckptfs.dcp.StorageWriter(tmp_path / "one", single_file_per_rank=False)
    dcp.save({"a": torch.ones(3), "b": torch.zeros(5)}, storage_writer=w, no_dist=True)
    assert len(ckptfs.load_metadata(tmp_path / "one").files) == 2  # one file per item
    for kw, name in [({"thread_count": 0}, "thread_count"),
                     ({"per_thread_copy_ahead": -1}, "per_thread_copy_ahead"),
                     ({"single_file_per_rank": False, "backend": "zarr"}, "single_file_per_rank"),
                     ({"serialization_format": SerializationFormat.SAFETENSORS},
                      "serialization_format")]:
        with pytest.raises(ckptfs.ConfigError, match=name):
            ckptfs.dcp.StorageWriter(tmp_path / "x", **kw)


class LoadWhileSaving(DefaultSavePlanner):
    """Loads the checkpoint being replaced from inside the save, after the target was claimed
    (DCP resolves each item's data in ``write_data``), then fails the save when asked."""

    def __init__(self, path: str, fail: bool) -> None:
        super().__init__()
        self.path, self.fail, self.seen = path, fail, None

    def resolve_data(self, write_item):
        if self.seen is None:
            self.seen = ckptfs.load_keys(self.path)["w"].clone()
        if self.fail:
            raise ckptfs.StorageError("no space left on the device")
        return super().resolve_data(write_item)


def test_a_replaced_checkpoint_stays_loadable_until_the_new_index_commits(tmp_path):
    path = str(tmp_path / "c")
    dcp.save(plain(0.0), storage_writer=ckptfs.dcp.StorageWriter(path), no_dist=True)
    failing = LoadWhileSaving(path, fail=True)
    assert "no space left" in refusal(lambda: dcp.save(
        plain(1.0), storage_writer=ckptfs.dcp.StorageWriter(path), planner=failing, no_dist=True))
    assert torch.equal(failing.seen, plain(0.0)["w"])
    assert same(loaded("ckptfs", path), 0.0)  # the failed save left it loadable
    ok = LoadWhileSaving(path, fail=False)
    dcp.save(plain(1.0), storage_writer=ckptfs.dcp.StorageWriter(path), planner=ok, no_dist=True)
    assert torch.equal(ok.seen, plain(0.0)["w"])  # loadable while the new one was written
    assert same(loaded("ckptfs", path), 1.0) and ckptfs.verify(path).ok
    assert len(os.listdir(tmp_path / "c" / "data")) == 1  # the replaced data files are gone


def nested_state() -> dict:
    g = torch.Generator().manual_seed(5)
    return {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.arange(4, dtype=torch.int32)},
            "optim": {"step": 7, "param_groups": [{"lr": 0.1}]}}


def test_torch_save_file_and_back_as_dcps_format_utils(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    state = nested_state()
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    dcp.save(state, storage_writer=ckptfs.dcp.StorageWriter(tmp_path / "ckptfs"), no_dist=True)
    dcp_to_torch_save(tmp_path / "dcp", tmp_path / "dcp.pt")
    assert ckptfs.to_torch_save(tmp_path / "ckptfs", tmp_path / "ckptfs.pt") == tmp_path / "ckptfs.pt"
    want = flat(torch.load(tmp_path / "dcp.pt", weights_only=True))
    got = flat(torch.load(tmp_path / "ckptfs.pt", weights_only=True))
    assert got.keys() == want.keys() == flat(state).keys()
    for k, v in want.items():
        assert torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v, k
    with pytest.raises(ckptfs.CheckpointExistsError, match="ckptfs.pt"):
        ckptfs.to_torch_save(tmp_path / "ckptfs", tmp_path / "ckptfs.pt")
    assert sorted(os.listdir(tmp_path)) == ["ckptfs", "ckptfs.pt", "dcp", "dcp.pt"]  # no leftovers
    # and back: the file as a checkpoint, loaded through each library's reader
    torch_save_to_dcp(tmp_path / "dcp.pt", tmp_path / "dcp2")
    ckptfs.from_torch_save(tmp_path / "ckptfs.pt", tmp_path / "ckptfs2")
    for kind, path in (("dcp", tmp_path / "dcp2"), ("ckptfs", tmp_path / "ckptfs2")):
        target = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.int32)},
                  "optim": {"step": 0, "param_groups": [{"lr": 0.0}]}}
        dcp.load(target, storage_reader=reader(kind, str(path)), no_dist=True)
        assert flat(target).keys() == flat(state).keys()
        for k, v in flat(state).items():
            assert torch.equal(flat(target)[k], v) if isinstance(v, torch.Tensor) else flat(target)[k] == v, (kind, k)


def test_from_torch_save_refuses_what_weights_only_refuses(tmp_path):
    import datetime

    torch.save({"w": torch.ones(2), "when": datetime.date(2020, 1, 1)}, tmp_path / "x.pt")
    with pytest.raises(ckptfs.UnsupportedValueError, match=r"x\.pt.*weights_only"):
        ckptfs.from_torch_save(tmp_path / "x.pt", tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="none.pt"):
        ckptfs.from_torch_save(tmp_path / "none.pt", tmp_path / "c")


def test_a_checkpoint_of_dcps_own_writer_is_replaced_by_default(tmp_path):
    path = str(tmp_path / "c")
    dcp.save(plain(0.0), storage_writer=FileSystemWriter(path), no_dist=True)
    dcp.save(plain(1.0), storage_writer=ckptfs.dcp.StorageWriter(path), no_dist=True)
    assert same(loaded("ckptfs", path), 1.0) and ckptfs.verify(path).ok
    assert ckptfs.load_metadata(path).backend == "safetensors_chunks"
    assert sorted(os.listdir(path)) == ["ckptfs.index.json", "data"]  # DCP's files are gone
