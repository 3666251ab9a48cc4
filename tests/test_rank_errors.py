"""Mismatches between ranks raise on every rank instead of hanging (2 spawned gloo ranks)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
from ckptfs.testing.ranks import RanksFailed, run_ranks

pytestmark = pytest.mark.slow  # every test spawns ranks


def expect_error(fn, *types) -> str:
    try:
        fn()
    except types as e:
        return str(e)
    raise AssertionError(f"no error raised, wanted {types}")


class PrepareFails(SafetensorsChunksBackend):
    """A backend whose coordinator-only hook fails (as a plugin's may)."""

    name = "prepare_fails"
    version = 1

    def prepare(self, plans):
        raise ckptfs.UnsupportedValueError("prepare_fails refuses the layout")


def _opens_unless_refused(request):
    """A local store, which the rank that ``storage_options["refuse"]`` names cannot open."""
    from ckptfs.io.local_store import LocalStore

    if request.storage_options.get("refuse") == dist.get_rank():
        raise ckptfs.ConfigError(f"rank {dist.get_rank()} cannot reach {request.url}")
    return LocalStore(request.path, request.options)


def scenarios(rank: int, world: int, root: str) -> None:
    other = ckptfs.RankError
    # 1. one rank holds an unstorable value: both raise, the culprit with its own error
    sd = {"a": torch.ones(2), "x": object() if rank == 1 else 1}
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/1"), ckptfs.UnsupportedValueError, other)
    assert "'x'" in msg

    # 2. ranks disagree about a tensor's shape
    sd = {"a": torch.ones(2 + rank)}
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/2"), ckptfs.ShardingError)
    assert "key 'a'" in msg and "disagree" in msg

    # 3. explicit shards that overlap
    sd = {"w": ckptfs.ShardedTensor(torch.ones(3, 2), (4, 2), (rank, 0))}
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/3"), ckptfs.ShardingError)
    assert "key 'w'" in msg and "overlap" in msg

    # 4. two holders of one shard claim the same replica id
    sd = {"w": ckptfs.ShardedTensor(torch.ones(2, 2), (2, 2), (0, 0), replica_id=0)}
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/4"), ckptfs.ShardingError)
    assert "replica_id 0" in msg

    # 5. pipeline-style: each rank holds different keys (a plain tensor would be a replica every
    # rank holds: a stage's own tensor is a whole-tensor ShardedTensor, or a DTensor on the
    # stage's mesh); replicas with distinct ids are fine
    own = torch.full((3,), float(rank))
    sd = {f"stage{rank}": {"w": ckptfs.ShardedTensor(own, (3,), (0,))},
          "shared": ckptfs.ShardedTensor(torch.ones(2, 2), (2, 2), (0, 0), replica_id=rank)}
    ckptfs.save(sd, f"{root}/5")
    target = {f"stage{rank}": {"w": torch.zeros(3)}, "shared": torch.zeros(2, 2)}
    res = ckptfs.load(target, f"{root}/5", strict=True)
    assert torch.equal(target[f"stage{rank}"]["w"], torch.full((3,), float(rank)))
    assert res.unexpected_keys == [f"stage{1 - rank}/w"]

    # 6. saving again without overwrite: refused on every rank, checkpoint intact
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/5"), ckptfs.CheckpointExistsError, other)
    assert "overwrite=True" in msg

    # 7. one rank's load target mismatches: both raise
    target = {"shared": torch.zeros(2, 2 + rank)}
    expect_error(lambda: ckptfs.load(target, f"{root}/5", strict=False), ckptfs.MismatchError, other)

    # 8. one rank misses a key under strict: both raise
    target = {"shared": torch.zeros(2, 2)} | ({"nope": torch.zeros(1)} if rank else {})
    expect_error(lambda: ckptfs.load(target, f"{root}/5"), ckptfs.MissingKeysError, other)

    # 9. the coordinator's backend fails while preparing the layout: every rank raises, none
    # waits for it (prepare runs inside the collective that decides the phase)
    ckptfs.register_backend("prepare_fails", 1, PrepareFails, replace=True)
    sd = {"w": ckptfs.ShardedTensor(torch.ones(1, 2), (2, 2), (rank, 0))}
    msg = expect_error(lambda: ckptfs.save(sd, f"{root}/9", backend="prepare_fails"),
                       ckptfs.UnsupportedValueError, other)
    assert "refuses the layout" in msg
    assert not os.path.exists(f"{root}/9/{ckptfs.INDEX_FILE}")

    # 10. a DTensor with a Partial placement (pending reduction) is refused, naming the key;
    # nothing is committed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    partial = DTensor.from_local(torch.ones(2, 2), mesh, [Partial()], run_check=False)
    msg = expect_error(lambda: ckptfs.save({"grad": partial}, f"{root}/10"),
                       ckptfs.UnsupportedValueError)
    assert "'grad'" in msg and "Partial" in msg
    assert not os.path.exists(f"{root}/10/{ckptfs.INDEX_FILE}")

    # 11. rank 1 cannot open the store while the coordinator claims the target in the same step:
    # both raise naming the step, the culprit with its own error; the lock the coordinator took
    # is given back, so the next save there goes ahead
    from ckptfs.io import register_store
    from ckptfs.layout.index import LOCK_FILE

    register_store("refusing", _opens_unless_refused, replace=True)
    url, sd = f"refusing://{root}/11", {"w": torch.ones(2)}
    msg = expect_error(lambda: ckptfs.save(sd, url, storage_options={"refuse": 1}),
                       ckptfs.ConfigError, other)
    assert ("cannot reach" if rank else "opening the store and checking the target") in msg
    dist.barrier()  # both ranks have failed: the coordinator has given the lock back
    assert not os.path.exists(f"{root}/11/{LOCK_FILE}")
    ckptfs.save(sd, url)
    assert os.path.exists(f"{root}/11/{ckptfs.INDEX_FILE}")

    # 12. after all that, collectives are still in step
    t = torch.tensor([rank])
    dist.all_reduce(t)
    assert t.item() == 1


@pytest.mark.timeout(180)
@pytest.mark.pooled_ranks
def test_rank_mismatches_raise_everywhere(tmp_path):
    run_ranks(2, scenarios, str(tmp_path))


def subgroups(rank: int, world: int, root: str) -> None:
    # two independent groups checkpoint at the same time; group ranks, not global ranks, plan
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    g = rank // 2
    local = torch.full((2, 3), float(rank))
    sd = {"w": ckptfs.ShardedTensor(local, (4, 3), ((rank % 2) * 2, 0)), "g": g}
    res = ckptfs.save(sd, f"{root}/group{g}", process_group=mine)
    assert res.total_bytes > 4 * 3 * 4  # data plus safetensors headers
    target = {"w": torch.zeros(4, 3), "g": -1}
    ckptfs.load(target, f"{root}/group{g}", process_group=mine)
    want = torch.cat([torch.full((2, 3), float(2 * g)), torch.full((2, 3), float(2 * g + 1))])
    assert torch.equal(target["w"], want) and target["g"] == g


@pytest.mark.timeout(180)
@pytest.mark.pooled_ranks
def test_independent_process_groups(tmp_path):
    run_ranks(4, subgroups, str(tmp_path))


def _rank_one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 broke on purpose")
    dist.barrier()  # rank 0 would wait here for ever: the harness must kill it


def test_harness_reports_a_failed_rank_and_stops_the_others():
    with pytest.raises(RanksFailed, match=r"(?s)rank1\.err.*ValueError: rank 1 broke on purpose"):
        run_ranks(2, _rank_one_fails, timeout=120)
