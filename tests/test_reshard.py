"""N -> M resharding on spawned gloo ranks: DTensor Shard(0)/Shard(1)/Replicate, uneven splits,
2-D meshes, explicit ShardedTensors and plain replicated tensors, bit-exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptfs
from tests.dist_utils import run_ranks

SHAPE = (10, 6)  # 10 rows over 3 ranks is uneven (4, 4, 2)


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(SHAPE, generator=g),
        "wbf": torch.randn(SHAPE, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "plain": torch.randn(3, 5, generator=g),
    }


def layout(name: str, world: int):
    mesh = init_device_mesh("cpu", (world,))
    return mesh, {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()]}[name]


def _state(world: int, how: str) -> dict:
    ref = reference()
    mesh, placements = layout(how, world)
    return {
        "model": {
            "w32": distribute_tensor(ref["w32"], mesh, placements),
            "wbf": distribute_tensor(ref["wbf"], mesh, placements),
        },
        "i64": distribute_tensor(ref["i64"], mesh, [Shard(0)]),
        "plain": ref["plain"].clone(),
        "step": 12,
        "name": "run-1",
    }


def _zeros_like_state(world: int, how: str) -> dict:
    sd = _state(world, how)
    for k in ("w32", "wbf"):
        sd["model"][k] = torch.zeros_like(sd["model"][k])
    sd["i64"] = torch.zeros_like(sd["i64"])
    sd["plain"] = torch.zeros_like(sd["plain"])
    sd["step"], sd["name"] = 0, ""
    return sd


def save_ranks(rank: int, world: int, url: str, how: str) -> None:
    res = ckptfs.save(_state(world, how), url)
    assert res.total_bytes > 0


def load_ranks(rank: int, world: int, url: str, how: str) -> None:
    sd = _zeros_like_state(world, how)
    res = ckptfs.load(sd, url, io_config=ckptfs.IOConfig(max_gap=0))
    ref = reference()
    for k in ("w32", "wbf"):
        assert torch.equal(sd["model"][k].full_tensor(), ref[k]), k
    assert torch.equal(sd["i64"].full_tensor(), ref["i64"])
    assert torch.equal(sd["plain"], ref["plain"])
    assert sd["step"] == 12 and sd["name"] == "run-1"
    assert res.missing_keys == [] and res.unexpected_keys == []
    # without gap coalescing, exactly the overlapping bytes are read
    assert res.bytes_read == res.bytes_needed, (res.bytes_read, res.bytes_needed)
    dist.barrier()


@pytest.mark.parametrize("src,dst", [(2, 1), (2, 3), (1, 4), (3, 2)])
@pytest.mark.parametrize("save_how,load_how", [("row", "row"), ("col", "row"), ("rep", "col")])
def test_reshard(tmp_path, src, dst, save_how, load_how):
    url = str(tmp_path / "ckpt")
    run_ranks(src, save_ranks, url, save_how)
    run_ranks(dst, load_ranks, url, load_how)
