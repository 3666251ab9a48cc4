"""Uneven shards and N -> M resharding on spawned gloo ranks (3 -> 2, 1 -> 2, 3 -> 1), every pair
in one save spawn and one load spawn (see reshard.py)."""

from __future__ import annotations

import pytest

import ckptfs
from ckptfs.testing.conformance import reshard
from ckptfs.testing.conformance.cases import assert_same, flatten, tiling_problems
from ckptfs.testing.conformance.pairs import Pair
from ckptfs.testing.conformance.workspace import ReshardRun, Workspace, require_writable


@pytest.fixture
def run(pair: Pair, usable_pairs: list[Pair], workspace: Workspace) -> ReshardRun:
    require_writable(pair)
    return workspace.reshard(usable_pairs)[pair]


def _fail_on(errors: dict[str, str]) -> None:
    if errors:
        pytest.fail("\n".join(f"{case}:\n{err}" for case, err in errors.items()), pytrace=False)


def test_save_uneven_shards(run: ReshardRun) -> None:
    _fail_on(run.errors("save", reshard.SAVE_WORLD))
    meta = ckptfs.load_metadata(run.url)
    tensors, values, _ = flatten(reshard.reference())
    assert set(meta.tensors) == set(tensors) and set(meta.values) == set(values)
    for key, entry in meta.tensors.items():  # by geometry: an overlap cannot hide a hole
        problems = tiling_problems(entry.shape, [(c.offsets, c.shape) for c in entry.chunks])
        assert not problems, f"{key}: chunks do not tile the tensor exactly once: {problems}"
    assert {c.offsets for c in meta.tensors["st_empty_rank"].chunks} >= {(0, 0)}


def test_reshard_save_world_to_load_world(run: ReshardRun) -> None:
    _fail_on(run.errors("save", reshard.SAVE_WORLD))
    errors = run.errors("load", reshard.LOAD_WORLD)
    _fail_on({k: v for k, v in errors.items() if "basic" not in k and "bytes read" not in k})


def test_resharded_load_reads_only_what_it_needs(run: ReshardRun) -> None:
    """3 -> 2 by columns of row chunks: bytes read <= needed + READ_SLACK_PER_CHUNK per chunk."""
    _fail_on(run.errors("save", reshard.SAVE_WORLD))
    errors = run.errors("load", reshard.LOAD_WORLD)
    _fail_on({k: v for k, v in errors.items() if "bytes read" in k or "never ran" in v})


def test_reshard_one_to_load_world(run: ReshardRun) -> None:
    errors = run.errors("load", reshard.LOAD_WORLD)
    _fail_on({k: v for k, v in errors.items() if "basic" in k or "never ran" in v})


def test_reshard_save_world_to_one(run: ReshardRun) -> None:
    _fail_on(run.errors("save", reshard.SAVE_WORLD))
    assert_same(ckptfs.load_keys(run.url), reshard.reference(), f"load_keys({run.url})")
