"""Hugging Face safetensors interop: directories written by ``transformers`` itself
(``save_pretrained``, sharded and single-file) and by DCP's ``HuggingFaceStorageWriter`` load
through ckptfs (locally and on S3, reading only the bytes asked for); ``unshard --format hf``
output loads with ``transformers``' own ``from_pretrained`` and DCP's reader, bit-exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptfs
from ckptfs.cli import main
from ckptfs.io import open_store, run_sync

transformers = pytest.importorskip("transformers")  # the `test` extra


def tiny_llama(seed: int = 0):
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def same(a: dict, b: dict) -> list[str]:
    if set(a) != set(b):
        return [f"keys differ: {sorted(set(a) ^ set(b))[:5]}"]
    return [k for k in b if not (a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
                                 and torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)))]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def pretrained(model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="40KB")
    model.save_pretrained(root / "single", safe_serialization=True)
    return {"sharded": root / "sharded", "single": root / "single"}


def test_transformers_directories_load(model, pretrained):
    sd = model.state_dict()
    shards = sorted(p.name for p in pretrained["sharded"].glob("model-*.safetensors"))
    assert len(shards) >= 3 and (pretrained["single"] / "model.safetensors").is_file()
    for name, root in pretrained.items():
        meta = ckptfs.load_metadata(root)
        assert (meta.backend, meta.backend_version) == ("hf_safetensors", 1)
        assert set(meta.tensors) == set(sd) and not meta.values
        assert sorted(meta.files) == (shards if name == "sharded" else ["model.safetensors"])
        assert not same(ckptfs.load_keys(root), sd), name
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        res = ckptfs.load(target, root)
        assert res.missing_keys == [] and res.unexpected_keys == [] and not same(target, sd)
        key = "model.layers.1.mlp.down_proj.weight"  # a partial load reads only its bytes
        part = {key: torch.zeros_like(sd[key])}
        res = ckptfs.load(part, root)
        assert res.bytes_read == sd[key].nbytes and torch.equal(part[key], sd[key])
    assert ckptfs.verify(pretrained["sharded"]).ok


def test_transformers_directory_on_s3(model, pretrained, s3):
    async def upload() -> None:
        store = await open_store(f"{s3.url}/llama", s3.options)
        try:
            for p in pretrained["sharded"].iterdir():
                await store.put(p.name, [p.read_bytes()])
        finally:
            await store.close()

    run_sync(upload())
    url = f"{s3.url}/llama"
    sd = model.state_dict()
    assert not same(ckptfs.load_keys(url, storage_options=s3.options), sd)
    key = "model.embed_tokens.weight"
    rows = {key: ckptfs.ShardedTensor(torch.zeros(10, 32), (96, 32), (40, 0))}  # rows 40..49 only
    res = ckptfs.load(rows, url, storage_options=s3.options)
    assert res.bytes_read == 10 * 32 * 4 and torch.equal(rows[key].local_tensor, sd[key][40:50])


def test_dcp_huggingface_storage_writer(model, tmp_path):
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.bfloat16)
    mapping = {k: 1 + (i % 3) for i, k in enumerate(sd)}
    dcp.save(sd, storage_writer=HuggingFaceStorageWriter(str(tmp_path / "dcp"), fqn_to_index_mapping=mapping),
             no_dist=True)
    assert sorted(p.name for p in (tmp_path / "dcp").iterdir()) == [
        "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert not same(ckptfs.load_keys(tmp_path / "dcp"), sd)
    # and the other way: DCP's reader loads ckptfs's Hugging Face export
    ckptfs.convert(tmp_path / "dcp", tmp_path / "ck", backend="zarr", backend_version=3)
    ckptfs.unshard(tmp_path / "ck", tmp_path / "out", format="hf", strategy="chunks", chunk_size=30_000)
    back = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "out")), no_dist=True)
    assert not same(back, sd)


@pytest.mark.parametrize("strategy", ["chunks", "one_file"])
def test_unshard_hf_loads_with_from_pretrained(model, tmp_path, capsys, strategy):
    ckpt = tmp_path / "ckpt"
    ckptfs.save_model_and_optim_state(ckpt, model, torch.optim.AdamW(model.parameters()),
                                      backend="torch_dist")
    out = tmp_path / "export"
    args = ["unshard", str(ckpt), str(out), "--format", "hf", "--keys", "model", "--strategy", strategy,
            "--quiet"] + (["--chunk-size", "40KB"] if strategy == "chunks" else [])
    assert main(args) == 0, capsys.readouterr().err
    model.config.save_pretrained(out)  # config.json: the architecture (ckptfs stores weights only)
    if strategy == "chunks":
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) >= 3
    loaded = transformers.LlamaForCausalLM.from_pretrained(out)
    assert not same(loaded.state_dict(), model.state_dict())
    ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_hf_backend_is_read_only(pretrained, tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="hf_safetensors-1 is read-only.*unshard"):
        ckptfs.save({"w": torch.ones(2)}, tmp_path / "x", backend="hf_safetensors")
    assert not (tmp_path / "x").exists()
    assert not ckptfs.get_backend("hf_safetensors", 1).writable
    with pytest.raises(ckptfs.CheckpointExistsError, match="another tool"):  # an HF directory is a checkpoint
        ckptfs.save({"w": torch.ones(2)}, pretrained["single"])
