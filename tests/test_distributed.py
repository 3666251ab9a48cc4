"""Distributed saves and loads on 4 spawned gloo ranks (one spawn for all cases): balanced
replica dedup, plan caching and its invalidation, validation errors that name key, region and
ranks (raised on every rank, no hang), plain tensors that differ between ranks, per-rank state
(``ckptfs.PerRank``), and read-once-and-exchange loads (``LoadOptions(exchange=True)``) against
moto's S3 server and local disk."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import ckptfs
from ckptfs.testing.ranks import run_ranks
from tests.s3_fixtures import BUCKET, s3_options

pytestmark = pytest.mark.slow  # every test spawns ranks


def gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def raises(fn, *types) -> str:
    try:
        fn()
    except types as e:
        return str(e)
    raise AssertionError(f"no error raised, wanted {types}")


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def balance(rank: int, world: int, root: str) -> dict:
    """One replicated tensor dominates: every rank writes a quarter of it."""
    from ckptfs.planning import save_plan

    save_plan.MIN_SLICE_BYTES = 16 << 10  # small tensors, the same cut as 1 MiB ones get
    g = torch.Generator().manual_seed(0)
    big = torch.randn(256, 256, generator=g)  # 256 KiB, the same on every rank
    small = {i: torch.randn(16, generator=g) for i in range(20)}
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.randn(512, 256, generator=g)  # 512 KiB, rows halved over mesh dim 1
    sd = {"big": big, "small": small, "lr": 0.1,
          "w": distribute_tensor(full, mesh, [Replicate(), Shard(0)])}
    res = ckptfs.save(sd, f"{root}/balance")
    written = gather(res.bytes_written)
    mean = sum(written) / world
    assert max(written) <= 1.25 * mean, written
    index = ckptfs.load_metadata(f"{root}/balance")
    unique = nbytes(big) + sum(nbytes(t) for t in small.values()) + nbytes(full)
    stored = sum(c.byte_length for t in index.tensors.values() for c in t.chunks)
    assert stored == unique, (stored, unique)  # every byte of the state on disk exactly once
    assert len({c.file for c in index.tensors["big"].chunks}) == world  # written by all ranks
    back = ckptfs.load_keys(f"{root}/balance")
    assert torch.equal(back["big"], big) and torch.equal(back["w"], full)
    save_plan.MIN_SLICE_BYTES = 1 << 20
    return {"written": written, "stored": stored, "unique": unique}


def plan_cache(rank: int, world: int, root: str) -> dict:
    """2,000 hand-sharded tensors: the second save of the same structure reuses the plan and
    its collectives carry O(1) bytes besides the index entries sent to rank 0."""
    sd = {f"t{i}": ckptfs.ShardedTensor(torch.full((2, 3), float(i)), (2 * world, 3), (2 * rank, 0))
          for i in range(2000)}
    first = ckptfs.save(sd, f"{root}/cache1")
    second = ckptfs.save(sd, f"{root}/cache2")
    small = {f"t{i}": sd[f"t{i}"] for i in range(20)}
    ckptfs.save(small, f"{root}/cache3")
    third = ckptfs.save(small, f"{root}/cache4")
    assert not first.plan_cached and second.plan_cached and third.plan_cached
    back = ckptfs.load_keys(f"{root}/cache2", ["t1999"])
    assert torch.equal(back["t1999"], torch.full((2 * world, 3), 1999.0))
    out = {}
    for name, r in (("first", first), ("second", second), ("small", third)):
        c = r.comm
        out[name] = {"planning": c.object_bytes - c.entry_bytes, "entries": c.entry_bytes,
                     "tensor": c.tensor_bytes}
    if rank == 1:  # a non-coordinator
        assert out["first"]["planning"] > 100_000, out
        assert out["second"]["planning"] < 1024, out  # O(1): a few small broadcasts
        assert out["second"]["planning"] <= out["small"]["planning"] + 64, out
        assert out["second"]["entries"] > 10_000, out  # entries still reach the coordinator
        assert out["second"]["tensor"] <= out["small"]["tensor"], out
    return out


def invalidation(rank: int, world: int, root: str) -> dict:
    """A cached plan is never reused when shapes, dtypes, placements or the world change."""
    mesh = init_device_mesh("cpu", (world,))
    x = torch.arange(64.0).reshape(8, 8)

    def state(shape=(4,), dtype=torch.float32, placement=None):
        return {"w": distribute_tensor(x, mesh, [placement or Shard(0)]),
                "p": torch.ones(shape, dtype=dtype)}

    seen = {}
    n = 0

    def save(tag, sd, **kw):
        nonlocal n
        n += 1
        r = ckptfs.save(sd, f"{root}/inv{n}", **kw)
        seen[tag] = r.plan_cached
        back = ckptfs.load_keys(f"{root}/inv{n}")
        assert torch.equal(back["w"], x) and torch.equal(back["p"], sd["p"]), tag

    save("base", state())
    save("base again", state())
    save("shape", state(shape=(5,)))
    save("shape again", state(shape=(5,)))
    save("dtype", state(shape=(5,), dtype=torch.float64))
    save("placement", state(shape=(5,), dtype=torch.float64, placement=Shard(1)))
    save("placement again", state(shape=(5,), dtype=torch.float64, placement=Shard(1)))
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    group = groups[rank // 2]
    sub = {"w": torch.arange(8.0), "p": torch.ones(5, dtype=torch.float64)}
    n += 1
    r = ckptfs.save(sub, f"{root}/inv{n}-{rank // 2}", process_group=group)
    seen["world"] = r.plan_cached
    save("4 ranks again", state(shape=(5,), dtype=torch.float64, placement=Shard(1)))
    want = {"base": False, "base again": True, "shape": False, "shape again": True,
            "dtype": False, "placement": False, "placement again": True, "world": False,
            "4 ranks again": True}
    assert seen == want, seen
    return seen


def validation(rank: int, world: int, root: str) -> dict:
    """Mismatches raise on every rank with the key, the region and the ranks; nothing is
    committed."""
    msgs = {}
    err = (ckptfs.ShardingError, ckptfs.RankError)

    def refused(name, sd):
        msgs[name] = raises(lambda: ckptfs.save(sd, f"{root}/{name}"), *err)
        assert not os.path.exists(f"{root}/{name}/{ckptfs.INDEX_FILE}"), name

    # the case: rank 0 saves {"a", "extra"}, the others {"a"} (plain tensors)
    refused("extra_key", {"a": torch.ones(2)} | ({"extra": torch.ones(1)} if rank == 0 else {}))
    # shards overlap: rows [r, r + 2) of 5
    refused("overlap", {"w": ckptfs.ShardedTensor(torch.ones(2, 2), (5, 2), (rank, 0))})
    # shards leave a hole: row 2r of 8
    refused("hole", {"w": ckptfs.ShardedTensor(torch.ones(1, 2), (8, 2), (2 * rank, 0))})
    # dtypes disagree
    refused("dtype", {"a": torch.ones(2, dtype=torch.float64 if rank == 3 else torch.float32)})
    # shapes disagree
    refused("shape", {"a": torch.ones(3 if rank == 1 else 2)})
    # a DTensor one rank of its mesh does not save
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.ones(8, 2), mesh, [Shard(0)])
    refused("dtensor_missing", {"a": torch.ones(1)} | ({"d": d} if rank != 2 else {}))
    # a plain tensor whose content differs (per-rank RNG state saved as if replicated)
    refused("rng", {"a": torch.ones(3), "rng": torch.full((1000,), float(rank))})
    # a plain value that differs
    refused("seed", {"a": torch.ones(1), "seed": 1234 + (rank == 2)})
    # all ranks still in step
    t = torch.tensor([1])
    dist.all_reduce(t)
    assert t.item() == world
    return msgs


def per_rank(rank: int, world: int, root: str) -> dict:
    """``ckptfs.PerRank`` state round-trips per rank: RNG states, Python values."""
    torch.manual_seed(100 + rank)
    random.seed(rank)
    state = {"w": torch.ones(4),
             "rng": ckptfs.PerRank({"torch": torch.get_rng_state(), "py": random.getstate(),
                                    "step": rank * 10})}
    ckptfs.save(state, f"{root}/per_rank")
    want_torch = torch.get_rng_state()
    torch.manual_seed(0)
    random.seed(0)
    target = {"w": torch.zeros(4),
              "rng": ckptfs.PerRank({"torch": torch.zeros_like(want_torch), "py": random.getstate(),
                                     "step": -1})}
    res = ckptfs.load(target, f"{root}/per_rank")
    got = target["rng"].value
    assert torch.equal(got["torch"], want_torch) and got["step"] == rank * 10
    random.setstate(got["py"])  # a valid Python RNG state again
    assert res.unexpected_keys == [], res.unexpected_keys  # other ranks' entries are expected
    everyone = ckptfs.load_keys(f"{root}/per_rank")["rng"]
    assert sorted(everyone) == list(range(world)) and everyone[2]["step"] == 20
    assert ckptfs.load_metadata(f"{root}/per_rank").per_rank == ("rng",)
    return {"py_kind": type(got["py"]).__name__}


def replicated(fill: bool) -> dict:
    g = torch.Generator().manual_seed(3)

    def t(*shape, dtype=torch.float32):
        if not fill:
            return torch.zeros(shape, dtype=dtype)
        return torch.randn(shape, generator=g).to(dtype)

    return {"big": t(256, 256), "bf": t(64, 100, dtype=torch.bfloat16),
            "small": {i: t(50) for i in range(12)}, "scalar": t(), "step": 9 if fill else 0}


def unique(sd: dict) -> int:
    return sum(x.numel() * x.element_size() for x in
               [sd["big"], sd["bf"], sd["scalar"], *sd["small"].values()])


def same(a: dict, b: dict) -> bool:
    return (all(torch.equal(a[k], b[k]) for k in ("big", "bf", "scalar")) and a["step"] == b["step"]
            and all(torch.equal(a["small"][i], b["small"][i]) for i in a["small"]))


def exchange(rank: int, world: int, root: str, endpoint: str) -> dict:
    from ckptfs.planning import save_plan


    save_plan.MIN_SLICE_BYTES = 16 << 10  # the big tensor is stored as 4 slices
    opts = s3_options(endpoint)
    ref = replicated(True)
    results: dict = {}
    s3 = f"s3://{BUCKET}/exchange"
    ckptfs.save(ref, s3, storage_options=opts)

    # 1. replicated state on S3: storage bytes summed over ranks = unique bytes, not 4x
    for name, ex in (("exchange", True), ("default", None), ("plain", False)):
        tgt = replicated(False)
        res = ckptfs.load(tgt, s3, storage_options=opts,
                          options=ckptfs.LoadOptions(exchange=ex))
        assert same(tgt, ref), name
        results[name] = {"read": gather(res.bytes_read), "got": gather(res.exchanged_bytes),
                         "needed": res.bytes_needed}
    results["unique"] = unique(ref)

    # 2. a tiny budget: many rounds, same result
    tgt = replicated(False)
    ckptfs.load(tgt, s3, storage_options=opts,
                options=ckptfs.LoadOptions(exchange=True, exchange_bytes=4096))
    assert same(tgt, ref)

    # 3. with pre_download: each node caches only what its ranks read, then exchange
    os.environ["CKPTFS_NODE_ID"] = f"node{rank // 2}"
    tgt = replicated(False)
    res = ckptfs.load(tgt, s3, storage_options=opts, options=ckptfs.LoadOptions(
        exchange=True, pre_download=True, work_dir=os.path.join(root, f"xcache{rank // 2}")))
    assert same(tgt, ref)
    results["pre_download"] = gather(res.bytes_read)

    # 4. a 2-D mesh, (Replicate, Shard(0)): ranks 0,2 and 1,3 need the same rows; each row
    # block is read by one of its two ranks; a non-contiguous target (Shard(1)) too
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(64 * 48, dtype=torch.float32).reshape(64, 48)
    local = os.path.join(root, "xmesh")
    ckptfs.save({"w": distribute_tensor(full, mesh, [Shard(0), Shard(1)])}, local)
    for placement, name in ((Shard(0), "rows"), (Shard(1), "columns")):
        tgt = {"w": distribute_tensor(torch.zeros(64, 48), mesh, [Replicate(), placement])}
        res = ckptfs.load(tgt, local, store_options=ckptfs.StoreOptions(max_gap=0),
                          options=ckptfs.LoadOptions(exchange=True))
        assert torch.equal(tgt["w"].full_tensor(), full), name
        results[name] = {"read": gather(res.bytes_read), "got": gather(res.exchanged_bytes)}
    results["mesh_bytes"] = full.numel() * 4
    # 5. a DTensor Replicate()d over a 1-D mesh of all ranks: read once, broadcast
    line = init_device_mesh("cpu", (world,))
    rep = torch.arange(48 * 32, dtype=torch.float32).reshape(48, 32)
    ckptfs.save({"r": distribute_tensor(rep, line, [Replicate()])}, os.path.join(root, "xrep"))
    tgt = {"r": distribute_tensor(torch.zeros(48, 32), line, [Replicate()])}
    res = ckptfs.load(tgt, os.path.join(root, "xrep"),
                      options=ckptfs.LoadOptions(exchange=True))
    assert torch.equal(tgt["r"].to_local(), rep)
    results["replicate"] = {"read": gather(res.bytes_read), "got": gather(res.exchanged_bytes),
                            "bytes": rep.numel() * 4}
    save_plan.MIN_SLICE_BYTES = 1 << 20
    # read once per group: storage bytes summed over ranks are the unique bytes, not 4x
    assert sum(results["exchange"]["read"]) == results["unique"], results["exchange"]
    assert sum(results["plain"]["read"]) == world * results["unique"], results["plain"]
    assert sum(results["rows"]["read"]) == results["mesh_bytes"], results["rows"]
    return results


def cases(rank: int, world: int, root: str, endpoint: str, out: str) -> None:
    import time

    results = {}
    for fn in (balance, plan_cache, invalidation, validation, per_rank):
        t0 = time.perf_counter()
        results[fn.__name__] = fn(rank, world, root)
        if rank == 0:
            print(f"{fn.__name__}: {time.perf_counter() - t0:.1f} s", flush=True)
    results["exchange"] = exchange(rank, world, root, endpoint)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, moto_server):
    from tests.s3_fixtures import reset_bucket

    reset_bucket(moto_server)
    root = tmp_path_factory.mktemp("distributed")
    out = root / "out"
    out.mkdir()
    run_ranks(4, cases, str(root / "ck"), moto_server, str(out), timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.timeout(360)
def test_a_dominating_replica_is_written_by_all_its_holders(outcomes):
    b = outcomes[0]["balance"]
    assert max(b["written"]) <= 1.25 * sum(b["written"]) / 4
    assert b["stored"] == b["unique"]


def test_second_save_reuses_the_plan_with_constant_traffic(outcomes):
    c = outcomes[1]["plan_cache"]
    assert c["first"]["planning"] > 100 * c["second"]["planning"], c


def test_plan_cache_invalidation(outcomes):
    assert all(o["invalidation"]["world"] is False for o in outcomes)


def test_validation_messages_name_key_region_and_ranks(outcomes):
    for o in outcomes:
        m = o["validation"]
        assert "'extra'" in m["extra_key"] and "rank 0" in m["extra_key"] and \
            "ranks 1, 2, 3" in m["extra_key"], m["extra_key"]
        assert "'w'" in m["overlap"] and "overlap" in m["overlap"] and "[1:2, 0:2]" in m["overlap"] \
            and "rank 0" in m["overlap"] and "rank 1" in m["overlap"], m["overlap"]
        assert "'w'" in m["hole"] and "[1:2, 0:2]" in m["hole"] and "held by no rank" in m["hole"]
        assert "'a'" in m["dtype"] and "disagree" in m["dtype"] and "rank 3" in m["dtype"]
        assert "'a'" in m["shape"] and "rank 1" in m["shape"], m["shape"]
        assert "'d'" in m["dtensor_missing"] and "rank 2" in m["dtensor_missing"]
        assert "'rng'" in m["rng"] and "differs" in m["rng"] and "PerRank" in m["rng"]
        assert "'seed'" in m["seed"] and "rank 2" in m["seed"], m["seed"]
    rng = outcomes[0]["validation"]["rng"]  # the coordinator names the ranks that differ
    assert "rank(s) 1" in rng or "1, 2, 3" in rng or "rank 0" in rng, rng


def test_per_rank_state_round_trips(outcomes):
    assert all(o["per_rank"]["py_kind"] == "tuple" for o in outcomes)


def test_replicated_state_is_read_once_per_group(outcomes):
    x = outcomes[0]["exchange"]
    u = x["unique"]
    assert sum(x["exchange"]["read"]) == u, x["exchange"]
    assert all(0 < r < u for r in x["exchange"]["read"])  # the reading is shared
    assert sum(x["exchange"]["got"]) == 3 * u  # each rank received what it did not read
    assert sum(x["plain"]["read"]) == 4 * u and sum(x["plain"]["got"]) == 0


def test_object_stores_exchange_by_default(outcomes):
    x = outcomes[0]["exchange"]
    assert sum(x["default"]["read"]) == x["unique"]


def test_exchange_composes_with_pre_download(outcomes):
    x = outcomes[0]["exchange"]
    assert sum(x["pre_download"]) == x["unique"]


def test_dtensor_replicate_is_read_once_and_broadcast(outcomes):
    x = outcomes[0]["exchange"]["replicate"]
    assert sum(x["read"]) == x["bytes"] and sum(x["got"]) == 3 * x["bytes"], x


def test_2d_mesh_reads_each_row_block_once(outcomes):
    x = outcomes[0]["exchange"]
    n = x["mesh_bytes"]
    assert sum(x["rows"]["read"]) == n, x["rows"]
    assert sum(x["rows"]["got"]) == n  # the other rank of each pair received its half
    assert sum(x["columns"]["read"]) == n, x["columns"]
