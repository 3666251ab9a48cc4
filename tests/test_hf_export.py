"""Hugging Face export spread over the ranks: a tiny Llama (transformers, random weights, made
here) sharded with FSDP2 on spawned gloo ranks is exported from its live state
(``ckptfs.export_hf``, cast to bf16, names through a key mapping) and from a ckptfs checkpoint
(``ckptfs.unshard --format hf``, every rank writing its share of the files). ``transformers``'
``from_pretrained`` loads every export equal to the full tensors; 1, 2 and 3 ranks write the
same bytes; an interrupted export resumes; the CLI under ``torchrun`` shares the work.

FP8 reads: a DeepSeek-V3 style checkpoint made here (``float8_e4m3fn`` weights, float32
``weight_scale_inv`` per 128 x 128 tile, ragged edge tiles, a scale in another file than its
weight) loads into bf16 DTensors sharded by rows and by columns on 2 and 3 ranks, and into
plain tensors, bit-exact with DCP's ``QuantizedHuggingFaceStorageReader``.

On S3 (moto): both exports write the same objects as locally, an existing export is refused and
resumed, and the FP8 checkpoint loads from the bucket reading only a shard's bytes."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.io import open_store, run_sync
from ckptfs.testing.ranks import run_ranks
from ckptfs.tools.export_dir import PARTIAL
from ckptfs.tools.unshard import assign_files
from tests.test_hf import tiny_llama
from tests.test_tools import _put

transformers = pytest.importorskip("transformers")  # the `test` extra

CHUNK = 16_000  #: bytes per file: the tiny Llama's fp32 weights (90 kB) make 7 files




def sharded_llama():
    """The tiny Llama with FSDP2 over every rank (each layer, then the root)."""
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _native(name: str) -> str:
    """A training code's own names (without the ``model.`` prefix) ..."""
    return name.removeprefix("model.")


def _to_hf(name: str) -> str:
    """... and the key mapping back to Hugging Face's."""
    return name if name.startswith("lm_head") else f"model.{name}"


SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's FP8 quantisation: each tile's max magnitude to 448 (e4m3's largest)."""
    tiles = (-(-w.shape[0] // block), -(-w.shape[1] // block))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(tiles)
    for i in range(tiles[0]):
        for j in range(tiles[1]):
            t = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scale[i, j] = t.abs().max() / 448
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (t / scale[i, j]).to(q.dtype)
    return q, scale


def fp8_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """Write the FP8 checkpoint; returns what DCP's quantized reader loads from it (bf16)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    g = torch.Generator().manual_seed(0)
    q0, s0 = quantize(torch.randn(300, 260, generator=g))
    q1, s1 = quantize(torch.randn(256, 130, generator=g) * 3)
    d.mkdir()
    files = [{"l0.weight": q0, "l1.weight_scale_inv": s1,
              "norm.weight": torch.randn(260, generator=g).to(torch.bfloat16)},
             {"l0.weight_scale_inv": s0, "l1.weight": q1}]
    for name, tensors in zip(SHARDS, files, strict=True):
        save_file(tensors, str(d / name), metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in zip(SHARDS, files, strict=True) for k in tensors}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ref = {"l0.weight": torch.zeros(300, 260, dtype=torch.bfloat16),
           "l1.weight": torch.zeros(256, 130, dtype=torch.bfloat16),
           "norm.weight": torch.zeros(260, dtype=torch.bfloat16)}
    dcp.load(ref, storage_reader=QuantizedHuggingFaceStorageReader(str(d), target_dtype=torch.float32),
             no_dist=True)
    return ref


def _fp8(world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    ref = torch.load(f"{root}/fp8-ref.pt", weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    target = {"l0.weight": distribute_tensor(torch.zeros(300, 260, dtype=torch.bfloat16), mesh, [Shard(0)]),
              "l1.weight": distribute_tensor(torch.zeros(256, 130, dtype=torch.bfloat16), mesh, [Shard(1)]),
              "norm.weight": distribute_tensor(torch.zeros(260, dtype=torch.bfloat16), mesh, [Replicate()])}
    res = ckptfs.load_hf_fp8(target, f"{root}/fp8")
    assert res.unexpected_keys == [] and res.missing_keys == []
    for k, v in ref.items():
        got = target[k].full_tensor()
        assert got.dtype == torch.bfloat16 and torch.equal(got, v), k


def _world(rank: int, world: int, root: str) -> None:
    _fp8(world, root)
    model = sharded_llama()
    sd = model.state_dict()
    assert all(type(v).__name__ == "DTensor" for v in sd.values())
    r = ckptfs.export_hf(sd, f"{root}/live-fp32-{world}", max_shard_size=CHUNK)
    assert r.ranks == world and r.files[-1] == "model.safetensors.index.json"
    # FSDP2's row shards: each rank writes its rows in place in the shared files, no buffer
    assert r.host_buffers == ()
    b = ckptfs.export_hf({_native(k): v for k, v in sd.items()}, f"{root}/live-bf16-{world}",
                         key_mapping=_to_hf, dtype=torch.bfloat16, max_shard_size=CHUNK)
    assert b.host_buffers == ()
    if world == 2:
        ckptfs.save({"model": sd}, f"{root}/ckpt")
    else:  # refusals reach every rank, whichever rank's input is wrong
        with pytest.raises((ckptfs.UsageError, ckptfs.RankError), match="holds a int|rank 1"):
            ckptfs.export_hf({"step": 5} if rank == 1 else {}, f"{root}/bad-1")
        odd = {"w": torch.zeros(4 if rank == 2 else 3)}
        with pytest.raises(ckptfs.ShardingError, match="'w' is float32 \\[4\\] on rank 2"):
            ckptfs.export_hf(odd, f"{root}/bad-2")
    ckptfs.unshard(f"{root}/ckpt", f"{root}/ckpt-{world}", format="hf", strategy="chunks",
                   chunk_size=CHUNK, keys=["model"])
    one = ckptfs.unshard(f"{root}/ckpt", f"{root}/one-{world}", format="hf", strategy="one_file",
                         keys=["model"])  # one file, every rank writing its part
    assert one.files == ("model.safetensors",) and one.ranks == world


def files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def same_weights(d: Path, want: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    tiny_llama().config.save_pretrained(d)
    loaded = transformers.LlamaForCausalLM.from_pretrained(d, torch_dtype=dtype).state_dict()
    assert loaded.keys() == want.keys()
    bad = [k for k, v in want.items() if not (loaded[k].dtype == dtype and torch.equal(loaded[k], v.to(dtype)))]
    assert not bad, f"{d.name}: {bad[:3]} differ"


@pytest.mark.slow
def test_live_and_checkpoint_exports_and_fp8_reads_on_1_2_and_3_ranks(tmp_path):
    torch.save(fp8_checkpoint(tmp_path / "fp8"), tmp_path / "fp8-ref.pt")
    run_ranks(2, _world, str(tmp_path), timeout=300)
    run_ranks(3, _world, str(tmp_path), timeout=300)
    one = ckptfs.unshard(tmp_path / "ckpt", tmp_path / "ckpt-1", format="hf", strategy="chunks",
                         chunk_size=CHUNK, keys=["model"])
    assert one.ranks == 1 and len(one.files) == 7 + 1
    single = ckptfs.unshard(tmp_path / "ckpt", tmp_path / "one-1", format="hf", keys=["model"])
    assert files(tmp_path / "one-2") == files(tmp_path / "one-3") == files(tmp_path / "one-1")
    assert single.bytes_written == (tmp_path / "one-1" / "model.safetensors").stat().st_size
    want = tiny_llama().state_dict()
    ref = files(tmp_path / "ckpt-1")
    for d in ("ckpt-2", "ckpt-3", "live-fp32-2", "live-fp32-3"):  # the same bytes, any route
        assert files(tmp_path / d) == ref, d
    assert files(tmp_path / "live-bf16-2") == files(tmp_path / "live-bf16-3")
    index = json.loads((tmp_path / "live-bf16-2" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # bf16: half the bytes
    same_weights(tmp_path / "ckpt-2", want, torch.float32)
    same_weights(tmp_path / "live-bf16-3", want, torch.bfloat16)
    same_weights(tmp_path / "one-3", want, torch.float32)
    assert not any((tmp_path / d / PARTIAL).exists() for d in ("ckpt-2", "live-bf16-2"))


def test_a_shared_file_is_cut_in_contiguous_runs_balanced_by_bytes():
    from ckptfs.tools.unshard import share_ranges

    assert share_ranges([10] * 6, 3) == [0, 0, 1, 1, 2, 2]
    assert share_ranges([50, 10, 10, 10, 10, 10], 2) == [0, 1, 1, 1, 1, 1]
    assert share_ranges([100, 1, 1], 3) == [1, 2, 2]  # the middle byte decides
    assert share_ranges([5, 5], 4) == [1, 3]
    assert share_ranges([0, 0], 2) == [0, 0]


def test_several_shared_files_are_cut_across_their_boundaries():
    """A local export's files are shared: the ranks' runs of tensors cross file boundaries, so
    7 files of 6 tensors and one of 4 (46 alike) give 23 and 23, where whole files gave 24
    and 22."""
    from ckptfs.tools.unshard import share_ranges

    sizes = [6] * 7 + [4]
    whole = assign_files(sizes, 2)
    assert sorted(sum(s for s, r in zip(sizes, whole) if r == k) for k in (0, 1)) == [22, 24]
    owner = share_ranges([1] * sum(sizes), 2)
    assert owner == [0] * 23 + [1] * 23


def test_files_go_to_ranks_balanced_by_bytes():
    assert assign_files([10, 50, 30, 30], 2) == [0, 0, 1, 1]  # largest first: 50+10 | 30+30
    assert assign_files([10, 50, 30, 30], 1) == [0, 0, 0, 0]
    assert sorted(assign_files([5] * 6, 3)) == [0, 0, 1, 1, 2, 2]


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    ckptfs.save({"model": tiny_llama().state_dict()}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_an_interrupted_export_resumes_or_is_overwritten(checkpoint, tmp_path):
    def export(out: Path, **kw) -> ckptfs.UnshardResult:
        return ckptfs.unshard(checkpoint, out, format="hf", strategy="chunks", chunk_size=CHUNK,
                              keys=["model"], **kw)

    ref = files(tmp_path / "ref") if export(tmp_path / "ref") else {}
    out = tmp_path / "out"
    export(out)
    # interrupted: the index never written, one file lost, another left half-written
    (out / "model.safetensors.index.json").unlink()
    (out / "model-00003-of-00007.safetensors").unlink()
    (out / PARTIAL).mkdir()
    (out / PARTIAL / "model-00003-of-00007.safetensors").write_bytes(b"x" * 100)
    torn = out / "model-00005-of-00007.safetensors"
    torn.write_bytes(torn.read_bytes()[:-4] + b"\0\0\0\0")  # same size, header intact: kept as is
    short = out / "model-00006-of-00007.safetensors"
    short.write_bytes(short.read_bytes()[:-1])  # a size that is not the planned one: rewritten
    with pytest.raises(ckptfs.CheckpointExistsError, match="--resume"):
        export(out)
    res = export(out, resume=True)
    assert sorted(res.kept) == [f"model-0000{i}-of-00007.safetensors" for i in (1, 2, 4, 5, 7)]
    got = files(out)
    assert got.keys() == ref.keys() and not (out / PARTIAL).exists()
    assert [n for n in ref if got[n] != ref[n]] == ["model-00005-of-00007.safetensors"]
    res = export(out, overwrite=True)
    assert res.kept == () and files(out) == ref
    with pytest.raises(ckptfs.UsageError, match="resume"):
        ckptfs.unshard(checkpoint, tmp_path / "t", format="torch", resume=True)


@pytest.mark.slow
def test_the_cli_under_torchrun_shares_the_files(checkpoint, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ckptfs", "unshard", str(checkpoint), str(out), "--format", "hf",
           "--strategy", "chunks", "--chunk-size", str(CHUNK), "--keys", "model"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("unsharded")]
    assert len(lines) == 1 and "on 2 rank(s)" in lines[0], done.stdout
    summaries = [ln for ln in done.stderr.splitlines() if ln.startswith("ckptfs unshard")]
    assert len(summaries) == 1 and "(2 rank(s))" in summaries[0], done.stderr[-3000:]
    ckptfs.unshard(checkpoint, tmp_path / "one", format="hf", strategy="chunks", chunk_size=CHUNK,
                   keys=["model"])
    assert files(out) == files(tmp_path / "one")


def test_fp8_weights_load_dequantised_as_dcp_reads_them(tmp_path):
    from ckptfs.tools.hf_fp8 import dequantize

    ref = fp8_checkpoint(tmp_path / "fp8")
    target = {k: torch.zeros_like(v) for k, v in ref.items()}
    res = ckptfs.load_hf_fp8(target, tmp_path / "fp8")
    assert all(torch.equal(target[k], v) for k, v in ref.items())
    assert res.bytes_read == 300 * 260 + 256 * 130 + 4 * (3 * 3 + 2 * 2) + 2 * 260  # fp8: 1 byte
    # the documented rounding, by hand: float32 product, one rounding to the target dtype
    from safetensors.torch import load_file

    q = load_file(str(tmp_path / "fp8" / SHARDS[0]))["l0.weight"]
    s = load_file(str(tmp_path / "fp8" / SHARDS[1]))["l0.weight_scale_inv"]
    by_hand = (q.float() * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260])
    assert torch.equal(dequantize(q, s, torch.float32), by_hand)
    assert torch.equal(target["l0.weight"], by_hand.to(torch.bfloat16))
    # a shard of rows 100..227 (across a tile edge) reads only its rows
    part = {"l0.weight": ckptfs.ShardedTensor(torch.zeros(128, 260), (300, 260), (100, 0))}
    res = ckptfs.load_hf_fp8(part, tmp_path / "fp8", strict=False)
    assert torch.equal(part["l0.weight"].local_tensor, by_hand[100:228])
    assert res.bytes_read == 128 * 260 + 4 * 2 * 3
    # an fp8 target reads the stored bytes as they are (no dequantisation)
    raw = {"l0.weight": torch.zeros(300, 260, dtype=torch.float8_e4m3fn)}
    ckptfs.load_hf_fp8(raw, tmp_path / "fp8", strict=False)
    assert torch.equal(raw["l0.weight"].view(torch.uint8), q.view(torch.uint8))


def test_fp8_scales_of_the_wrong_shape_are_refused_naming_the_key(tmp_path):
    from safetensors.torch import save_file

    q, s = quantize(torch.randn(300, 260))
    tmp_path.joinpath("bad").mkdir()
    save_file({"w.weight": q, "w.weight_scale_inv": s[:2]}, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ckptfs.MismatchError, match="'w.weight'.*scales \\[3, 3\\]"):
        ckptfs.load_hf_fp8({"w.weight": torch.zeros(300, 260)}, tmp_path / "bad")


def _bucket(s3, prefix: str) -> dict[str, bytes]:
    async def get() -> dict[str, bytes]:
        store = await open_store(f"{s3.url}/{prefix}", s3.options)
        try:
            return {p: bytes(await store.get(p)) for p in sorted(await store.list(""))}
        finally:
            await store.close()

    return run_sync(get())


def test_exports_to_s3_and_fp8_reads_from_s3(checkpoint, s3, tmp_path):
    kw = {"format": "hf", "strategy": "chunks", "chunk_size": CHUNK, "keys": ["model"]}
    ckptfs.unshard(checkpoint, tmp_path / "local", **kw)
    url = f"{s3.url}/export"
    res = ckptfs.unshard(checkpoint, url, storage_options=s3.options, **kw)
    assert res.out_dir == url and _bucket(s3, "export") == files(tmp_path / "local")
    with pytest.raises(ckptfs.CheckpointExistsError, match="--resume"):
        ckptfs.unshard(checkpoint, url, storage_options=s3.options, **kw)
    res = ckptfs.unshard(checkpoint, url, storage_options=s3.options, resume=True, **kw)
    assert len(res.kept) == 7 and _bucket(s3, "export") == files(tmp_path / "local")
    live = ckptfs.load_keys(checkpoint)["model"]
    ckptfs.export_hf(live, f"{s3.url}/live", max_shard_size=CHUNK, storage_options=s3.options)
    assert _bucket(s3, "live") == files(tmp_path / "local")

    ref = fp8_checkpoint(tmp_path / "fp8")
    for p in (tmp_path / "fp8").iterdir():
        run_sync(_put(s3, f"fp8/{p.name}", p.read_bytes()))
    rows = {"l0.weight": ckptfs.ShardedTensor(torch.zeros(100, 260, dtype=torch.bfloat16), (300, 260), (200, 0))}
    res = ckptfs.load_hf_fp8(rows, f"{s3.url}/fp8", storage_options=s3.options, strict=False)
    assert torch.equal(rows["l0.weight"].local_tensor, ref["l0.weight"][200:])
    assert res.bytes_read == 100 * 260 + 4 * 2 * 3  # rows 200..299: tiles 1 and 2 of scales




#: sha256 of every file ``_many_rounds`` exports (fp32, then cast to bf16), as written when each
#: round allocated new host tensors: reused buffers must write the same bytes
ROUNDS_FILES = {
    "fp32": {
        "model-00001-of-00004.safetensors": "6a4d91a76465a50160713b808046537274ebe61365261f7041c30d258d38e4d8",
        "model-00002-of-00004.safetensors": "8118bac61e5f410d26e2e55aa91658c02d59e2651fe262c786ea95395345d863",
        "model-00003-of-00004.safetensors": "6dcc5b6ecf24878dee7a6d47ce89a59e8cdafd90a15111b568e0667474f6aed8",
        "model-00004-of-00004.safetensors": "07537707d08faf2376ea49c8527f2c8570bb759ce43c90abd0a93f1bfca4cb3d",
        "model.safetensors.index.json": "f2ea2140bf947022f6a3d918cc325d7543e57ba40b5399542b4bdb3b7924cd23",
    },
    "bf16": {
        "model-00001-of-00002.safetensors": "6dc6040198ef81b74db4814eaebab63159a6c75d03646d8d55c4d93174bffb0d",
        "model-00002-of-00002.safetensors": "216532020c5853d38501fe6611df0c5d695a73850818b9ed8daa641b10f6c213",
        "model.safetensors.index.json": "79a01a6befcd945cc475f4466a2ce35a6ead3ce66a25659bfbfded20dd60ff07",
    },
}


def test_row_runs_written_into_a_shared_file_make_the_safetensors_file(tmp_path):
    """``SafetensorsPart.write_run``: two row runs of one tensor written by two writers in any
    order make the file safetensors writes; a run past the tensor's end, or of another dtype,
    is refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from ckptfs.layout.dtypes import from_torch
    from ckptfs.tools.safetensors_file import SafetensorsPart, TensorSpec, create_sized, layout

    w, b = torch.arange(24.0).reshape(6, 4), torch.arange(3, dtype=torch.int64)
    specs = [TensorSpec("w", from_torch(torch.float32, "w"), (6, 4)),
             TensorSpec("b", from_torch(torch.int64, "b"), (3,))]
    header, _ = layout(specs, {"format": "pt"})
    path = tmp_path / "model.safetensors"
    create_sized(path, header, len(header) + sum(s.nbytes for s in specs))
    first, second = SafetensorsPart(path, specs, {"format": "pt"}), SafetensorsPart(path, specs, {"format": "pt"})
    second.write_run("w", (6, 4), 2 * 4, w[2:])
    first.write_run("w", (6, 4), 0, w[:2])
    first.write("b", b)
    with pytest.raises(ValueError, match="'w': 32 bytes from element 20"):
        second.write_run("w", (6, 4), 20, w[:2])
    with pytest.raises(ValueError, match="'w' is torch.float64"):
        second.write_run("w", (6, 4), 0, w[:2].double())
    first.close()
    second.close()
    save_file({"w": w, "b": b}, tmp_path / "reference.safetensors", {"format": "pt"})
    assert path.read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    assert torch.equal(load_file(path)["w"], w)


def _failing_write(rank: int, world: int, root: str) -> None:
    """Rank 1's writes fail (a full disk): every rank raises, and no file of the export is
    left, published or partial."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state = {f"w{i}": distribute_tensor(torch.full((8, 6), float(i)), mesh, [Shard(0)]) for i in range(4)}
    real = os.pwrite

    def full(fd: int, data: Any, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    os.pwrite = full if rank == 1 else real  # type: ignore[assignment]
    try:
        with pytest.raises((OSError, ckptfs.RankError), match="No space left|rank 1"):
            ckptfs.export_hf(state, f"{root}/full", max_shard_size=200)
    finally:
        os.pwrite = real  # type: ignore[assignment]
    dist.barrier()
    left = sorted(p.name for p in Path(f"{root}/full").rglob("*") if p.is_file())
    assert left == [], left


@pytest.mark.slow
def test_a_failed_write_into_shared_files_fails_every_rank_and_leaves_no_file(tmp_path):
    run_ranks(2, _failing_write, str(tmp_path), timeout=120)


def _many_rounds(rank: int, world: int, root: str) -> None:
    """Twelve DTensors sharded by rows and by columns (a received column piece lands in a
    non-contiguous place), a replica and an empty tensor, exported in rounds of at most one
    tensor; each rank records the host buffers it allocated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) * 0.37
    state: dict = {f"w{i:02d}": distribute_tensor((base + i) / 7, mesh, [Shard(i % 2)])
                   for i in range(12)}  # 12 kB each
    state |= {"norm": torch.linspace(-1, 1, 300), "empty": torch.zeros(0, 5)}
    for tag, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        r = ckptfs.export_hf(state, f"{root}/{tag}-{world}", dtype=dtype, max_shard_size=40_000,
                             buffer_bytes=16 << 10)
        Path(f"{root}/{tag}-{world}.rank{rank}.json").write_text(json.dumps(r.host_buffers))


def _digests(d: Path) -> dict[str, str]:
    import hashlib

    return {n: hashlib.sha256(b).hexdigest() for n, b in files(d).items()}


@pytest.mark.slow
def test_export_hf_reuses_one_host_buffer_over_its_rounds_and_writes_the_same_bytes(tmp_path):
    """At 1 rank each of the 14 tensors makes a round of its own (12 kB each, 16 kB a round):
    one buffer serves them all (none at all where the rank writes every tensor from the
    caller's own bytes: fp32 at 1 rank); the files are the bytes exported before buffers were
    reused, from 1 and from 2 ranks."""
    for world in (1, 2):
        run_ranks(world, _many_rounds, str(tmp_path), timeout=300)
    for tag in ("fp32", "bf16"):
        assert _digests(tmp_path / f"{tag}-1") == _digests(tmp_path / f"{tag}-2") == ROUNDS_FILES[tag]
        for world in (1, 2):
            for rank in range(world):
                sizes = json.loads((tmp_path / f"{tag}-{world}.rank{rank}.json").read_text())
                if world == 1 and tag == "fp32":  # every tensor written from the caller's own
                    assert sizes == [], sizes
                    continue
                assert len(sizes) == 1 and 0 < sizes[0] <= 3 * (16 << 10), (tag, world, rank, sizes)
    from safetensors.torch import load_file

    base = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48) * 0.37
    got = {k: v for p in sorted((tmp_path / "bf16-2").glob("model-*")) for k, v in load_file(p).items()}
    assert all(torch.equal(got[f"w{i:02d}"], ((base + i) / 7).bfloat16()) for i in range(12))
    assert torch.equal(got["norm"], torch.linspace(-1, 1, 300).bfloat16()) and got["empty"].shape == (0, 5)
