"""N -> M resharding on spawned gloo ranks, bit-exact: DTensor Shard(0)/Shard(1)/Replicate on 1-D
and 2-D meshes, uneven splits (10 rows over 3 and 4 ranks), explicit uneven ShardedTensors and
plain replicated tensors. Saves for every source world size run in one spawn each; every target
world size loads every checkpoint in one spawn, so the whole matrix costs 7 spawns."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptfs
from ckptfs.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # every test spawns ranks

SHAPE = (10, 6)  # 10 rows over 3 ranks is uneven (4, 4, 2); over 4 ranks (3, 3, 3, 1)
LAYOUTS_1D = {"row": [Shard(0)], "col": [Shard(1)], "rep": [Replicate()]}
# 2-D meshes (world 4 only): (dp, tp)
LAYOUTS_2D = {"2d_rep_row": [Replicate(), Shard(0)], "2d_row_col": [Shard(0), Shard(1)]}
SOURCES = (1, 2, 3, 4)
TARGETS = (1, 2, 3, 4)


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w32": torch.randn(SHAPE, generator=g),
        "wbf": torch.randn(SHAPE, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "plain": torch.randn(3, 5, generator=g),
        "cube": torch.randn(4, 5, 6, generator=g),
    }


def layouts(world: int) -> list[str]:
    return [*LAYOUTS_1D, *(LAYOUTS_2D if world == 4 else ())]


def _mesh_and_placements(how: str, world: int):
    if how in LAYOUTS_2D:
        return init_device_mesh("cpu", (2, 2)), LAYOUTS_2D[how]
    return init_device_mesh("cpu", (world,)), LAYOUTS_1D[how]


def _uneven_rows(world: int, n: int) -> list[tuple[int, int]]:
    """Deliberately irregular row splits: rank r gets r+1 parts of n (not torch.chunk's)."""
    weights = list(range(1, world + 1))
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + round(n * w / sum(weights)))
    bounds[-1] = n
    return [(bounds[i], bounds[i + 1]) for i in range(world)]


def make_state(world: int, rank: int, how: str, fill: bool) -> dict:
    ref = reference()
    mesh, placements = _mesh_and_placements(how, world)
    def d(t, p=placements):
        x = distribute_tensor(t, mesh, p)
        return x if fill else torch.zeros_like(x)
    lo, hi = _uneven_rows(world, 4)[rank]
    cube = ref["cube"][lo:hi].clone() if fill else torch.zeros(hi - lo, 5, 6)
    return {
        "model": {"w32": d(ref["w32"]), "wbf": d(ref["wbf"])},
        "i64": d(ref["i64"], [Shard(0)] * len(placements)),
        "plain": ref["plain"].clone() if fill else torch.zeros(3, 5),
        "cube": ckptfs.ShardedTensor(cube, (4, 5, 6), (lo, 0, 0)),
        "step": 12 if fill else 0,
        "name": "run-1" if fill else "",
    }


def save_all(rank: int, world: int, root: str) -> None:
    for how in layouts(world):
        ckptfs.save(make_state(world, rank, how, True), f"{root}/w{world}-{how}")


def load_all(rank: int, world: int, root: str) -> None:
    ref = reference()
    failures = []
    for src in SOURCES:
        for saved_how in layouts(src):
            for how in layouts(world):
                sd = make_state(world, rank, how, False)
                res = ckptfs.load(sd, f"{root}/w{src}-{saved_how}",
                                  store_options=ckptfs.StoreOptions(max_gap=0))
                case = f"{src}:{saved_how} -> {world}:{how}"
                lo, hi = _uneven_rows(world, 4)[rank]
                ok = (torch.equal(sd["model"]["w32"].full_tensor(), ref["w32"])
                      and torch.equal(sd["model"]["wbf"].full_tensor(), ref["wbf"])
                      and torch.equal(sd["i64"].full_tensor(), ref["i64"])
                      and torch.equal(sd["plain"], ref["plain"])
                      and torch.equal(sd["cube"].local_tensor, ref["cube"][lo:hi])
                      and sd["step"] == 12 and sd["name"] == "run-1"
                      and res.missing_keys == [] and res.unexpected_keys == []
                      # without gap coalescing, exactly the overlapping bytes are read
                      and res.bytes_read == res.bytes_needed)
                if not ok:
                    failures.append((case, res.bytes_read, res.bytes_needed))
    dist.barrier()
    assert not failures, failures


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("reshard"))
    for world in SOURCES:
        run_ranks(world, save_all, root)
    return root


@pytest.mark.parametrize("world", TARGETS)
def test_load_every_source_layout(saved, world):
    run_ranks(world, load_all, saved)


def test_replicas_written_once(saved):
    idx = ckptfs.load_metadata(f"{saved}/w4-2d_rep_row")
    for key in ("model/w32", "model/wbf"):
        chunks = idx.tensors[key].chunks
        # 4 ranks hold 2 distinct row shards (replicated over dp): 2 chunks stored, not 4
        assert [c.shape for c in chunks] == [(5, 6), (5, 6)]
    # a plain tensor replicated on every rank is one chunk
    assert len(idx.tensors["plain"].chunks) == 1
    # writers are spread: not everything on rank 0
    writers = {c.file.split("/")[-1][:6] for t in idx.tensors.values() for c in t.chunks}
    assert len(writers) > 1, writers
