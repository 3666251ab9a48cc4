"""The read engine's schedule (engine/load/schedule.py ``schedule_reads``): what a load reads, in which
order and into which buffer, as a value built without I/O, then run against the real files."""

from __future__ import annotations

import pytest
import torch

import ckptfs
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.run import run_schedule
from ckptfs.engine.load.schedule import TensorRead, schedule_reads
from ckptfs.engine.memory.buffers import BufferPool
from ckptfs.io import open_store, run_sync
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import plan_reads


def _schedule(url, targets, *, budget=None, max_gap=0):
    """(schedule, runner) for filling ``targets`` (key -> (tensor, box)) from ``url``."""

    async def go():
        store = await open_store(str(url))
        index = await read_index(store)
        jobs = [TensorRead(index.tensors[k], t, tuple(plan_reads(index.tensors[k], box)))
                for k, (t, box) in targets.items()]
        backend = get_backend(index.backend, index.backend_version)(index.backend_options)
        sources = await backend.chunk_sources(
            [(j.entry, p.chunk) for j in jobs for p in j.pieces], store)
        return store, schedule_reads(jobs, sources, max_gap=max_gap, verify=True, budget=budget)

    store, schedule = run_sync(go())

    def run():
        async def go():
            try:
                await run_schedule(store, schedule, pool=BufferPool(limit=budget), verify=True)
            finally:
                await store.close()
        run_sync(go())

    return schedule, run


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    sd = {"w": torch.arange(48.0).reshape(6, 8), "b": torch.arange(10, dtype=torch.int32)}
    url = tmp_path_factory.mktemp("schedule") / "ck"
    ckptfs.save(sd, url)
    return url, sd


def test_contiguous_targets_take_no_scratch(saved):
    url, sd = saved
    targets = {k: (torch.zeros_like(v), full_box(tuple(v.shape))) for k, v in sd.items()}
    schedule, run = _schedule(url, targets)
    assert schedule.needed == 48 * 4 + 10 * 4
    assert [b.scratch for f in schedule.scratch for b in f.batches] == [0] * len(schedule.scratch)
    assert not schedule.small and not schedule.ring and not schedule.encoded
    assert {k for ks in schedule.keys.values() for k in ks} == {"w", "b"}
    run()
    for k, (t, _) in targets.items():
        assert torch.equal(t, sd[k])


def test_a_strided_target_is_read_through_scratch_of_its_region(saved):
    url, sd = saved
    box = Box((1, 2), (3, 4))  # rows 1..3, columns 2..5: 3 runs of 16 bytes
    target = torch.zeros(4, 3).t()  # non-contiguous
    schedule, run = _schedule(url, {"w": (target, box)})
    (f,) = schedule.scratch
    assert [b.scratch for b in f.batches] == [3 * 4 * 4]
    assert schedule.needed == 3 * 4 * 4
    run()
    assert torch.equal(target, sd["w"][1:4, 2:6])


def test_scratch_batches_fit_the_budget(saved):
    url, sd = saved
    targets = {"w": (torch.zeros(8, 6).t(), full_box((6, 8))),  # non-contiguous: 192 bytes
               "b": (torch.zeros(20, dtype=torch.int32)[::2], full_box((10,)))}  # 40 bytes
    whole, _ = _schedule(url, targets)
    cut, run = _schedule(url, targets, budget=64)
    assert len(whole.scratch) == 1, "both tensors are in one data file"
    assert [b.scratch for f in whole.scratch for b in f.batches] == [192 + 40]
    batches = [b for f in cut.scratch for b in f.batches]
    assert sorted(b.scratch for b in batches) == [40, 192]  # the oversized piece alone
    run()
    for k, (t, _) in targets.items():
        assert torch.equal(t, sd[k])


@pytest.mark.parametrize(("tensors", "groups"), [(70, [64, 6]), (63, [])])
def test_many_small_files_are_read_in_groups(tmp_path, tensors, groups):
    """zarr writes a file per array: at least 64 small files are read in groups of 64."""
    sd = {f"t{i:03d}": torch.full((4,), float(i)) for i in range(tensors)}
    ckptfs.save(sd, tmp_path / "ck", backend="zarr")
    targets = {k: (torch.zeros(4), full_box((4,))) for k in sd}
    schedule, run = _schedule(tmp_path / "ck", targets)
    assert [len(g) for g in schedule.small] == groups
    assert len(schedule.scratch) == (0 if groups else tensors)
    grouped = [f.path for g in schedule.small for f in g]
    assert len(set(grouped)) == len(grouped)
    run()
    for k, (t, _) in targets.items():
        assert torch.equal(t, sd[k])


#: modules a small load still enters more than 8 times (their bound, counted in the I/O loop's
#: threads too): per-tensor and per-chunk calls of the value helpers (boxes, dtypes, keys,
#: checksums), the store's base-class helpers its subclass calls in the worker threads, and
#: the I/O loop's trips
LOAD_ABOVE_EIGHT = {"ckptfs.layout.boxes": 30, "ckptfs.layout.dtypes": 15,
                    "ckptfs.io.store": 15, "ckptfs.layout.checksum": 12,
                    "ckptfs.layout.keys": 10, "ckptfs.io.loop": 9}


@pytest.mark.parametrize("resharded", [False, True], ids=["same-shapes", "resharded"])
def test_a_load_enters_the_read_module_at_most_six_times(tmp_path, resharded):
    """Following a small state dict through ``ckptfs.load`` (after a first load: imports warm),
    in the caller's thread, the I/O loop's and the worker threads (tests/test_pipeline.py's
    ``_module_entries`` says how entries are counted): the read module (the schedule and its
    run, counted as one: calls between them are not entries) is entered at most 6 times
    (docs/architecture.md); the schedule decides alone (no callbacks from the layers below into
    it) and a lone file or stream is awaited in place. No other module is entered more than 8
    times, but those of ``LOAD_ABOVE_EIGHT``, within their bound."""
    from tests.test_pipeline import _above_eight, _module_entries

    state = {"w": torch.randn(64, 64), "b": torch.zeros(64), "step": 3, "opt": {"m": torch.ones(8)}}
    ckptfs.save(state, tmp_path / "c")

    def target():
        w = (ckptfs.ShardedTensor(torch.zeros(32, 64), (64, 64), (16, 0)) if resharded
             else torch.zeros(64, 64))
        return {"w": w, "b": torch.ones(64), "step": 0, "opt": {"m": torch.zeros(8)}}

    ckptfs.load(target(), tmp_path / "c")
    sd = target()
    read = {"ckptfs.engine.load.schedule": "read", "ckptfs.engine.load.run": "read"}
    counts = _module_entries(lambda: ckptfs.load(sd, tmp_path / "c"), io_loop=True, one=read)
    assert 1 <= counts.get("read", 0) <= 6, counts
    assert _above_eight(counts, LOAD_ABOVE_EIGHT) == {}, counts
    got = sd["w"].local_tensor if resharded else sd["w"]
    assert torch.equal(got, state["w"][16:48] if resharded else state["w"])
