"""``unshard``'s raw copies (tools/raw_copy.py): tensors whose chunks are raw row runs of a
local checkpoint's files go from those files into the export's safetensors files in pieces,
checked as they pass; the files are the same bytes as through the read engine, from 1 and 2
ranks; a damaged chunk fails the export naming its key, chunk and file, and a chunk damaged on
the way is copied again."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import ckptfs
import ckptfs.tools.raw_copy as raw_copy
import ckptfs.tools.unshard as unshard_mod
from ckptfs.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # every test exports a checkpoint saved by spawned ranks


ROWS = 1000  #: rows of the row-split tensors: 2 chunks of 500 rows, several copy pieces each


def full_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(ROWS, 1100, generator=g),  # 4.4 MB: 2 chunks of 2.2 MB
            "half": torch.randn(ROWS, 64, generator=g).to(torch.bfloat16),
            "cols": torch.randn(8, 6, generator=g),  # split by columns: through the engine
            "ints": torch.arange(ROWS, dtype=torch.int64),
            "scalar": torch.tensor(2.5)}


def _save(rank: int, world: int, root: str) -> None:
    """Row-split shards (as FSDP stores them) and one column-split tensor, saved by the ranks."""
    full = full_state()
    state = {}
    for k, v in full.items():
        if v.dim() == 0:
            state[k] = v
            continue
        dim = 1 if k == "cols" else 0
        n = v.shape[dim] // world
        piece = v.narrow(dim, rank * n, n).clone()
        offset = tuple(rank * n if d == dim else 0 for d in range(v.dim()))
        state[k] = ckptfs.ShardedTensor(piece, tuple(v.shape), offset)
    ckptfs.save({"model": state}, root)


def _export(rank: int, world: int, src: str, out: str) -> None:
    got = ckptfs.unshard(src, out, format="hf", strategy="chunks", chunk_size=3 << 20,
                         keys=["model"])
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(dict(got.phases.phases), f)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw") / "ckpt"
    run_ranks(2, _save, str(root))
    return root


def _files(d) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_raw_copies_are_the_engine_s_bytes_from_one_and_two_ranks(ckpt, tmp_path, monkeypatch):
    res = ckptfs.unshard(ckpt, tmp_path / "raw", format="hf", strategy="chunks",
                         chunk_size=3 << 20, keys=["model"])
    assert res.phases.get("copy") > 0 and res.phases.get("write") > 0  # "cols" went the engine's way
    run_ranks(2, _export, str(ckpt), str(tmp_path / "two"))
    phases = [json.loads((tmp_path / f"two.rank{r}.json").read_text()) for r in range(2)]
    assert all(p.get("copy", 0) > 0 for p in phases)  # each rank copied its share raw
    with monkeypatch.context() as m:
        m.setattr(unshard_mod, "raw_runs", lambda src, entries: {})  # every tensor via the engine
        engine = ckptfs.unshard(ckpt, tmp_path / "engine", format="hf", strategy="chunks",
                                chunk_size=3 << 20, keys=["model"])
    assert engine.phases.get("copy") == 0
    want = _files(tmp_path / "engine")
    assert len(want) > 2 and _files(tmp_path / "raw") == want
    assert _files(tmp_path / "two") == want
    got = {}
    for f in sorted((tmp_path / "raw").glob("model-*.safetensors")):
        got.update(load_file(str(f)))
    full = full_state()
    assert got.keys() == full.keys() and all(torch.equal(got[k], v) for k, v in full.items())


def _damage(ckpt, key: str) -> tuple[str, bytes]:
    """Flip a bit in the second chunk of ``key``; returns (its file, the file's old bytes)."""
    doc = ckptfs.load_metadata(ckpt)
    chunk = sorted(doc.tensors[f"model/{key}"].chunks, key=lambda c: c.offsets)[1]
    path = ckpt / chunk.file
    old = path.read_bytes()
    data = bytearray(old)
    data[chunk.byte_offset + chunk.byte_length - 3] ^= 0x08
    path.write_bytes(data)
    return chunk.file, old


def test_a_damaged_chunk_fails_the_export_naming_key_chunk_and_file(ckpt, tmp_path):
    file, old = _damage(ckpt, "rows")
    try:
        with pytest.raises(ckptfs.IntegrityError) as err:
            ckptfs.unshard(ckpt, tmp_path / "out", format="hf", keys=["model"])
        msg = str(err.value)
        assert "'model/rows'" in msg and "[500, 0]" in msg and file in msg
        assert not list((tmp_path / "out").glob("*.safetensors"))  # nothing published
        ckptfs.unshard(ckpt, tmp_path / "unchecked", format="hf", keys=["model"], verify=False)
        got = load_file(str(tmp_path / "unchecked" / "model.safetensors"))["rows"]
        assert not torch.equal(got, full_state()["rows"])  # copied as stored, unchecked
    finally:
        (ckpt / file).write_bytes(old)


def test_a_chunk_damaged_on_the_way_is_copied_again(ckpt, tmp_path, monkeypatch):
    """The first piece read of the export comes back damaged; the chunk is copied once more
    and the file holds the stored tensor."""
    real = os.preadv
    damaged = []

    def preadv(fd, bufs, offset):
        n = real(fd, bufs, offset)
        if not damaged:
            damaged.append(offset)
            bufs[0][0] ^= 0xFF
        return n

    calls = SimpleNamespace(preadv=preadv, pwrite=os.pwrite, open=os.open, close=os.close,
                            O_RDONLY=os.O_RDONLY)
    monkeypatch.setattr(raw_copy, "os", calls)  # the raw copies' reads only
    ckptfs.unshard(ckpt, tmp_path / "out", format="hf", keys=["model"])
    monkeypatch.undo()
    assert damaged
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    full = full_state()
    assert all(torch.equal(got[k], v) for k, v in full.items())


def test_tensors_split_by_columns_are_not_copied_raw(ckpt):
    from ckptfs.tools.source import open_checkpoint

    with open_checkpoint(ckpt) as src:
        runs = raw_copy.raw_runs(src, src.index.tensors.values())
    assert set(runs) == {"model/rows", "model/half", "model/ints", "model/scalar"}
    assert [r.at for r in runs["model/rows"]] == [0, 500 * 1100 * 4]
    assert len(runs["model/scalar"]) == 1
