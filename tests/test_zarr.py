"""Backends zarr-2 and zarr-3: round trips with resharding for every dtype and option set, the
checkpoints read back by plain zarr-python, codec checksums, missing chunks, Megatron-Core zarr
checkpoints, and the pieces (paths, grid, ML dtypes for zarr-python).

Spawns: one 2-rank save of every variant, one 3-rank load of every variant (Megatron included).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import ckptfs
from ckptfs.layout.backends import zarr_dtypes
from ckptfs.layout.backends.zarr_grid import Grid, grid_for_boxes, shrink
from ckptfs.layout.backends.zarr_paths import array_path, key_of_path, node_name
from ckptfs.layout.boxes import Box
from ckptfs.layout.dtypes import BY_NAME, NAMES
from ckptfs.layout.keys import encode_key
from ckptfs.testing.ranks import run_ranks

#: the ML dtypes by their names in ml_dtypes, which the tests using them import (at the top it
#: would cost every test worker a second of collection: tests/test_tools.py imports this module)
ML = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
VARIANTS: dict[str, tuple[int, dict]] = {
    "v2": (2, {}),
    "v2-slash": (2, {"dimension_separator": "/"}),
    "v2-zstd-crc": (2, {"compressor": "zstd", "checksum": True}),
    "v2-blosc": (2, {"compressor": "blosc", "level": 3, "blosc_shuffle": "bitshuffle",
                     "consolidated": True}),
    "v3": (3, {}),
    "v3-blosc-crc": (3, {"compressor": "blosc", "checksum": True, "consolidated": True}),
    "v3-shard": (3, {"sharding": True, "inner_chunk_bytes": 64}),
    "v3-shard-zstd-crc": (3, {"sharding": True, "inner_chunk_bytes": 64, "compressor": "zstd",
                              "checksum": True}),
}
RAW = {"v2", "v2-slash", "v3", "v3-shard"}  # uncompressed, no codec checksum: byte-range reads
ROWS, COLS = 7, 6  # 7 rows: 2 ranks hold 4 + 3 (an edge chunk, padded), 3 ranks 3 + 3 + 1
UNEVEN_SAVE = [(0, 1), (1, 6)]  # a ShardedTensor split the grid must refine (gcd 1)
UNEVEN_LOAD = [(0, 2), (2, 5), (5, 6)]


# -- reference data --------------------------------------------------------------------------
def _tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dt = BY_NAME[name].torch
    if name == "bool":
        return torch.rand(shape, generator=g) > 0.5
    if dt.is_complex:
        return torch.randn(shape, generator=g, dtype=dt)
    if dt.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).to(dt)
    return torch.randint(-100 if dt != torch.uint8 else 0, 100, shape, generator=g).to(dt)


def reference() -> dict[str, torch.Tensor]:
    """Global tensors by zarr path (written by hand: the test does not trust array_path)."""
    ref = {f"model/{n}": _tensor(n, (ROWS, COLS), i) for i, n in enumerate(NAMES)}
    ref.update({
        "col/w": _tensor("float32", (5, 9), 100),
        "uneven": _tensor("int32", (6, 4), 101),
        "rep": _tensor("float64", (3, 5), 102),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "%2Ehidden/%5F_dunder": _tensor("float16", (4,), 103),
        "%7Aarr.json": _tensor("int64", (2,), 104),
        "odd/%": _tensor("uint8", (3,), 105),
        "layers/0": _tensor("int16", (2, 2), 106),
        "%30": _tensor("int8", (2,), 107),
    })
    return ref


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _np_bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes() if a.size else b""


def _dtensor(t: torch.Tensor, mesh, dim: int, rank: int, world: int, fill: bool) -> DTensor:
    parts = torch.chunk(t, world, dim)
    local = parts[rank].clone() if rank < len(parts) else t.narrow(dim, 0, 0).clone()
    if not fill:
        local = torch.zeros_like(local)
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False, shape=t.shape,
                              stride=t.stride())


def _rows(t: torch.Tensor, bounds: list[tuple[int, int]], rank: int, fill: bool):
    lo, hi = bounds[rank]
    local = t[lo:hi].clone() if fill else torch.zeros_like(t[lo:hi])
    return ckptfs.ShardedTensor(local, tuple(t.shape), (lo, 0))


def make_state(rank: int, world: int, fill: bool) -> dict:
    """Save layout (world 2): model/* row-sharded, col/w column-sharded; load layout (world 3):
    model/* column-sharded, col/w row-sharded: every load reshards."""
    ref = reference()
    mesh = init_device_mesh("cpu", (world,))
    model_dim, col_dim = (0, 1) if world == 2 else (1, 0)
    bounds = UNEVEN_SAVE if world == 2 else UNEVEN_LOAD

    def plain(p):
        return ref[p].clone() if fill else torch.zeros_like(ref[p])

    return {
        "model": {n: _dtensor(ref[f"model/{n}"], mesh, model_dim, rank, world, fill) for n in NAMES},
        "col": {"w": _dtensor(ref["col/w"], mesh, col_dim, rank, world, fill)},
        "uneven": _rows(ref["uneven"], bounds, rank, fill),
        "rep": plain("rep"), "scalar": plain("scalar"), "empty": plain("empty"),
        ".hidden": {"__dunder": plain("%2Ehidden/%5F_dunder")},
        "zarr.json": plain("%7Aarr.json"),
        "odd": {"": plain("odd/%")},
        "layers": {0: plain("layers/0")},
        "0": plain("%30"),
        "step": 7 if fill else 0,
    }


def _locals(sd: dict) -> dict[str, torch.Tensor]:
    """zarr path -> this rank's local tensor of ``sd`` (as make_state lays it out)."""
    def loc(x):
        return x.to_local() if isinstance(x, DTensor) else x.local_tensor \
            if isinstance(x, ckptfs.ShardedTensor) else x

    out = {f"model/{n}": loc(sd["model"][n]) for n in NAMES}
    out.update({"col/w": loc(sd["col"]["w"]), "uneven": loc(sd["uneven"]), "rep": sd["rep"],
                "scalar": sd["scalar"], "empty": sd["empty"],
                "%2Ehidden/%5F_dunder": sd[".hidden"]["__dunder"], "%7Aarr.json": sd["zarr.json"],
                "odd/%": sd["odd"][""], "layers/0": sd["layers"][0], "%30": sd["0"]})
    return out


# -- Megatron-Core style checkpoint (zarr-python + file edits, as Megatron/tensorstore wrote) --
MEGATRON = {  # key -> (dtype name, shape, chunk shape: one rank's shard)
    "decoder.layers.self_attention.linear_proj.weight": ("float32", (7, 6), (4, 6)),
    "embedding.word_embeddings.weight": ("bfloat16", (7, 6), (7, 3)),
    "decoder.final_layernorm.weight": ("bfloat16", (6,), (6,)),
    "decoder.layers.mlp.step": ("int64", (3,), (2,)),
}


MEGATRON_COMMON = {"iteration": 3, "optimizer": {"param_groups": [{"lr": 0.5, "params": [0]}]}}


def megatron_tensors() -> dict[str, torch.Tensor]:
    return {k: _tensor(d, s, 200 + i) for i, (k, (d, s, _)) in enumerate(MEGATRON.items())}


def build_megatron(root: str) -> None:
    os.makedirs(root)
    for key, t in megatron_tensors().items():
        dtype, shape, chunks = MEGATRON[key]
        a = t.numpy() if dtype != "bfloat16" else t.view(torch.int16).numpy().view("V2")
        arr = zarr.create_array(store=f"{root}/{key}", shape=shape, chunks=chunks, dtype=a.dtype,
                                compressors=None, fill_value=None, zarr_format=2,
                                config={"write_empty_chunks": True})
        for lo in range(0, shape[0], chunks[0]):  # each "rank" writes its own chunk
            arr[lo : lo + chunks[0]] = a[lo : lo + chunks[0]]
        if dtype == "bfloat16":  # Megatron patches the dtype of bf16 arrays
            p = f"{root}/{key}/.zarray"
            doc = json.load(open(p))
            assert doc["dtype"] == "|V2" and doc["fill_value"] is None
            doc["dtype"] = "bfloat16"
            json.dump(doc, open(p, "w"))
    json.dump({"sharded_backend": "zarr", "sharded_backend_version": 1,
               "common_backend": "torch", "common_backend_version": 1},
              open(f"{root}/metadata.json", "w"))
    torch.save(MEGATRON_COMMON, f"{root}/common.pt")


def megatron_state(rank: int, world: int, fill: bool) -> dict:
    ref = megatron_tensors()
    mesh = init_device_mesh("cpu", (world,))
    dims = {"decoder.layers.self_attention.linear_proj.weight": 1,
            "embedding.word_embeddings.weight": 0, "decoder.final_layernorm.weight": 0,
            "decoder.layers.mlp.step": 0}
    return {k: _dtensor(t, mesh, dims[k], rank, world, fill) for k, t in ref.items()}


# -- spawned ranks ---------------------------------------------------------------------------
def save_all(rank: int, world: int, root: str) -> None:
    for name, (version, opts) in VARIANTS.items():
        ckptfs.save(make_state(rank, world, True), f"{root}/{name}", backend="zarr",
                    backend_version=version, backend_options=opts)


def load_all(rank: int, world: int, root: str) -> None:
    failures = []
    want = _locals(make_state(rank, world, True))
    for name in VARIANTS:
        sd = make_state(rank, world, False)
        res = ckptfs.load(sd, f"{root}/{name}", store_options=ckptfs.StoreOptions(max_gap=0))
        got = _locals(sd)
        bad = [p for p in want if _bits(got[p]) != _bits(want[p]) or got[p].shape != want[p].shape]
        if bad or sd["step"] != 7 or res.missing_keys or res.unexpected_keys:
            failures.append((name, bad, sd["step"], res.missing_keys, res.unexpected_keys))
        # uncompressed chunks: exactly the overlapping bytes are read, not whole chunks
        if name in RAW and res.bytes_read != res.bytes_needed:
            failures.append((name, "bytes_read", res.bytes_read, res.bytes_needed))
        if name not in RAW and res.bytes_read <= 0:
            failures.append((name, "nothing read"))
    sd = megatron_state(rank, world, False)
    res = ckptfs.load(sd, f"{root}/megatron", store_options=ckptfs.StoreOptions(max_gap=0))
    want_m = megatron_state(rank, world, True)
    bad = [k for k in sd if _bits(sd[k].to_local()) != _bits(want_m[k].to_local())]
    if bad or res.bytes_read != res.bytes_needed:
        failures.append(("megatron", bad, res.bytes_read, res.bytes_needed))
    dist.barrier()
    assert not failures, failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("zarr"))
    run_ranks(2, save_all, root)
    build_megatron(f"{root}/megatron")
    return root


# -- round trips -----------------------------------------------------------------------------
@pytest.mark.slow
def test_resharded_loads_every_variant_and_megatron(saved):
    run_ranks(3, load_all, saved)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VARIANTS))
def test_plain_zarr_python_reads_every_array(saved, name):
    import ml_dtypes

    ckptfs.register_zarr_dtypes()  # the one ckptfs hook zarr-python needs: bf16/float8 data types
    g = zarr.open_group(f"{saved}/{name}", mode="r")
    assert g.attrs["ckptfs"] == {"backend": "zarr", "backend_version": VARIANTS[name][0]}
    for path, t in reference().items():
        a = g[path]
        assert isinstance(a, zarr.Array) and a.shape == tuple(t.shape), path
        got = a[...]
        if path.startswith("model/") and path[6:] in ML:
            assert got.dtype == np.dtype(getattr(ml_dtypes, path[6:])), path
        assert _np_bits(got) == _bits(t), (name, path)
        # partial reads through zarr-python too
        if t.dim() == 2 and t.numel():
            assert _np_bits(a[1:5, 2:4]) == _bits(t[1:5, 2:4]), (name, path)


@pytest.mark.slow
def test_plain_zarr_python_without_ckptfs_in_the_process(saved):
    """A fresh interpreter that imports only zarr and numpy reads the standard dtypes; the ML
    dtypes need zarr_dtypes.register() (documented), without it zarr-python refuses them."""
    script = r"""
import sys, zarr, numpy as np
for root in sys.argv[1:]:
    g = zarr.open_group(root, mode="r")
    print(root.rsplit("/", 1)[1], g["model/float32"].dtype, float(g["model/float32"][3, 2]),
          float(g["col/w"][4, 8]), g["%2Ehidden/%5F_dunder"][...].tolist()[:1])
    try:
        g["model/bfloat16"][...]
        print("bf16 read")
    except Exception as e:
        print("bf16 refused", type(e).__name__)
"""
    out = subprocess.run([sys.executable, "-c", script, f"{saved}/v2", f"{saved}/v3-shard"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    ref = reference()
    lines = out.stdout.splitlines()
    for name, line in zip(("v2", "v3-shard"), lines[::2], strict=True):
        want = (f"{name} float32 {ref['model/float32'][3, 2].item()} {ref['col/w'][4, 8].item()} "
                f"[{ref['%2Ehidden/%5F_dunder'][0].item()}]")
        assert line == want
    assert lines[1::2] == ["bf16 refused ValueError"] * 2


@pytest.mark.slow
def test_a_load_of_raw_chunks_imports_no_zarr_library(saved):
    """A fresh interpreter loading uncompressed zarr checkpoints (byte ranges) never imports
    zarr-python, numcodecs or ml_dtypes (each import costs more than a small load); a
    compressed one imports numcodecs, and a zarr save imports zarr-python and registers the ML
    dtypes with it."""
    script = r"""
import sys, torch, ckptfs
libs = lambda: sorted({"zarr", "numcodecs", "ml_dtypes"} & set(sys.modules))
root, out = sys.argv[1], sys.argv[2]
for name in ("v2", "v3-shard"):  # two ranks' chunks, one padded at the edge
    ckptfs.load_keys(f"{root}/{name}", ["model/float32"])
print(libs())
ckptfs.load_keys(f"{root}/v2-zstd-crc", ["model/float32"])
print(libs())
ckptfs.save({"w": torch.ones(2, dtype=torch.bfloat16)}, out, backend="zarr")
import zarr
print(libs(), zarr.open_group(out, mode="r")["w"][...].dtype)
"""
    out = subprocess.run([sys.executable, "-c", script, str(saved), str(saved) + "-fresh-save"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "['numcodecs']",
                                       "['ml_dtypes', 'numcodecs', 'zarr'] bfloat16"]


@pytest.mark.slow
def test_load_keys_and_metadata(saved):
    idx = ckptfs.load_metadata(f"{saved}/v3-shard")
    assert (idx.backend, idx.backend_version) == ("zarr", 3)
    assert idx.backend_options["sharding"] is True
    assert idx.tensors["model/bfloat16"].dtype == "bfloat16"
    out = ckptfs.load_keys(f"{saved}/v2-blosc", ["model", ".hidden"])
    ref = reference()
    assert all(_bits(out["model"][n]) == _bits(ref[f"model/{n}"]) for n in NAMES)
    assert _bits(out[".hidden"]["__dunder"]) == _bits(ref["%2Ehidden/%5F_dunder"])


@pytest.mark.slow
def test_layout_on_disk(saved):
    def files(name, sub):
        return sorted(f for f in os.listdir(f"{saved}/{name}/{sub}") if not f.startswith("."))

    assert files("v2", "model/float32") == ["0.0", "1.0"]  # one chunk per rank's rows
    assert files("v2-slash", "model/float32") == ["0", "1"]  # 0/0, 1/0
    assert files("v2", "uneven") == [f"{i}.0" for i in range(6)]  # gcd grid: one row each
    assert files("v2", "col/w") == ["0.0", "0.1"]
    assert files("v2", "scalar") == ["0"] and files("v2", "empty") == []
    assert files("v3", "model/float32") == ["c", "zarr.json"]
    assert sorted(os.listdir(f"{saved}/v3/model/float32/c")) == ["0", "1"]
    assert os.listdir(f"{saved}/v3/scalar") == ["c", "zarr.json"] or \
        sorted(os.listdir(f"{saved}/v3/scalar")) == ["c", "zarr.json"]
    # the edge chunk is padded to the full chunk shape (zarr's rule): 4 rows, not 3
    assert os.path.getsize(f"{saved}/v2/model/float32/1.0") == 4 * COLS * 4
    meta = json.load(open(f"{saved}/v2/model/bfloat16/.zarray"))
    assert (meta["dtype"], meta["chunks"], meta["compressor"]) == ("bfloat16", [4, COLS], None)
    v3 = json.load(open(f"{saved}/v3/model/float8_e5m2/zarr.json"))
    assert v3["data_type"] == "float8_e5m2"
    assert json.load(open(f"{saved}/v3/model/float8_e4m3fn/zarr.json"))["data_type"] == "float8_e4m3fn"
    sh = json.load(open(f"{saved}/v3-shard/model/float64/zarr.json"))
    assert sh["chunk_grid"]["configuration"]["chunk_shape"] == [4, COLS]
    assert sh["codecs"][0]["name"] == "sharding_indexed"
    assert sh["codecs"][0]["configuration"]["chunk_shape"] == [1, COLS]  # 48 B rows <= 64 B
    idx = ckptfs.load_metadata(f"{saved}/v3-shard")
    inner = idx.tensors["model/float64"].chunks
    assert len(inner) == ROWS and {c.file for c in inner} == {"model/float64/c/0/0",
                                                              "model/float64/c/1/0"}
    z2 = json.load(open(f"{saved}/v2-zstd-crc/model/int32/.zarray"))
    assert z2["compressor"]["id"] == "zstd" and z2["filters"] == [{"id": "crc32c"}]
    # consolidated metadata on request only
    assert not os.path.exists(f"{saved}/v2/.zmetadata")
    assert "consolidated_metadata" not in json.load(open(f"{saved}/v3/zarr.json"))
    zarr_dtypes.register()
    for name in ("v2-blosc", "v3-blosc-crc"):
        g = zarr.open_consolidated(f"{saved}/{name}", mode="r")
        assert _np_bits(g["model/int64"][...]) == _bits(reference()["model/int64"])


# -- damage ----------------------------------------------------------------------------------
def _copy(saved: str, name: str, tmp_path) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(f"{saved}/{name}", dst)
    return dst


def _flip(path: str, at: int = 5) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _target(root: str) -> dict:
    return {"model": {"float32": torch.zeros(ROWS, COLS)}}


@pytest.mark.slow
@pytest.mark.parametrize("name,chunk", [("v3-blosc-crc", "model/float32/c/0/0"),
                                        ("v2-zstd-crc", "model/float32/0.0"),
                                        ("v3-shard-zstd-crc", "model/float32/c/1/0")])
def test_codec_checksum_detects_a_flipped_byte(saved, tmp_path, name, chunk):
    root = _copy(saved, name, tmp_path)
    _flip(f"{root}/{chunk}")
    with pytest.raises(ckptfs.IntegrityError, match="'model/float32'"):
        ckptfs.load(_target(root), root, strict=False,
                    options=ckptfs.LoadOptions(verify=False))  # the codec catches it
    zarr_dtypes.register()
    # v2 checksums the raw bytes inside the compression: zstd notices first there
    with pytest.raises((ValueError, RuntimeError), match="(?i)checksum|corrupt"):
        zarr.open_group(root, mode="r")["model/float32"][...]


@pytest.mark.slow
def test_v2_crc32c_filter_detects_damage_the_compressor_cannot(saved, tmp_path):
    """v2 applies the crc32c filter inside the compression: a chunk whose raw bytes changed and
    were then compressed again is valid zstd, so only the crc32c filter can catch it (with
    ckptfs's own checksum off, verify=False)."""
    import numcodecs

    root = _copy(saved, "v2-zstd-crc", tmp_path)
    path = f"{root}/model/float32/0.0"
    zstd = numcodecs.Zstd()
    inner = bytearray(zstd.decode(open(path, "rb").read()))  # raw bytes + 4-byte crc32c
    inner[0] ^= 0x40
    with open(path, "wb") as f:
        f.write(zstd.encode(bytes(inner)))
    with pytest.raises(ckptfs.IntegrityError, match=r"(?i)'model/float32'.*(crc|checksum)"):
        ckptfs.load(_target(root), root, strict=False,
                    options=ckptfs.LoadOptions(verify=False))
    with pytest.raises(ckptfs.IntegrityError, match="'model/float32'"):
        ckptfs.load(_target(root), root, strict=False)  # and ckptfs's checksum, when on


@pytest.mark.slow
def test_raw_chunk_corruption_fails_the_index_checksum(saved, tmp_path):
    root = _copy(saved, "v3", tmp_path)
    _flip(f"{root}/model/float32/c/0/0")
    with pytest.raises(ckptfs.IntegrityError, match="'model/float32'.*checksum"):
        ckptfs.load(_target(root), root, strict=False)


@pytest.mark.slow
@pytest.mark.parametrize("name,chunk", [("v2", "model/float32/1.0"),
                                        ("v3-blosc-crc", "model/float32/c/1/0")])
def test_missing_chunk_is_an_error_naming_the_key(saved, tmp_path, name, chunk):
    root = _copy(saved, name, tmp_path)
    os.remove(f"{root}/{chunk}")
    with pytest.raises(ckptfs.IntegrityError, match="'model/float32'.*missing"):
        ckptfs.load(_target(root), root, strict=False)
    # the rows of the other chunk still load: nothing silently becomes zeros
    part = {"model": {"float32": ckptfs.ShardedTensor(torch.zeros(4, COLS), (ROWS, COLS), (0, 0))}}
    ckptfs.load(part, root, strict=False)
    assert torch.equal(part["model"]["float32"].local_tensor, reference()["model/float32"][:4])


# -- Megatron-Core ---------------------------------------------------------------------------
@pytest.mark.slow
def test_megatron_metadata_and_whole_tensors(saved):
    root = f"{saved}/megatron"
    idx = ckptfs.load_metadata(root)
    assert (idx.backend, idx.backend_version) == ("zarr", 2)
    assert idx.writer["sharded_backend"] == "zarr"
    assert {k: (t.dtype, t.shape) for k, t in idx.tensors.items()} == \
        {k: (d, s) for k, (d, s, _) in MEGATRON.items()}
    out = ckptfs.load_keys(root)
    ref = megatron_tensors()
    assert set(out) == set(ref) | set(MEGATRON_COMMON)  # common.pt at the root, as Megatron loads it
    assert all(_bits(out[k]) == _bits(ref[k]) and out[k].dtype == ref[k].dtype for k in ref)
    assert {k: out[k] for k in MEGATRON_COMMON} == MEGATRON_COMMON


@pytest.mark.slow
def test_megatron_missing_chunk_named(saved, tmp_path):
    root = str(tmp_path / "m")
    shutil.copytree(f"{saved}/megatron", root)
    os.remove(f"{root}/embedding.word_embeddings.weight/0.1")
    with pytest.raises(ckptfs.IntegrityError, match="'embedding.word_embeddings.weight'"):
        ckptfs.load_keys(root)


def test_not_megatron_zarr_is_not_sniffed(tmp_path):
    root = str(tmp_path / "other")
    build_megatron(root)
    json.dump({"sharded_backend": "zarr", "sharded_backend_version": 2},
              open(f"{root}/metadata.json", "w"))
    with pytest.raises(ckptfs.FormatVersionError, match="sharded_backend_version"):
        ckptfs.load_metadata(root)
    json.dump({"sharded_backend": "zarr_v9", "sharded_backend_version": 1},
              open(f"{root}/metadata.json", "w"))
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(root)


# -- pieces ----------------------------------------------------------------------------------
component = st.one_of(st.integers(-5, 10**6), st.text(max_size=6),
                      st.sampled_from(["", ".", "..", ".zarray", "__x", "_y", "zarr.json",
                                       "ckptfs.index.json", "metadata.json", "%2E", "%", "c",
                                       "a\\b", "\\", ".\\"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(component, min_size=1, max_size=4))
def test_paths_are_reversible_valid_zarr_names(path):
    key = encode_key(tuple(path))
    zpath = array_path(key)
    assert key_of_path(zpath) == key
    for name in zpath.split("/"):
        assert name and name not in (".", "..") and not name.startswith("__")
        assert not name.startswith(".") and name not in ("zarr.json", "ckptfs.index.json")
        assert "\\" not in name  # the index refuses backslashes in paths


def test_node_names():
    assert node_name("model.layers.0.weight") == "model.layers.0.weight"
    assert [node_name(c) for c in ("", ".zattrs", "__init", "_orig_mod", "zarr.json", "a\\b")] == \
        ["%", "%2Ezattrs", "%5F_init", "_orig_mod", "%7Aarr.json", "a%5Cb"]


def test_grid_keeps_even_splits_and_refines_uneven_ones():
    def boxes(rows):
        return [Box((a, 0), (b - a, 8)) for a, b in rows]

    # torch.chunk of 10 rows over 3 and 4 ranks: the boxes themselves
    for rows, chunk in (([(0, 4), (4, 8), (8, 10)], (4, 8)), ([(0, 3), (3, 6), (6, 9), (9, 10)], (3, 8))):
        g = grid_for_boxes("k", (10, 8), boxes(rows), 4, None, 100)
        assert g.chunk == chunk and list(g.cells()) == boxes(rows)
    g = grid_for_boxes("k", (10, 8), boxes([(0, 4), (4, 6), (6, 10)]), 4, None, 100)
    assert g.chunk == (2, 8) and g.ncells == 5
    # a byte limit divides further, by divisors only
    assert grid_for_boxes("k", (12, 8), boxes([(0, 6), (6, 12)]), 4, 100, 100).chunk == (3, 8)
    assert shrink((6, 8), 4, 10) == (1, 2)
    assert Grid((), ()).ncells == 1 and list(Grid((0, 4), (1, 4)).cells()) == []
    with pytest.raises(ckptfs.ShardingError, match="'k'.*max_chunks"):
        grid_for_boxes("k", (1000,), [Box((0,), (1,)), Box((1,), (999,))], 4, None, 100)


def test_options_are_validated():
    from ckptfs.layout.backends.zarr_backend import ZarrV2Backend, ZarrV3Backend

    for cls, opts in ((ZarrV2Backend, {"sharding": True}), (ZarrV3Backend, {"compressor": "lz9"}),
                      (ZarrV3Backend, {"dimension_separator": "_"}),
                      (ZarrV2Backend, {"max_chunks": 0}), (ZarrV3Backend, {"level": "high"})):
        with pytest.raises(ckptfs.BackendOptionsError, match="zarr"):
            cls(opts)
    assert ckptfs.get_backend("zarr") is ZarrV3Backend
    assert ckptfs.get_backend("zarr", 2) is ZarrV2Backend


def test_ml_dtypes_in_zarr_python(tmp_path):
    """The zarr_dtypes compatibility module on this zarr-python: register is idempotent, other
    dtypes still resolve to themselves, and zarr-python writes and reads the ML dtypes."""
    assert zarr_dtypes.register() and zarr_dtypes.register()
    assert zarr.create_array(str(tmp_path / "u"), shape=(2,), dtype="uint16").dtype == np.uint16
    import ml_dtypes

    for name in ML:
        npdt = getattr(ml_dtypes, name)
        for fmt in (2, 3):
            x = (np.arange(12, dtype=np.float32) - 6).reshape(3, 4).astype(npdt)
            p = str(tmp_path / f"{name}-{fmt}")
            a = zarr.create_array(p, shape=x.shape, dtype=npdt, chunks=(2, 4), zarr_format=fmt,
                                  compressors=None, fill_value=0)
            a[...] = x
            b = zarr.open_array(p, mode="r")
            assert b.dtype == np.dtype(npdt) and _np_bits(b[...]) == _np_bits(x)
            doc = json.load(open(f"{p}/{'.zarray' if fmt == 2 else 'zarr.json'}"))
            assert doc["dtype" if fmt == 2 else "data_type"] == name


def test_overwrite_rewrites_fixed_paths_and_drops_the_old_arrays(tmp_path):
    """zarr chunk paths carry no save id: an overwrite rewrites them in place, and what the new
    checkpoint does not have (arrays, metadata, another version's files) is gone."""
    root = str(tmp_path / "ow")
    a, b = torch.arange(12.0).reshape(3, 4), torch.ones(5, dtype=torch.int64)
    ckptfs.save({"a": a, "b": b}, root, backend="zarr", backend_version=3)
    with pytest.raises(ckptfs.CheckpointExistsError):
        ckptfs.save({"a": a}, root, backend="zarr", backend_version=2)
    ckptfs.save({"a": a * 2}, root, backend="zarr", backend_version=2, overwrite=True)
    assert sorted(os.listdir(root)) == [".zattrs", ".zgroup", "a", "ckptfs.index.json"]
    assert sorted(os.listdir(f"{root}/a")) == [".zarray", ".zattrs", "0.0"]
    assert torch.equal(ckptfs.load_keys(root)["a"], a * 2)
    assert np.array_equal(zarr.open_group(root, mode="r")["a"][...], (a * 2).numpy())


@pytest.mark.parametrize("zarr_format", [2, 3])
@pytest.mark.parametrize("compressor", [None, "zstd"])
def test_array_documents_are_the_bytes_json_dumps_gives(zarr_format, compressor):
    """files() puts each array's attributes into its template's text, serialised once per
    layout; the bytes must be exactly those of serialising each document whole."""
    from ckptfs.layout.backends.zarr_codecs import CodecOptions
    from ckptfs.layout.backends.zarr_meta import ArrayLayout, MetadataBuilder

    codecs = CodecOptions.from_options(zarr_format, {"compressor": compressor, "checksum": True})
    meta = MetadataBuilder(zarr_format, codecs, "/")
    layouts = [ArrayLayout("float32", (4, 6), (2, 6)), ArrayLayout("bfloat16", (3,), (3,)),
               ArrayLayout("int64", (0,), (1,))]
    if zarr_format == 3:
        layouts.append(ArrayLayout("float32", (8, 8), (8, 8), (4, 4)))
    for i in range(12):  # several arrays per layout, attributes nested, non-ASCII and empty
        attrs = {"ckptfs": {"key": f"ä/{i}\n\"x\"", "dtype": "f", "list": [1, {"n": None}]},
                 "empty": {}, "e2": []} if i % 3 else {}
        meta.add_array(f"a/{i}", layouts[i % len(layouts)], attrs)
    meta.add_group("", {"ckptfs": {"backend": "zarr"}})
    meta.add_group("a")
    whole = {k: json.dumps(v, indent=2, ensure_ascii=False, allow_nan=False).encode()
             for k, v in meta.docs.items()}
    got = meta.files()
    assert list(got) == list(whole)
    for k in whole:
        assert got[k] == whole[k], k
