"""One error tree: every failure mode of a damaged checkpoint, walked for every writable backend,
leaves the public API as a ckptfs.CkptfsError subclass whose message names the key, the chunk
and the file at fault (truncated file -> IntegrityError, byte-length inconsistencies
-> MalformedIndexError, storage failures -> StorageError)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import ckptfs

PAIRS = [("safetensors_chunks", 1, {}), ("zarr", 2, {}), ("zarr", 3, {}),
         ("zarr", 3, {"sharding": True, "inner_chunk_bytes": 256}), ("torch_dist", 1, {}),
         ("npy_chunks", 1, {})]


def _state() -> dict:
    """'a' is one chunk; 'm' (10 rows) is cut into 3-row zarr chunks, the last one padded."""
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(1000, generator=g), "m": torch.randn(10, 10, generator=g)}


def _chunk_bytes(url: Path, key: str) -> tuple[Path, int, str]:
    """(data file, first byte of the chunk's stored bytes, file as in the index) of key's
    first chunk."""
    e = ckptfs.load_metadata(url).tensors[key].chunks[0]
    return url / e.file, e.byte_offset or 0, e.file


def _fresh(src: Path, dst: Path) -> Path:
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    return dst


def _edit_index(url: Path, fn) -> None:
    p = url / ckptfs.INDEX_FILE
    d = json.loads(p.read_text())
    fn(d)
    d.pop("index_checksum", None)  # edited by hand: no longer sealed (formats/README.md §6.2)
    p.write_text(json.dumps(d))


@pytest.mark.parametrize(("name", "version", "options"), PAIRS,
                         ids=[f"{n}-{v}{'-sharded' if o else ''}" for n, v, o in PAIRS])
def test_every_failure_mode_is_a_ckptfs_error_naming_what(tmp_path, name, version, options):
    sd = _state()
    src = tmp_path / "src"
    opts = dict(options)
    if name == "zarr" and not opts.get("sharding"):
        opts["max_chunk_bytes"] = 3 * 10 * 4  # 3-row chunks of m: the last one (row 9) is padded
    ckptfs.save(sd, src, backend=name, backend_version=version, backend_options=opts)

    def target() -> dict:
        return {k: torch.zeros_like(v) for k, v in sd.items()}

    # 0. intact: loads exactly
    t = target()
    ckptfs.load(t, src)
    assert all(torch.equal(t[k], sd[k]) for k in sd)

    # 1. a flipped byte in stored tensor data: IntegrityError (checksum) naming key, chunk, file
    url = _fresh(src, tmp_path / "flip")
    path, off, rel = _chunk_bytes(url, "a")
    raw = bytearray(path.read_bytes())
    raw[off] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(ckptfs.IntegrityError, match=rf"key 'a'.*chunk at \[0\].*{rel}"):
        ckptfs.load(target(), url)
    loaded = target()
    ckptfs.load(loaded, url, options=ckptfs.LoadOptions(verify=False))  # the damage is real: without the check it slips in
    assert not torch.equal(loaded["a"], sd["a"])

    # 2. a truncated data file: IntegrityError naming the key and the file
    url = _fresh(src, tmp_path / "trunc")
    path, off, rel = _chunk_bytes(url, "a")
    path.write_bytes(path.read_bytes()[:off + 5])  # cut inside the chunk's bytes
    with pytest.raises(ckptfs.IntegrityError, match=rf"'a'.*{rel}"):
        ckptfs.load(target(), url)

    # 3. a missing data file: IntegrityError naming the key and the file
    url = _fresh(src, tmp_path / "missing")
    path, _, rel = _chunk_bytes(url, "a")
    path.unlink()
    with pytest.raises(ckptfs.IntegrityError, match=rf"'a'.*{rel}"):
        ckptfs.load(target(), url)

    # 4. an index whose byte length disagrees with shape and dtype: MalformedIndexError
    url = _fresh(src, tmp_path / "length")

    def bad_length(d: dict) -> None:
        c = d["tensors"]["a"]["chunks"][0]
        c["byte_length"] += 4
        # (the recorded file size grows too: a range beyond it is refused earlier, by the index)
        if c.get("file") in d.get("files", {}):
            d["files"][c["file"]] = max(d["files"][c["file"]], c.get("byte_offset", 0) + c["byte_length"])

    _edit_index(url, bad_length)
    with pytest.raises(ckptfs.MalformedIndexError, match=r"key 'a': chunk at \[0\].*byte_length"):
        ckptfs.load(target(), url)

    # 5. a storage failure (the data file is a directory): StorageError naming the file
    url = _fresh(src, tmp_path / "storage")
    path, _, rel = _chunk_bytes(url, "a")
    path.unlink()
    path.mkdir()
    with pytest.raises(ckptfs.StorageError, match=rel.split("/")[-1]) as err:
        ckptfs.load(target(), url)
    assert isinstance(err.value, ckptfs.CkptfsError) and isinstance(err.value.__cause__, OSError)

    # 6. a flipped byte in a chunk that does not start the tensor
    url = _fresh(src, tmp_path / "later")
    last = ckptfs.load_metadata(url).tensors["m"].chunks[-1]
    _flip(url / last.file, (last.byte_offset or 0) + 4)
    with pytest.raises(ckptfs.IntegrityError, match=re.escape(f"key 'm': chunk at {list(last.offsets)} in {last.file}")):
        ckptfs.load(target(), url)


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


EDGE = torch.arange(100, dtype=torch.float32).reshape(10, 10)


def _save_uneven(rank: int, world: int, root: str) -> None:
    """Rows [0, 4) on rank 0, [4, 10) on rank 1: zarr's grid is 4 rows, its last chunk padded."""
    lo, hi = (0, 4) if rank == 0 else (4, 10)
    sd = {"m": ckptfs.ShardedTensor(EDGE[lo:hi].clone(), (10, 10), (lo, 0))}
    for version in (2, 3):
        ckptfs.save(sd, f"{root}/zarr{version}", backend="zarr", backend_version=version)


@pytest.mark.slow
def test_padded_zarr_edge_chunks_are_verified(tmp_path):
    """verify=True checks the crc32c of padded edge chunks too (their real elements)."""
    from ckptfs.testing.ranks import run_ranks

    run_ranks(2, _save_uneven, str(tmp_path))
    for version in (2, 3):
        url = tmp_path / f"zarr{version}"
        edge = ckptfs.load_metadata(url).tensors["m"].chunks[-1]
        assert edge.shape == (2, 10) and edge.extra.get("stored_shape") == [4, 10], edge
        target = {"m": torch.zeros(10, 10)}
        ckptfs.load(target, url)
        assert torch.equal(target["m"], EDGE)
        _flip(url / edge.file, 4 * 4 + 1)  # element (0, 4) of the edge chunk: a real element
        with pytest.raises(ckptfs.IntegrityError,
                           match=re.escape(f"key 'm': chunk at [8, 0] in {edge.file} fails its checksum")):
            ckptfs.load({"m": torch.zeros(10, 10)}, url)
        # a target whose rows are not contiguous reads the chunk through a span: checked too
        with pytest.raises(ckptfs.IntegrityError, match="fails its checksum"):
            ckptfs.load({"m": torch.zeros(10, 10).t()}, url)


def test_storage_errors_from_object_stores_are_ckptfs_errors(s3):
    """A 403 from the object store is an AccessDeniedError (a StorageError and a
    PermissionError) naming the URL; a missing checkpoint is CheckpointNotFoundError."""
    url = f"{s3.url}/denied"
    ckptfs.save({"a": torch.ones(4)}, url, storage_options=s3.options)
    s3.proxy.configure(deny=["/data/"])
    with pytest.raises(ckptfs.AccessDeniedError, match=f"{url}/data/") as err:
        ckptfs.load({"a": torch.zeros(4)}, url, storage_options=s3.options)
    assert isinstance(err.value, ckptfs.StorageError) and isinstance(err.value, PermissionError)
    s3.proxy.reset()
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load({"a": torch.zeros(4)}, f"{s3.url}/nothing", storage_options=s3.options)


def test_bad_settings_are_config_errors(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="scratch_bytes"):
        ckptfs.LoadOptions(scratch_bytes=0)
    with pytest.raises(ckptfs.ConfigError, match="throttle_uploads"):
        ckptfs.save({"a": torch.ones(1)}, tmp_path / "c",
                    options=ckptfs.SaveOptions(throttle_uploads=0))
    with pytest.raises(ckptfs.ConfigError, match="work_dir"):
        ckptfs.load({"a": torch.ones(1)}, tmp_path / "c",
                    options=ckptfs.LoadOptions(pre_download=True))
    with pytest.raises(ckptfs.BackendOptionsError):  # a ConfigError too
        ckptfs.save({"a": torch.ones(1)}, tmp_path / "d", backend_options={"nope": 1})
