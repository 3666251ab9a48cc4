"""Native reader checks: a checkpoint's data files must open in the tool its backend is named
after (zarr-python, safetensors, torch.distributed.checkpoint, numpy), without ckptfs.

A check gets the checkpoint root, its parsed index and the expected whole tensors by canonical
key, and raises AssertionError on any difference. Keyed by backend name; a third-party backend
without a check here is skipped. Add one with ``@native_check("name")``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch

import ckptfs
from ckptfs.testing.conformance.cases import key_path, raw_bytes

NativeCheck = Callable[[Path, ckptfs.Index, Mapping[str, torch.Tensor]], None]
NATIVE_CHECKS: dict[str, NativeCheck] = {}


def native_check(backend: str) -> Callable[[NativeCheck], NativeCheck]:
    def register(fn: NativeCheck) -> NativeCheck:
        NATIVE_CHECKS[backend] = fn
        return fn
    return register


def _box(t: torch.Tensor, offsets, shape) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]


def _same_bytes(what: str, got: bytes, want: torch.Tensor) -> None:
    assert got == raw_bytes(want), f"{what}: bytes read natively differ from the saved tensor"


@native_check("safetensors_chunks")
def check_safetensors(root: Path, index: ckptfs.Index, expected: Mapping[str, torch.Tensor]) -> None:
    """Every data file is a valid safetensors file holding each chunk as ``<key>@<offsets>``."""
    from safetensors import safe_open

    seen = 0
    for rel in index.files:
        with safe_open(str(root / rel), framework="pt") as f:
            assert (f.metadata() or {}).get("format") == "ckptfs.safetensors_chunks", rel
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                key, _, offs = name.rpartition("@")
                offsets = tuple(int(x) for x in offs.split(",")) if offs else ()
                t = f.get_tensor(name)
                _same_bytes(f"{rel}:{name}", raw_bytes(t), _box(expected[key], offsets, t.shape))
                seen += 1
    stored = sum(1 for e in index.tensors.values() for c in e.chunks)
    assert seen == stored, f"safetensors files hold {seen} tensors, the index lists {stored} chunks"


@native_check("hf_safetensors")
def check_hf_safetensors(root: Path, index: ckptfs.Index, expected: Mapping[str, torch.Tensor]) -> None:
    """transformers' layout: the index's weight_map names each tensor's shard (or one
    model.safetensors), and safetensors reads every tensor under its own name."""
    import json

    from safetensors import safe_open

    single = root / "model.safetensors"
    if single.is_file():
        weight_map = dict.fromkeys(expected, "model.safetensors")
    else:
        weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(expected), sorted(set(weight_map) ^ set(expected))[:5]
    for key, want in expected.items():
        with safe_open(str(root / weight_map[key]), framework="pt") as f:
            _same_bytes(f"{weight_map[key]}:{key}", raw_bytes(f.get_tensor(key)), want)


def zarr_path(key: str) -> str:
    """The zarr node path of a key (formats/zarr-2.md §Paths): each canonical component is a
    node name, except that "" becomes "%" and a name starting with "." or "__" (or a reserved
    file name) has its first character percent-encoded."""
    reserved = {"zarr.json", "metadata.json", ckptfs.INDEX_FILE}

    def name(c: str) -> str:
        if c == "":
            return "%"
        if c.startswith((".", "__")) or c in reserved:
            return f"%{ord(c[0]):02X}{c[1:]}"
        return c

    return "/".join(name(c) for c in key.split("/"))


@native_check("zarr")
def check_zarr(root: Path, index: ckptfs.Index, expected: Mapping[str, torch.Tensor]) -> None:
    """zarr-python opens the root as a group of the index's zarr format; every array holds its
    tensor's bytes (bfloat16/float8 may be stored as same-size integer views)."""
    import zarr

    ckptfs.register_zarr_dtypes()  # bfloat16/float8 arrays
    with warnings.catch_warnings():  # ckptfs.index.json is not a zarr node: zarr says so
        warnings.simplefilter("ignore")
        group = zarr.open_group(str(root), mode="r")
    assert group.metadata.zarr_format == index.backend_version, group.metadata.zarr_format
    for key, want in expected.items():
        arr = group[zarr_path(key)]
        assert isinstance(arr, zarr.Array), (key, "a zarr group, not an array")
        assert tuple(arr.shape) == tuple(want.shape), (key, arr.shape, want.shape)
        got = np.ascontiguousarray(np.asarray(arr[...]))
        assert got.dtype.itemsize == want.element_size(), (key, got.dtype, want.dtype)
        _same_bytes(f"zarr array {key}", got.tobytes(), want)


@native_check("torch_dist")
def check_torch_dist(root: Path, index: ckptfs.Index, expected: Mapping[str, torch.Tensor]) -> None:
    """torch.distributed.checkpoint loads every tensor (no process group, no ckptfs), each
    named by its state-dict path joined with "." (formats/torch_dist-1.md)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(str(root)).read_metadata()
    tensors = {k: m for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    names = {}
    for key in expected:  # DCP names an item by its object path joined with "."
        fqn = ".".join(map(str, key_path(key)))
        assert fqn in tensors, f"torch_dist: no DCP tensor {fqn!r} for key {key!r}"
        names[key] = fqn
    sd = {fqn: torch.empty(tuple(tensors[fqn].size), dtype=tensors[fqn].properties.dtype)
          for fqn in names.values()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=str(root), no_dist=True)
    for key, want in expected.items():
        _same_bytes(f"DCP tensor {names[key]}", raw_bytes(sd[names[key]]), want)


@native_check("npy_chunks")
def check_npy(root: Path, index: ckptfs.Index, expected: Mapping[str, torch.Tensor]) -> None:
    """Each chunk is a .npy file numpy loads (bfloat16/float8 as same-size integer views)."""
    for key, e in index.tensors.items():
        for c in e.chunks:
            assert c.file is not None, (key, "an npy chunk names its file")
            arr = np.load(root / c.file, allow_pickle=False)
            assert tuple(arr.shape) == tuple(c.shape), (key, c.file, arr.shape)
            _same_bytes(f"{c.file} ({key})", np.ascontiguousarray(arr).tobytes(),
                        _box(expected[key], c.offsets, c.shape))
