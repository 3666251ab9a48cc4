"""MXFP4 reads: a tiny gpt-oss model (transformers, random weights, made here) whose experts are
quantised to MXFP4 as gpt-oss ships them (``*_blocks`` / ``*_scales``, a scale in another file
than its blocks) loads through ``ckptfs.load_hf_quantized`` into bf16 tensors equal, bit for
bit, to what transformers' ``from_pretrained`` gives when it dequantises the same files; into
DTensors sharded over experts, columns and rows on 2 and 3 spawned gloo ranks; a shard reads
only its groups' bytes; bad shapes are refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.testing.ranks import run_ranks

transformers = pytest.importorskip("transformers")  # the `test` extra

FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
UP = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (E, R, C) to MXFP4: per 32 values a power-of-two scale putting the largest
    magnitude at or under 6 (E2M1's largest), each value to the nearest FP4 code, two a byte."""
    e, r, c = w.shape
    groups = w.float().reshape(e, r, c // 32, 32)
    exp = torch.floor(torch.log2(groups.abs().amax(-1).clamp_min(2.0 ** -100))) - 2
    scaled = groups / torch.pow(2.0, exp)[..., None]
    code = (scaled[..., None] - FP4).abs().argmin(-1).to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)), (exp + 127).to(torch.uint8)


def tiny_gpt_oss():
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.GptOssForCausalLM(cfg).to(torch.bfloat16)


def mxfp4_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """Write the checkpoint (config included); returns what ``from_pretrained`` loads from it,
    dequantised to bf16."""
    from safetensors.torch import save_file

    model = tiny_gpt_oss()
    files: list[dict[str, torch.Tensor]] = [{}, {}]
    for i, (k, v) in enumerate(model.state_dict().items()):
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = quantize_mxfp4(v.transpose(1, 2))  # stored (E, out, in)
            files[0][k + "_blocks"], files[1][k + "_scales"] = blocks, scales
        else:
            files[i % 2][k] = v.contiguous()
    d.mkdir()
    for name, tensors in zip(FILES, files, strict=True):
        save_file(tensors, str(d / name), metadata={"format": "pt"})
    weight_map = {k: name for name, tensors in zip(FILES, files, strict=True) for k in tensors}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (d / "config.json").write_text(json.dumps(config))
    loaded = transformers.GptOssForCausalLM.from_pretrained(
        d, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    return {k: v.detach().clone() for k, v in loaded.state_dict().items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("mxfp4")
    return d / "ckpt", mxfp4_checkpoint(d / "ckpt")


def test_mxfp4_experts_load_as_transformers_dequantises_them(checkpoint):
    path, ref = checkpoint
    assert ref[UP].shape == (4, 64, 192) and ref[DOWN].shape == (4, 96, 64)
    target = {k: torch.full_like(v, float("nan")) for k, v in ref.items()}
    res = ckptfs.load_hf_quantized(target, path)
    assert res.missing_keys == [] and res.unexpected_keys == []
    bad = [k for k, v in ref.items() if not torch.equal(target[k], v)]
    assert not bad, bad
    assert target[UP].abs().max() > 0
    # the documented value of one element, by hand: FP4 code times 2 ** (scale - 127)
    from safetensors.torch import load_file

    blocks = load_file(str(path / FILES[0]))[UP + "_blocks"]
    scales = load_file(str(path / FILES[1]))[UP + "_scales"]
    e, out_row, col = 2, 5, 37  # the model's (e, col, out_row); stored (e, out_row, col)
    byte = int(blocks[e, out_row, col // 32, (col % 32) // 2])
    code = byte >> 4 if col % 2 else byte & 0x0F
    want = FP4[code] * 2.0 ** (int(scales[e, out_row, col // 32]) - 127)
    assert target[UP][e, col, out_row].float() == want.to(torch.bfloat16).float()


def test_a_shard_reads_only_the_groups_it_needs(checkpoint):
    path, ref = checkpoint
    # experts 1..2, columns 40..79 (groups 1 and 2 of 32), output rows 16..47
    part = {DOWN: ckptfs.ShardedTensor(torch.zeros(2, 40, 32, dtype=torch.bfloat16), (4, 96, 64),
                                       (1, 40, 16))}
    res = ckptfs.load_hf_quantized(part, path, strict=False)
    assert torch.equal(part[DOWN].local_tensor, ref[DOWN][1:3, 40:80, 16:48])
    assert res.bytes_read == 2 * 32 * 2 * 16 + 2 * 32 * 2  # blocks and scales of 2 groups


def test_mxfp4_of_the_wrong_shape_is_refused_naming_the_key(checkpoint):
    path, _ = checkpoint
    with pytest.raises(ckptfs.MismatchError, match=f"'{DOWN}'.*target \\[4, 64, 96\\]"):
        ckptfs.load_hf_quantized({DOWN: torch.zeros(4, 64, 96, dtype=torch.bfloat16)}, path,
                                 strict=False)


def _sharded(rank: int, world: int, path: str, ref_file: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    ref = torch.load(ref_file, weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    for dim in (0, 1, 2):
        target = {k: distribute_tensor(torch.zeros_like(ref[k]), mesh, [Shard(dim)]) for k in (UP, DOWN)}
        ckptfs.load_hf_quantized(target, path, strict=False)
        for k, v in target.items():
            assert torch.equal(v.full_tensor(), ref[k]), (k, dim)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_mxfp4_loads_resharded_over_experts_columns_and_rows(checkpoint, world, tmp_path):
    path, ref = checkpoint
    torch.save({k: ref[k] for k in (UP, DOWN)}, tmp_path / "ref.pt")
    run_ranks(world, _sharded, str(path), str(tmp_path / "ref.pt"), timeout=300)
