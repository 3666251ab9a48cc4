"""torch_dist-1 against the real torch.distributed.checkpoint (torch 2.13).

Both directions, resharded and bit-exact, with fp32/bf16/int64 DTensors, plain tensors and
Python values: ckptfs-written checkpoints load with ``dcp.load`` and DCP-written ones with
``ckptfs.load`` (2 -> 1, 2 -> 3, 2-D mesh). Resharded loads from DCP files read only the bytes
they need plus small blob headers. ``.metadata`` pickles with foreign globals are refused and
never run. Three spawns in all: world 2 saves, world 3 loads, world 4 saves and loads on a
(2, 2) mesh; everything else runs in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import io
import json
import math
import os
import pickle
import re
import struct
import sys
import types
import zipfile
import zlib
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import ckptfs
from ckptfs.io.local_store import LocalStore
from ckptfs.layout import crc32 as zip_crc
from ckptfs.layout.backends.torch_dist import TorchDistBackend
from ckptfs.layout.backends.torch_dist_keys import dcp_leaves
from ckptfs.layout.backends.torch_dist_pickle import ForbiddenGlobalError
from ckptfs.layout.backends.torch_dist_zip import (
    DENSE_MAX,
    TAIL,
    _SparseWriter,
    locate_records,
    locate_tensor,
    run_on_bytes,
    tensor_blob,
)
from ckptfs.state.flatten import flatten
from ckptfs.testing.ranks import run_ranks

SHAPE = (12, 8)
BIG = (64, 256)  # 64 KiB of fp32: blob headers (~1.7 KB) are small next to its chunks
HEADER = 2 * TAIL  #: bound on the metadata bytes read per DCP blob (tail + head)
FAST = ckptfs.StoreOptions(max_gap=0)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(SHAPE, generator=g),
        "wbf": torch.randn(SHAPE, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (10,), generator=g),
        "plain": torch.randn(3, 5, generator=g),
        "big": torch.randn(BIG, generator=g),
    }


VALUES = {"step": 12, "lr": 3e-4, "name": "run-1", "nan": math.nan, "none": None,
          "betas": (0.9, 0.999), "milestones": [10, 20], "sched": {"gamma": 0.5, "last": {"epoch": 3}}}
BLANK = {"step": 0, "lr": 0.0, "name": "", "nan": 0.0, "none": "not-none", "betas": (0.0, 0.0),
         "milestones": [0, 0], "sched": {"gamma": 0.0, "last": {"epoch": 0}}}


def make_state(mesh, placements, fill: bool) -> dict:
    """The state dict; mesh None gives plain (whole) tensors."""
    ref = reference()

    def d(t, p=None):
        if mesh is None:
            return t.clone() if fill else torch.zeros_like(t)
        if fill:  # every rank holds the reference: no broadcast needed
            return distribute_tensor(t, mesh, p or placements, src_data_rank=None)
        return dtensor_zeros(t.shape, dtype=t.dtype, device_mesh=mesh, placements=p or placements)

    vals = VALUES if fill else BLANK
    return {
        "model": {"w32": d(ref["w32"]), "wbf": d(ref["wbf"]), "big": d(ref["big"])},
        "layers": [{"w": d(ref["w32"] + 1)}, {"w": d(ref["wbf"] * 2)}],
        "i64": d(ref["i64"], [Shard(0)] * (mesh.ndim if mesh is not None else 1)),
        "plain": ref["plain"].clone() if fill else torch.zeros(3, 5),
        **copy.deepcopy(vals),
    }


def check(sd: dict, case: str) -> list[str]:
    """Mismatches of a loaded state against the reference (local shards, no collectives)."""
    ref = reference()

    def local(x, want):
        if not isinstance(x, DTensor):
            return x, want
        shape, off = compute_local_shape_and_global_offset(want.shape, x.device_mesh, x.placements)
        return x.to_local(), want[tuple(slice(o, o + n) for o, n in zip(off, shape))]

    pairs = {"model.w32": (sd["model"]["w32"], ref["w32"]),
             "model.wbf": (sd["model"]["wbf"], ref["wbf"]),
             "model.big": (sd["model"]["big"], ref["big"]),
             "layers.0.w": (sd["layers"][0]["w"], ref["w32"] + 1),
             "layers.1.w": (sd["layers"][1]["w"], ref["wbf"] * 2),
             "i64": (sd["i64"], ref["i64"]), "plain": (sd["plain"], ref["plain"])}
    bad = []
    for k, (got, want) in pairs.items():
        got, want = local(got, want)
        if not (got.dtype == want.dtype and torch.equal(got, want)):
            bad.append(f"{case}: {k}")
    for k, want in VALUES.items():
        got = sd[k]
        ok = math.isnan(got) if k == "nan" else (got == want and type(got) is type(want))
        if not ok:
            bad.append(f"{case}: value {k} = {got!r}")
    return bad


def _local_box(x) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, shape) this process holds of ``x``: torch's own DTensor geometry, or the whole
    of a plain tensor."""
    if isinstance(x, DTensor):
        shape, off = compute_local_shape_and_global_offset(x.shape, x.device_mesh, x.placements)
        return tuple(off), tuple(shape)
    return (0,) * x.dim(), tuple(x.shape)


def touched(dcp_dir: str, sd: dict) -> tuple[int, int, int]:
    """(bytes this process's tensors need, DCP items they overlap, those items' bytes), from
    DCP's own metadata and flattening and torch's shard geometry, not from ckptfs."""
    md = FileSystemReader(dcp_dir).read_metadata()
    flat, _ = flatten_state_dict(sd)
    needed = blobs = nbytes = 0
    for fqn, x in flat.items():
        if not isinstance(x, torch.Tensor):
            continue
        (off, shape) = _local_box(x)
        needed += math.prod(shape) * x.element_size()
        for c in md.state_dict_metadata[fqn].chunks:
            if all(o < co + cs and co < o + n for o, n, co, cs in zip(off, shape, c.offsets, c.sizes)):
                blobs += 1
                nbytes += md.storage_data[MetadataIndex(fqn, c.offsets)].length
    return needed, blobs, nbytes


def check_dcp_read(res: ckptfs.LoadResult, dcp_dir: str, sd: dict, case: str) -> list[str]:
    """A load from DCP-written files reads what it needs plus at most HEADER per item."""
    needed, blobs, _ = touched(dcp_dir, sd)
    if res.bytes_needed != needed or not needed <= res.bytes_read <= needed + HEADER * blobs:
        return [f"{case}: read {res.bytes_read} B (ckptfs says {res.bytes_needed} needed) for "
                f"{needed} B over {blobs} items"]
    return []


# -- spawned ranks ---------------------------------------------------------------------------------


def save_world2(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    ckptfs.save(make_state(mesh, [Shard(0)], True), f"{root}/ck2", backend="torch_dist")
    dcp.save(make_state(mesh, [Shard(1)], True),
             storage_writer=FileSystemWriter(f"{root}/dcp2", thread_count=2))


def load_world3(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    fails: list[str] = []
    for p in ([Shard(0)], [Shard(1)]):  # DCP reads what ckptfs wrote
        sd = make_state(mesh, p, False)
        dcp.load(sd, checkpoint_id=f"{root}/ck2")
        fails += check(sd, f"dcp.load ck2 -> 3 {p}")
    for p in ([Shard(0)], [Shard(1)], [Replicate()]):  # ckptfs reads what DCP wrote
        sd = make_state(mesh, p, False)
        res = ckptfs.load(sd, f"{root}/dcp2", store_options=FAST)
        fails += check(sd, f"ckptfs.load dcp2 -> 3 {p}") + check_dcp_read(res, f"{root}/dcp2", sd, str(p))
    # a resharded read of the big tensor fetches a fraction of the whole chunks DCP would load
    big = {"model": {"big": make_state(mesh, [Shard(0)], False)["model"]["big"]}}
    res = ckptfs.load(big, f"{root}/dcp2", store_options=FAST)
    needed, blobs, whole = touched(f"{root}/dcp2", big)
    if not (needed <= res.bytes_read <= needed + HEADER * blobs and res.bytes_read < whole / 2):
        fails.append(f"big: read {res.bytes_read} of {whole} B, needed {needed} B")
    # ckptfs reads its own torch_dist checkpoint through the index: exactly the bytes needed
    sd = make_state(mesh, [Shard(1)], False)
    res = ckptfs.load(sd, f"{root}/ck2", store_options=FAST)
    fails += check(sd, "ckptfs.load ck2 -> 3")
    if res.bytes_read != res.bytes_needed:
        fails.append(f"ck2: read {res.bytes_read} B, needed {res.bytes_needed} B")
    dist.barrier()
    assert not fails, fails


def world4_2d(rank: int, world: int, root: str) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    ckptfs.save(make_state(mesh, [Replicate(), Shard(0)], True), f"{root}/ck4", backend="torch_dist")
    dcp.save(make_state(mesh, [Shard(0), Shard(1)], True), checkpoint_id=f"{root}/dcp4")
    dist.barrier()
    fails: list[str] = []
    for src in ("ck4", "ck2"):
        for p in ([Shard(0), Shard(1)], [Shard(1), Replicate()]):
            sd = make_state(mesh, p, False)
            dcp.load(sd, checkpoint_id=f"{root}/{src}")
            fails += check(sd, f"dcp.load {src} -> 2x2 {p}")
    for src in ("dcp4", "dcp2"):
        for p in ([Replicate(), Shard(0)], [Shard(1), Shard(0)]):
            sd = make_state(mesh, p, False)
            res = ckptfs.load(sd, f"{root}/{src}", store_options=FAST)
            fails += check(sd, f"ckptfs.load {src} -> 2x2 {p}")
            fails += check_dcp_read(res, f"{root}/{src}", sd, f"{src} {p}")
    dist.barrier()
    assert not fails, fails


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("torch_dist"))
    run_ranks(2, save_world2, path)
    return path


@pytest.fixture(scope="module")
def root4(root) -> str:
    run_ranks(4, world4_2d, root)
    return root


@pytest.mark.slow
def test_two_to_three_ranks_both_directions(root):
    run_ranks(3, load_world3, root)


@pytest.mark.slow
def test_two_d_mesh_both_directions(root4):
    idx = ckptfs.load_metadata(f"{root4}/ck4")
    assert idx.backend == "torch_dist"
    # replicated over dp: 2 row chunks stored once each, not 4
    assert [c.shape for c in idx.tensors["model/w32"].chunks] == [(6, 8), (6, 8)]
    assert sorted(os.listdir(f"{root4}/ck4")) == [".metadata", ckptfs.INDEX_FILE, "data"]
    (save_id,) = os.listdir(f"{root4}/ck4/data")
    files = sorted(os.listdir(f"{root4}/ck4/data/{save_id}"))
    assert files == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
                     "__values.distcp"], files
    assert sorted(idx.files) == [f"data/{save_id}/{f}" for f in files[:4]]


@pytest.mark.slow
def test_two_and_four_to_one(root4):
    for src in ("ck2", "ck4"):  # DCP, one process, plain tensors
        sd = make_state(None, None, False)
        dcp.load(sd, checkpoint_id=f"{root4}/{src}", no_dist=True)
        assert check(sd, f"dcp.load {src} -> 1") == []
    for src in ("dcp2", "dcp4"):  # ckptfs, one process
        sd = make_state(None, None, False)
        res = ckptfs.load(sd, f"{root4}/{src}", store_options=FAST)
        assert check(sd, f"ckptfs.load {src} -> 1") == []
        assert res.missing_keys == [] and res.unexpected_keys == []
        assert check_dcp_read(res, f"{root4}/{src}", sd, src) == []
    # partial load: half the rows of the big tensor, from DCP's 2-rank column chunks
    half = ckptfs.ShardedTensor(torch.zeros(32, 256), BIG, (16, 0))
    res = ckptfs.load({"model": {"big": half}}, f"{root4}/dcp2", store_options=FAST)
    assert torch.equal(half.local_tensor, reference()["big"][16:48])
    assert res.bytes_needed == 32 * 256 * 4
    assert res.bytes_needed <= res.bytes_read <= res.bytes_needed + 2 * HEADER
    whole = ckptfs.load_keys(f"{root4}/dcp2", ["model/big"])
    assert torch.equal(whole["model"]["big"], reference()["big"])


@pytest.mark.slow
def test_sniffed_index_describes_dcp_checkpoint(root):
    idx = ckptfs.load_metadata(f"{root}/dcp2")
    assert idx.backend == "torch_dist" and idx.writer["library"] == "torch.distributed.checkpoint"
    w = idx.tensors["model/w32"]
    assert (w.dtype, w.shape, w.extra["dcp_fqn"]) == ("float32", SHAPE, "model.w32")
    assert [c.offsets for c in w.chunks] == [(0, 0), (0, 4)]  # Shard(1) on 2 ranks
    assert idx.tensors["layers/1/w"].dtype == "bfloat16" and idx.tensors["i64"].dtype == "int64"
    assert idx.values["betas/0"] == 0.9 and idx.containers["betas"] == "tuple"
    assert idx.values["milestones/1"] == 20 and idx.containers["layers"] == "list"
    assert idx.values["nan"] == {"$float": "nan"} and idx.values["none"] is None
    assert len({c.file for t in idx.tensors.values() for c in t.chunks}) == 4  # thread_count=2
    assert all(c.byte_offset is None and c.extra["item_length"] > 0
               for t in idx.tensors.values() for c in t.chunks)


# -- format details ---------------------------------------------------------------------------------


def test_zip_crc32_is_zlibs_from_isal_where_installed():
    """The blobs' CRC-32 comes from isal where it imports, with zlib's value (any buffer, any
    starting value)."""
    isal_zlib = pytest.importorskip("isal.isal_zlib")
    assert zip_crc._crc32 is isal_zlib.crc32
    data = memoryview(torch.randn(1000, 3).to(torch.bfloat16).view(torch.uint8).numpy())
    assert zip_crc.crc32(data) == zlib.crc32(data)
    assert zip_crc.crc32(data[5:], 77) == zlib.crc32(data[5:], 77)


@pytest.mark.parametrize("t", [
    torch.arange(10.0), torch.randn(3, 4).to(torch.bfloat16), torch.tensor(3),
    torch.zeros(0, 2), torch.arange(20.0).reshape(4, 5)[1:3],
    torch.ones(3, dtype=torch.float8_e4m3fn), torch.tensor([True, False]),
    torch.arange(6, dtype=torch.int64).reshape(2, 3),
    torch.arange(DENSE_MAX // 4 + 16, dtype=torch.float32),  # its template from a sparse sink
], ids=["f32", "bf16", "0d", "empty", "row-view", "f8", "bool", "i64", "over-dense-max"])
def test_blob_is_byte_identical_to_torch_save(t):
    other = t.clone()
    if other.numel():  # same dtype and shape, different bytes
        raw = other.reshape(-1).view(torch.uint8)
        raw[0] = raw[0] ^ 1
    for x in (t, other):  # the second reuses the (dtype, shape) container template
        blob = tensor_blob(x.contiguous())
        bio = io.BytesIO()
        torch.save(x.clone(), bio)
        assert blob.head + bytes(blob.data) + blob.tail == bio.getvalue()
        layout = run_on_bytes(locate_tensor(blob.nbytes), bio.getvalue())
        assert layout.data_offset == blob.data_offset and layout.data_offset % 64 == 0
        assert layout.raw_problem(x.dtype, tuple(x.shape)) is None


def test_sparse_writer_joins_continuing_writes_and_reads_later_over_earlier():
    w = _SparseWriter()
    w.write(b"ab")
    w.write(memoryview(b"cd"))
    w.seek(10, 1)  # a hole, never allocated
    w.write(b"ef")
    w.seek(1)
    w.write(b"X")  # an overwrite: a part of its own, read over the earlier bytes
    assert [(p, bytes(d)) for p, d in w.parts] == [(0, b"abcd"), (14, b"ef"), (1, b"X")]
    assert w.size == 16 and w.read_range(0, 16) == b"aXcd" + bytes(10) + b"ef"
    assert w.untouched(4, 14) and not w.untouched(3, 5) and not w.untouched(13, 15)


def test_items_and_metadata_match_what_dcp_writes(tmp_path):
    """World 1: every tensor item ckptfs writes is byte-identical to DCP's, and DCP reads the same
    state_dict_metadata and planner_data from both ``.metadata`` files."""
    sd = make_state(None, None, True)
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    ckptfs.save(sd, tmp_path / "ck", backend="torch_dist")
    ours = FileSystemReader(str(tmp_path / "ck")).read_metadata()
    theirs = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert ours.planner_data == theirs.planner_data
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert set(ours.storage_data) == set(theirs.storage_data)
    for idx, info in theirs.storage_data.items():
        mine = ours.storage_data[idx]
        a = (tmp_path / "dcp" / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        b = (tmp_path / "ck" / mine.relative_path).read_bytes()[mine.offset : mine.offset + mine.length]
        if idx.offset is not None:  # tensors: identical blobs
            assert a == b, idx
        else:  # values: the same object
            va, vb = (torch.load(io.BytesIO(x), weights_only=True) for x in (a, b))
            assert va == vb or (math.isnan(va) and math.isnan(vb)), idx
        assert mine.offset % 64 == 0
    # the index points inside each blob at the raw storage bytes
    index = ckptfs.load_metadata(tmp_path / "ck")
    entry = index.tensors["model/big"]
    (c,) = entry.chunks
    raw = (tmp_path / "ck" / c.file).read_bytes()[c.byte_offset : c.byte_offset + c.byte_length]
    assert raw == sd["model"]["big"].numpy().tobytes()
    assert c.extra["item_offset"] < c.byte_offset < c.extra["item_offset"] + c.extra["item_length"]


def test_dcp_leaves_match_dcp_flatten():
    t = torch.ones(2)
    sd = {"a": {"b": t, "c": 1}, "l": [t, 2, {"x": t}], "pl": [1, [2, 3]], "tp": (1, "x"),
          "e": [], "ed": {}, "n": {"0": t, 1: 2.5}, "dots.in.key": t, "ll": [[t], [1]],
          "ld": [{}, t], "lt": [(1, 2)], "s": "str", "none": None}
    flat = flatten(sd)
    leaves = dcp_leaves(flat.tensors, flat.values, flat.containers)
    dcp_flat, mapping = flatten_state_dict(sd)
    assert {x.fqn: x.path for x in leaves} == mapping
    for x in leaves:
        if not x.tensor:
            assert x.value == dcp_flat[x.fqn] and type(x.value) is type(dcp_flat[x.fqn]), x.fqn


def test_tuple_of_tensors_is_refused(tmp_path):
    with pytest.raises(ckptfs.UnsupportedValueError, match="'t/0'.*inside 't'"):
        ckptfs.save({"t": (torch.ones(2), 1)}, tmp_path / "x", backend="torch_dist")
    assert not (tmp_path / "x" / ckptfs.INDEX_FILE).exists()


def test_non_contiguous_dcp_item_is_decoded(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    dcp.save({"t": base.T, "u": base}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    out = {"t": torch.zeros(6, 4), "u": torch.zeros(4, 6)}
    res = ckptfs.load(out, tmp_path / "d", store_options=FAST)
    assert torch.equal(out["t"], base.T) and torch.equal(out["u"], base)
    assert res.bytes_read > res.bytes_needed  # the strided item was fetched whole


def test_zip64_central_directory(monkeypatch):
    monkeypatch.setattr(zipfile, "ZIP64_LIMIT", 8)  # every record and the directory go zip64
    bio = io.BytesIO()
    with zipfile.ZipFile(bio, "w", zipfile.ZIP_STORED) as z:
        for i in range(5):
            z.writestr(f"archive/f{i}", bytes(range(40 + i)))
    data = bio.getvalue()
    assert b"PK\x06\x06" in data  # a zip64 end record was written
    recs = run_on_bytes(locate_records(len(data)), data)
    want = {i.filename: (i.header_offset, i.file_size) for i in zipfile.ZipFile(io.BytesIO(data)).infolist()}
    assert {r.name: (r.header_offset, r.size) for r in recs} == want


# -- refusing foreign pickles ---------------------------------------------------------------------


def _side_effect(path: str) -> str:
    with open(path, "w") as f:
        f.write("ran")
    return "done"


@dataclass
class _Evil:
    path: str

    def __reduce__(self):
        return (_side_effect, (self.path,))


class _OsSystem:
    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def test_metadata_smuggling_foreign_globals_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    legit = Metadata(state_dict_metadata={}, planner_data={"x": ("x",)}, storage_data={})
    smuggled = Metadata(state_dict_metadata={}, planner_data=_Evil(str(marker)), storage_data={})
    payloads = {
        "posix.system": pickle.dumps(_OsSystem(f"touch {marker}")),
        f"{__name__}._side_effect": pickle.dumps(smuggled),
        "torch.distributed.checkpoint.metadata.os": b"ctorch.distributed.checkpoint.metadata\nos\n.",
        "torch.load": b"ctorch\nload\n.",
        "builtins.eval": b"cbuiltins\neval\n(S'1'\ntR.",
    }
    for i, (name, data) in enumerate(payloads.items()):
        d = tmp_path / f"ck{i}"
        d.mkdir()
        (d / ".metadata").write_bytes(data)
        with pytest.raises(ForbiddenGlobalError, match=re.escape(name)) as err:
            ckptfs.load_metadata(d)
        assert str(d / ".metadata") in str(err.value)
        with pytest.raises(ForbiddenGlobalError):
            ckptfs.load({"x": torch.zeros(1)}, d)
        assert not marker.exists(), name
    pickle.loads(pickle.dumps(legit))  # the legit twin is fine for pickle ...
    pickle.loads(payloads[f"{__name__}._side_effect"])  # ... and the payload is live
    assert marker.exists()


def test_item_pickle_with_a_foreign_global_is_refused_unrun(tmp_path):
    """A DCP tensor item whose data.pkl (the pickle inside its torch.save zip) names a foreign
    global: ckptfs's data.pkl unpickler refuses it without running it, and so does the
    weights-only fallback; the load fails with ForbiddenGlobalError naming the key."""
    marker = tmp_path / "pwned"
    d = tmp_path / "d"
    dcp.save({"t": torch.arange(64.0).reshape(8, 8)}, checkpoint_id=str(d), no_dist=True)
    md = pickle.loads((d / ".metadata").read_bytes())  # written just now by DCP: trusted
    (info,) = md.storage_data.values()
    blob = bytearray((d / info.relative_path).read_bytes())
    item = bytes(blob[info.offset:info.offset + info.length])
    rec = next(r for r in zipfile.ZipFile(io.BytesIO(item)).infolist() if r.filename.endswith("/data.pkl"))
    nlen, elen = struct.unpack_from("<HH", item, rec.header_offset + 26)
    start = info.offset + rec.header_offset + 30 + nlen + elen
    evil = pickle.dumps(_Evil(str(marker)), protocol=2)
    assert rec.compress_type == zipfile.ZIP_STORED and len(evil) <= rec.file_size
    blob[start:start + rec.file_size] = evil.ljust(rec.file_size, b".")  # bytes after STOP are ignored
    (d / info.relative_path).write_bytes(bytes(blob))
    with pytest.raises(ForbiddenGlobalError, match="'t'"):
        ckptfs.load({"t": torch.zeros(8, 8)}, d)
    with pytest.raises(ForbiddenGlobalError):
        ckptfs.load_keys(d)
    assert not marker.exists()
    pickle.loads(evil)  # the payload is live
    assert marker.exists()


def test_byte_io_item_with_foreign_global_is_skipped(tmp_path):
    marker = tmp_path / "pwned"
    dcp.save({"t": torch.ones(2), "evil": _Evil(str(marker)), "ok": 5},
             checkpoint_id=str(tmp_path / "d"), no_dist=True)
    with pytest.warns(UserWarning, match=r"evil \(tests\.test_torch_dist\._side_effect\)"):
        idx = ckptfs.load_metadata(tmp_path / "d")
    assert "evil" not in idx.values and idx.values["ok"] == 5
    with pytest.raises(ckptfs.MissingKeysError, match="'evil'"):
        ckptfs.load({"t": torch.zeros(2), "evil": 0}, tmp_path / "d")
    out = {"t": torch.zeros(2), "ok": 0}
    ckptfs.load(out, tmp_path / "d")
    assert out["ok"] == 5 and torch.equal(out["t"], torch.ones(2))
    assert not marker.exists()


# -- Megatron-Core torch_dist ----------------------------------------------------------------------


def _mcore_pickle(md: Metadata) -> bytes:
    """``md`` pickled as megatron.core's MCoreMetadata (Megatron is not installed here)."""
    name = "megatron.core.dist_checkpointing.strategies.torch"
    mod = types.ModuleType(name)

    @dataclass
    class MCoreMetadata(Metadata):
        mcore_data: dict = field(default_factory=dict)

    MCoreMetadata.__module__ = name
    MCoreMetadata.__qualname__ = "MCoreMetadata"
    mod.MCoreMetadata = MCoreMetadata
    parts = name.split(".")
    fakes = {".".join(parts[:i]): types.ModuleType(".".join(parts[:i])) for i in range(1, len(parts))}
    fakes[name] = mod
    assert not set(fakes) & set(sys.modules)
    sys.modules.update(fakes)
    try:
        fields = dict(vars(md))
        fields["planner_data"] = None  # Megatron saves with flatten_state_dict=False
        return pickle.dumps(MCoreMetadata(mcore_data={"decoder.w": {"nd_orig_global_shape": None}},
                                          **fields))
    finally:
        for k in fakes:
            del sys.modules[k]


def _megatron_dir(tmp_path, common: object, version: int = 1):
    d = tmp_path / f"mcore{version}"
    w = torch.randn(6, 4)
    dcp.save({"decoder.w": w, "decoder.b": torch.arange(4)}, checkpoint_id=str(d), no_dist=True)
    md = FileSystemReader(str(d)).read_metadata()
    (d / ".metadata").write_bytes(_mcore_pickle(md))
    (d / "metadata.json").write_text(json.dumps({
        "sharded_backend": "torch_dist", "sharded_backend_version": version,
        "common_backend": "torch", "common_backend_version": 1}))
    torch.save(common, d / "common.pt")
    return d, w


def test_megatron_torch_dist_checkpoint(tmp_path, monkeypatch):
    common = {"iteration": 100, "checkpoint_version": 3.0, "opt_param_scheduler": {"num_steps": 5}}
    d, w = _megatron_dir(tmp_path, common)
    idx = ckptfs.load_metadata(d)
    assert idx.values["iteration"] == 100 and idx.values["opt_param_scheduler/num_steps"] == 5
    assert idx.writer["megatron"]["sharded_backend"] == "torch_dist"
    assert "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata" in idx.writer["pickle_globals"]
    out = {"decoder.w": torch.zeros(6, 4), "decoder.b": torch.zeros(4, dtype=torch.int64), "iteration": 0}
    ckptfs.load(out, d)
    assert torch.equal(out["decoder.w"], w) and out["iteration"] == 100

    # common.pt that weights_only refuses: a clear error, or skipped on request
    torch.save({"args": argparse.Namespace(lr=1.0), "iteration": 1}, d / "common.pt")
    with pytest.raises(ForbiddenGlobalError, match=r"common\.pt.*argparse\.Namespace.*CKPTFS_MEGATRON_COMMON"):
        ckptfs.load_metadata(d)
    monkeypatch.setenv("CKPTFS_MEGATRON_COMMON", "skip")
    with pytest.warns(UserWarning, match="argparse.Namespace"):
        assert "decoder.w" in ckptfs.load_metadata(d).tensors

    d2, _ = _megatron_dir(tmp_path, common, version=2)
    with pytest.raises(ckptfs.FormatVersionError, match="sharded_backend_version is 2"):
        ckptfs.load_metadata(d2)
    (d2 / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    assert asyncio.run(TorchDistBackend.sniff(LocalStore(str(d2)))) is None


def test_relative_path_escaping_the_checkpoint_is_refused(tmp_path):
    d = tmp_path / "d"
    dcp.save({"t": torch.ones(2)}, checkpoint_id=str(d), no_dist=True)
    md = FileSystemReader(str(d)).read_metadata()
    for info in md.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ckptfs.MalformedIndexError, match="inside the checkpoint"):
        ckptfs.load_metadata(d)



def test_saving_over_a_dcp_checkpoint_needs_overwrite(tmp_path):
    d = str(tmp_path / "d")
    dcp.save({"t": torch.ones(3)}, checkpoint_id=d, no_dist=True)
    before = (tmp_path / "d" / ".metadata").read_bytes()
    with pytest.raises(ckptfs.CheckpointExistsError, match="overwrite=True"):
        ckptfs.save({"t": torch.full((3,), 2.0)}, d, backend="torch_dist")
    assert (tmp_path / "d" / ".metadata").read_bytes() == before  # left intact
    ckptfs.save({"t": torch.full((3,), 2.0)}, d, backend="torch_dist", overwrite=True)
    out = {"t": torch.zeros(3)}
    dcp.load(out, checkpoint_id=d, no_dist=True)
    assert torch.equal(out["t"], torch.full((3,), 2.0))


def test_fsspec_store_both_directions(memfs):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    w = torch.randn(64, 32)
    dcp.save({"w": w, "step": 3}, storage_writer=FsspecWriter("memory://dcp"), no_dist=True)
    half = ckptfs.ShardedTensor(torch.zeros(32, 32), (64, 32), (32, 0))
    res = ckptfs.load({"w": half}, "memory://dcp", store_options=FAST)
    assert torch.equal(half.local_tensor, w[32:])
    assert res.bytes_needed == 32 * 32 * 4 < res.bytes_read <= res.bytes_needed + HEADER
    ckptfs.save({"w": w, "step": 3}, "memory://ck", backend="torch_dist")
    out = {"w": torch.zeros(64, 32), "step": 0}
    dcp.load(out, storage_reader=FsspecReader("memory://ck"), no_dist=True)
    assert torch.equal(out["w"], w) and out["step"] == 3
