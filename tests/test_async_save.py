"""``ckptfs.async_save`` on 2 spawned gloo ranks (one spawn, every case in turn): snapshot
semantics, errors from one rank on every rank, one save in flight, staging buffer reuse with
flat RSS, the caller's collectives running while the background save runs, subgroups. Then one
plain subprocess that exits with a save in flight."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.dist import Comm
from ckptfs.engine.background import defaults
from ckptfs.layout.backends.safetensors_chunks import SafetensorsChunksBackend
from ckptfs.layout.registry import register_backend
from ckptfs.testing.ranks import run_ranks
from tests.scenarios import outcomes_of, passed, run_steps

RSS_STATE_MB = 48  #: per rank; the claim is proportional: growth < 5% of the state


class FailingOnRank1(SafetensorsChunksBackend):
    """Writes like safetensors_chunks, except that rank 1's storage fails."""

    name = "test_failing_rank1"

    def write_rank(self, job):
        if job.rank == 1:
            raise OSError("rank 1's disk is full")
        return super().write_rank(job)


class FailingInCommit(SafetensorsChunksBackend):
    """Writes like safetensors_chunks; the coordinator's commit fails (after every rank wrote)."""

    name = "test_failing_commit"

    def finalize(self, index, plans):
        raise OSError("rank 0 lost the store while committing")


class PausingInCommit(SafetensorsChunksBackend):
    """Writes like safetensors_chunks; the coordinator's commit waits (inside the commit's
    collective, while the other ranks wait in it) until the foreground lets it go on. It waits
    while building the index, in the save's thread (``finalize`` runs on the I/O loop, which
    the foreground's load needs too)."""

    name = "test_pausing_commit"
    in_commit = threading.Event()
    go_on = threading.Event()

    def index_options(self):
        PausingInCommit.in_commit.set()
        if not PausingInCommit.go_on.wait(60):
            raise TimeoutError("the foreground never let the commit go on")
        return super().index_options()



@contextlib.contextmanager
def spied_copies():
    """engine/memory/copies.py's piece copies, each slowed a little (so that every thread gets some)
    and recording the threads that ran them: yields that set of names (the callers pick small
    pieces with ``SaveOptions.copy_piece`` or ``copy_all``'s ``piece``)."""
    from ckptfs.engine.memory import copies

    real = copies._copy
    by: set[str] = set()

    def spy(buf, src):
        by.add(threading.current_thread().name)
        time.sleep(0.002)
        real(buf, src)

    copies._copy = spy
    try:
        yield by
    finally:
        copies._copy = real


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def state(rank: int, value: float, rows: int = 64) -> dict:
    """A row-sharded weight, a replicated bias, nested optimizer-like state and a value."""
    def shard(t: torch.Tensor) -> ckptfs.ShardedTensor:
        return ckptfs.ShardedTensor(t, (2 * rows, 16), (rank * rows, 0))

    want = expected(rank, value, rows)
    return {"w": shard(want["w"]), "b": torch.arange(8, dtype=torch.float64) * value,
            "opt": {"state": {0: {"exp_avg": shard(want["opt"]["state"][0]["exp_avg"])}}},
            "step": int(value)}


def expected(rank: int, value: float, rows: int = 64) -> dict:
    return {"w": torch.full((rows, 16), value) + rank,
            "opt": {"state": {0: {"exp_avg": torch.full((rows, 16), value + rank + 0.5)}}}}


def check_loads(rank: int, url: str, value: float) -> None:
    target = state(rank, 0.0)
    ckptfs.load(target, url)
    want = expected(rank, value)
    assert torch.equal(target["w"].local_tensor, want["w"])
    assert torch.equal(target["opt"]["state"][0]["exp_avg"].local_tensor, want["opt"]["state"][0]["exp_avg"])
    assert torch.equal(target["b"], torch.arange(8, dtype=torch.float64) * value)
    assert target["step"] == int(value)


INDEX = ckptfs.INDEX_FILE


def snapshot(rank: int, world: int, root: str) -> None:
    """Values changed after `staged` do not leak into the checkpoint."""
    sd = state(rank, 1.0)
    h = ckptfs.async_save(sd, f"{root}/snap")
    assert isinstance(h, ckptfs.AsyncSave)
    h.wait_staged(timeout=60)
    for t in (sd["w"].local_tensor, sd["b"], sd["opt"]["state"][0]["exp_avg"].local_tensor):
        t.fill_(-5.0)
    res = h.result(timeout=60)
    assert res.url == f"{root}/snap" and res.bytes_written > 0
    check_loads(rank, f"{root}/snap", 1.0)
    # staging holds what this rank writes: its shards, and the replicated bias on one rank only
    per_rank = [0] * world
    dist.all_gather_object(per_rank, defaults.default_saver().staging_pool().allocator.cached_bytes)
    shards = 2 * 64 * 16 * 4  # w and exp_avg: 64 x 16 fp32 per rank
    assert sorted(per_rank) == [shards, shards + 8 * 8], per_rank


def staging_failure(rank: int, world: int, root: str) -> None:
    """A staging failure on rank 1 resolves `staged` and `done` on both ranks; nothing written."""
    bad = state(rank, 2.0) | ({"x": object()} if rank == 1 else {})
    h = ckptfs.async_save(bad, f"{root}/stagefail")
    err = h.staged.exception(timeout=60)
    want = ckptfs.UnsupportedValueError if rank == 1 else ckptfs.RankError
    assert isinstance(err, want), repr(err)
    assert "'x'" in str(err)
    assert isinstance(h.done.exception(timeout=60), want)
    assert not os.path.exists(f"{root}/stagefail/{INDEX}")


def write_failure(rank: int, world: int, root: str) -> None:
    """A write failure on rank 1: `staged` succeeded, `done` fails on every rank, no index is
    written and the previous checkpoint is untouched."""
    register_backend(FailingOnRank1.name, 1, FailingOnRank1, replace=True)
    ckptfs.async_save(state(rank, 3.0), f"{root}/step3").result(timeout=60)
    h = ckptfs.async_save(state(rank, 4.0), f"{root}/step4", backend=FailingOnRank1.name)
    h.wait_staged(timeout=60)
    err = h.done.exception(timeout=60)
    if rank == 1:
        assert isinstance(err, ckptfs.StorageError) and "disk is full" in str(err), repr(err)
    else:
        assert isinstance(err, ckptfs.RankError) and "disk is full" in str(err), repr(err)
    assert not os.path.exists(f"{root}/step4/{INDEX}")
    check_loads(rank, f"{root}/step3", 3.0)
    # the same for a failure in rank 0's commit, once every rank has written its data
    register_backend(FailingInCommit.name, 1, FailingInCommit, replace=True)
    h = ckptfs.async_save(state(rank, 4.5), f"{root}/step4b", backend=FailingInCommit.name)
    err = h.done.exception(timeout=60)
    want = ckptfs.StorageError if rank == 0 else ckptfs.RankError
    assert isinstance(err, want) and "committing" in str(err), repr(err)
    assert h.staged.exception() is None
    assert not os.path.exists(f"{root}/step4b/{INDEX}")
    check_loads(rank, f"{root}/step3", 3.0)


def one_save_in_flight(rank: int, world: int, root: str) -> None:
    """One save in flight: a second async_save returns only after the first is done, and save()
    starts reading its state dict only after the async save in flight is done."""
    h1 = ckptfs.async_save(state(rank, 5.0, rows=4096), f"{root}/first")
    h2 = ckptfs.async_save(state(rank, 6.0), f"{root}/second")
    assert h1.done.done(), "async_save started while another save was in flight"
    seen: list[bool] = []

    class Probe(dict):
        def items(self):
            seen.append(h2.done.done())
            return super().items()

    ckptfs.save(Probe(state(rank, 7.0)), f"{root}/third")
    assert seen and all(seen), "save() started while an async save was in flight"
    check_loads(rank, f"{root}/second", 6.0)
    check_loads(rank, f"{root}/third", 7.0)


def foreground_collectives(rank: int, world: int, root: str) -> None:
    """The caller's collectives on the default group, and a ckptfs.load, run while the background
    save sits in its commit collective (rank 0 paused inside it, rank 1 waiting; on a shared group
    this hangs). First: the background's group is gloo, neither the caller's nor ckptfs's foreground
    group (a ckptfs.load runs on that)."""
    bg = Comm(None, background=True).group
    assert bg is not None and bg is not dist.group.WORLD, "the background shares the caller's group"
    assert bg is not Comm(None).group, "the background shares ckptfs's foreground group"
    assert dist.get_backend(bg) == "gloo" and dist.get_process_group_ranks(bg) == [0, 1]
    register_backend(PausingInCommit.name, 1, PausingInCommit, replace=True)
    h = ckptfs.async_save(state(rank, 8.0), f"{root}/fg", backend=PausingInCommit.name)
    if rank == 0:
        assert PausingInCommit.in_commit.wait(60), "the background save never reached its commit"
    else:  # rank 1's background save reaches its commit collective meanwhile: on a shared
        time.sleep(1.0)  # group, the foreground's first collective would be matched with it
    dist.barrier()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == 3.0
    ranks = [None] * world
    dist.all_gather_object(ranks, rank)
    assert ranks == [0, 1]
    check_loads(rank, f"{root}/snap", 1.0)  # ckptfs's own foreground collectives
    assert not h.done.done(), "the commit went on before the foreground let it"
    dist.barrier()
    if rank == 0:
        PausingInCommit.go_on.set()
    h.result(timeout=60)
    check_loads(rank, f"{root}/fg", 8.0)


def buffer_reuse(rank: int, world: int, root: str) -> None:
    """Buffer reuse: 10 saves of the same structure allocate once, RSS stays flat."""
    rows = RSS_STATE_MB * 2**20 // (3 * 4 * 16 * 2)  # w + exp_avg (rows x 16 fp32) ~ state / 3
    big = {f"layer{i}": state(rank, 9.0, rows=rows) for i in range(3)}
    mine = sum(t.numel() * t.element_size() for lay in big.values()
               for t in (lay["w"].local_tensor, lay["opt"]["state"][0]["exp_avg"].local_tensor))
    alloc = defaults.default_saver().staging_pool().allocator
    fast = ckptfs.StoreOptions(fsync=False)
    sizes = []
    for i in range(10):
        ckptfs.async_save(big, f"{root}/rss", overwrite=True, store_options=fast).result(timeout=60)
        if i == 0:
            first_rss, first_allocs = rss(), alloc.allocations
        sizes.append(alloc.cached_bytes)
    growth = rss() - first_rss
    assert alloc.allocations == first_allocs, "later saves of the same structure allocated"
    assert min(sizes) == max(sizes) >= mine, sizes
    assert growth < 0.05 * mine, f"RSS grew {growth / 2**20:.1f} MiB over 9 saves of {mine / 2**20:.0f} MiB"
    ckptfs.close()
    assert alloc.cached_bytes == 0


def threaded_copies(rank: int, world: int, root: str) -> None:
    """Staging copies on several threads (pieces of 4 KiB here, so that small tensors are cut) give
    bit-exact checkpoints: DTensor shards (rows and columns), bf16, a non-contiguous replicated
    tensor whose slices the ranks share; values changed after `staged` stay out."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with spied_copies() as by:
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(8)  # the same on both ranks: replicas agree
        full = {"rows": torch.randn(96, 80, generator=g),
                "cols": torch.randn(40, 96, generator=g).to(torch.bfloat16),
                "t": torch.randn(80, 72, generator=g).t(), "small": torch.randn(3, generator=g)}
        sd = {"rows": DTensor.from_local(full["rows"].chunk(world)[rank].clone(), mesh, [Shard(0)]),
              "cols": DTensor.from_local(full["cols"].chunk(world, 1)[rank].clone(), mesh,
                                         [Shard(1)]),
              "t": full["t"].clone().t().contiguous().t(), "small": full["small"].clone()}
        assert not sd["t"].is_contiguous()
        h = ckptfs.async_save(sd, f"{root}/threads",
                              options=ckptfs.SaveOptions(copy_threads=3, copy_piece=4096))
        h.wait_staged(timeout=60)
        for t in (sd["rows"].to_local(), sd["cols"].to_local(), sd["t"], sd["small"]):
            t.fill_(7.0)
        h.result(timeout=60)
    assert any(n.startswith("ckptfsCopy") for n in by), f"the copies ran on {by} only"
    target = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in full.items()}
    ckptfs.load(target, f"{root}/threads")
    for k, v in full.items():
        assert torch.equal(target[k].view(torch.uint8), v.contiguous().view(torch.uint8)), k


def subgroup(rank: int, world: int, root: str) -> None:
    """A subgroup's background group is created by that subgroup's members alone."""
    groups = [dist.new_group([0]), dist.new_group([1])]
    sd = {"v": torch.full((4,), float(rank))}
    ckptfs.async_save(sd, f"{root}/sub{rank}", process_group=groups[rank]).result(timeout=60)
    target = {"v": torch.zeros(4)}
    ckptfs.load(target, f"{root}/sub{rank}", process_group=groups[rank])
    assert torch.equal(target["v"], torch.full((4,), float(rank)))


#: the scenario's steps, in the order they run on the ranks (later steps load earlier ones'
#: checkpoints: ``foreground_collectives`` loads ``snapshot``'s)
STEPS = (snapshot, staging_failure, write_failure, one_save_in_flight, foreground_collectives,
         buffer_reuse, threaded_copies, subgroup)


def scenarios(rank: int, world: int, root: str, out: str) -> None:
    """Every step in turn on every rank (tests/scenarios.py)."""
    run_steps(STEPS, rank, out, rank, world, root)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[str | None]]:
    """One spawn of 2 ranks for every step: per step, each rank's traceback or None."""
    root = tmp_path_factory.mktemp("async_save")
    out = root / "out"
    out.mkdir()
    run_ranks(2, scenarios, str(root / "ck"), str(out), timeout=200)
    return outcomes_of(out, STEPS, 2)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_values_changed_after_staged_stay_out(outcomes):
    passed(outcomes, snapshot)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_staging_failure_on_one_rank_fails_every_rank(outcomes):
    passed(outcomes, staging_failure)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_write_and_commit_failures_leave_the_previous_checkpoint(outcomes):
    passed(outcomes, write_failure)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_save_in_flight(outcomes):
    passed(outcomes, one_save_in_flight)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_callers_collectives_run_beside_the_background_commit(outcomes):
    passed(outcomes, foreground_collectives)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_staging_buffers_are_reused_and_rss_stays_flat(outcomes):
    passed(outcomes, buffer_reuse)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_threaded_staging_copies_are_bit_exact(outcomes):
    passed(outcomes, threaded_copies)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_subgroups_background_group_needs_only_its_members(outcomes):
    passed(outcomes, subgroup)


EXIT_SCRIPT = """
import sys, torch, ckptfs
sd = {"w": torch.full((8192, 1024), 3.0)}  # 32 MiB
h = ckptfs.async_save(sd, sys.argv[1])
h.wait_staged()
sd["w"].zero_()
print("in flight at exit:", not h.done.done())
"""


@pytest.mark.slow  # a subprocess that saves
def test_exit_waits_for_the_save_in_flight(tmp_path):
    url = str(tmp_path / "ckpt")
    out = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, url], check=True, timeout=120,
                         capture_output=True, text=True).stdout
    assert "in flight at exit: True" in out, out
    target = {"w": torch.zeros(8192, 1024)}
    ckptfs.load(target, url)
    assert torch.equal(target["w"], torch.full((8192, 1024), 3.0))


def test_threaded_copies_are_bit_exact(monkeypatch):
    """copies.copy_all on 3 threads: every byte of contiguous, bf16, non-contiguous, empty and
    0-dim sources lands in its buffer; the helpers take part; a failing piece raises."""
    from ckptfs.engine.memory import copies

    real_copy = copies._copy
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(1000, 33, generator=g), torch.randn(77, 129, generator=g).bfloat16(),
            torch.randn(300, 50, generator=g).t(), torch.randn(50, 40, 9, generator=g)[:, ::2],
            torch.randn(5, generator=g), torch.tensor(3.5), torch.empty(0, 4),
            torch.randint(0, 255, (40001,), dtype=torch.uint8, generator=g)]
    bufs = [torch.full(s.shape, -1).to(s.dtype) for s in srcs]
    with spied_copies() as by:
        copies.copy_all(list(zip(bufs, srcs, strict=True)), 3, 4096)
    for b, s in zip(bufs, srcs, strict=True):
        assert torch.equal(b.reshape(-1).view(torch.uint8), s.reshape(-1).view(torch.uint8))
    assert len(by) >= 2, f"the copies ran on {by} only"

    def broken(buf, src):
        if src.data_ptr() == srcs[0].data_ptr() + 8192:
            raise RuntimeError("piece at byte 8192 failed")
        real_copy(buf, src)

    monkeypatch.setattr(copies, "_copy", broken)
    with pytest.raises(RuntimeError, match="byte 8192"):
        copies.copy_all(list(zip(bufs, srcs, strict=True)), 3, 4096)


def test_yielding_checksum_equals_one_shot(monkeypatch):
    """The background write's checksum (libcrc32c without the GIL, or pieces with the GIL
    offered between them where that library is missing) is the same crc32c; and the GIL-free
    call is there on this platform (the wheel ships libcrc32c): without it a background save
    stalls the training loop for every MiB it checksums."""
    import numpy as np

    from ckptfs.layout import checksum as cs

    assert cs._extend_nogil is not None, "google_crc32c's libcrc32c not found"
    sizes = (0, 5, cs.PIECE, cs.PIECE + 1, 3 * cs.PIECE + 17)
    datas = [np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8) for n in sizes]
    for data in datas:
        assert cs.checksum(data, yielding=True) == cs.checksum(data.tobytes())
        assert cs.checksum(data[1:], yielding=True) == cs.checksum(data[1:].tobytes())
    monkeypatch.setattr(cs, "_extend_nogil", None)  # the fallback: pieces
    for data in datas:
        assert cs.checksum(data, yielding=True) == cs.checksum(data.tobytes())


def test_async_save_model_and_optim_state(tmp_path):
    """The model+optimizer helper in the background (one process): the checkpoint holds the
    parameters and optimizer state at the call, not the ones after the step that follows."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    h = ckptfs.async_save_model_and_optim_state(tmp_path / "ck", model, opt)
    h.wait_staged()
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # changes the parameters and the optimizer state under the running save
    h.result()
    ckptfs.load_model_and_optim_state(tmp_path / "ck", model, opt)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert opt.state_dict()["state"][0]["step"].item() == 1


def test_staging_pool_follows_the_allocator_kind():
    """The staging cache is kept for saves needing the same kind of memory (pageable, or pinned
    for CUDA sources) and dropped, with its buffers, when the kind changes: a CPU-only save
    after a CUDA one must not stage into the old pinned buffers, nor keep them. Another
    allocator class stands in for the pinned one (CPU-only torch cannot pin)."""
    from ckptfs.engine.memory.buffers import HostAllocator
    from ckptfs.io import run_sync

    class Other(HostAllocator):
        pass

    async def cycle(pool, n):
        await pool.release(await pool.lease(n))

    host = defaults.default_saver().staging_pool(HostAllocator())
    assert defaults.default_saver().staging_pool(HostAllocator()) is host  # same kind: the same cache
    host.allocator.clear()  # what earlier saves in this process left there
    run_sync(cycle(host, 4096))
    assert host.allocator.cached_bytes == 4096
    other = defaults.default_saver().staging_pool(Other())
    assert other is not host and type(other.allocator.inner) is Other
    assert host.allocator.cached_bytes == 0, "the old kind's buffers were kept"
    assert defaults.default_saver().staging_pool() is other  # no kind asked: the pool as it is
    defaults.default_saver().staging_pool(HostAllocator())  # leave the process's pool as the others expect


def test_background_writes_run_at_background_nice(tmp_path, monkeypatch):
    """``SaveOptions.background_nice``: an asynchronous save's data files are written, and its
    checksums computed, by threads of that nice value (Linux nice is per thread), a
    synchronous save's at the caller's, whose own nice never changes; both checkpoints load.
    Out-of-range values are refused naming the field."""
    from ckptfs.engine.save import write as write_engine
    from ckptfs.io import local_store

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice is Linux's")
    with pytest.raises(ckptfs.CkptfsError, match="background_nice"):
        ckptfs.SaveOptions(background_nice=20)
    seen: list[tuple[str, int]] = []
    real = local_store._write_all

    def spy(fd, bufs):
        seen.append((threading.current_thread().name,
                     os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        return real(fd, bufs)

    monkeypatch.setattr(local_store, "_write_all", spy)
    sums: list[int] = []
    real_crcs = write_engine.crcs_of

    def crcs_spy(buffers, **kw):
        sums.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_crcs(buffers, **kw)

    monkeypatch.setattr(write_engine, "crcs_of", crcs_spy)
    sd = {"w": torch.randn(256, 64), "b": torch.arange(10.0)}
    base = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = ckptfs.SaveOptions(background_nice=min(19, base + 7))
    ckptfs.async_save(sd, tmp_path / "bg", options=cfg).result()
    bg, seen[:], bg_sums, sums[:] = list(seen), [], list(sums), []
    ckptfs.save(sd, tmp_path / "fg", options=cfg)
    assert bg and all(n == cfg.background_nice for _, n in bg), bg
    assert bg_sums and all(n == cfg.background_nice for n in bg_sums), bg_sums
    assert seen and all(n == base for _, n in seen), seen
    assert sums and all(n == base for n in sums), sums
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    seen[:], sums[:] = [], []
    mgr = ckptfs.CheckpointManager(tmp_path / "mgr", ckptfs.ManagerOptions(save=cfg, preemption=ckptfs.PreemptionPolicy(signals=())))
    mgr.save(1, sd).done.result()  # the manager's background saves run niced too
    assert seen and all(n == cfg.background_nice for _, n in seen), seen
    assert sums and all(n == cfg.background_nice for n in sums), sums
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    mgr.close()
    for name in ("bg", "fg"):
        out = {"w": torch.zeros(256, 64), "b": torch.zeros(10)}
        ckptfs.load(out, tmp_path / name)
        assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_bounded_saves_overflow_is_copied_and_written_at_the_callers_priority(tmp_path,
                                                                               monkeypatch):
    """Under ``host_memory_limit`` the chunks beyond the bound are copied while their file is
    written, and ``staged`` waits for those copies: that file is written, and the pieces
    copied, at the caller's nice value, not ``background_nice``; the others are niced."""
    from ckptfs.engine.memory import overflow
    from ckptfs.io import local_store
    from ckptfs.io.streamed import StreamedPart

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice is Linux's")

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    files: list[tuple[bool, int]] = []
    copies: list[int] = []
    real_file, real_copy = local_store.LocalStore._write_file, overflow.copy_piece

    def file_spy(self, full, parts):
        files.append((any(isinstance(p, StreamedPart) for p in parts), nice()))
        return real_file(self, full, parts)

    def copy_spy(dst, src):
        copies.append(nice())
        return real_copy(dst, src)

    monkeypatch.setattr(local_store.LocalStore, "_write_file", file_spy)
    monkeypatch.setattr(overflow, "copy_piece", copy_spy)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    cfg = ckptfs.SaveOptions(background_nice=min(19, base + 7))
    sd = {"a": torch.randn(64, 64), "w": torch.randn(256, 256)}  # 16 KiB staged, 256 KiB not
    ckptfs.async_save(sd, tmp_path / "ck", options=cfg, host_memory_limit=96 << 10).result()
    assert copies and set(copies) == {base}, copies
    assert {n for streamed, n in files if streamed} == {base}, files
    assert {n for streamed, n in files if not streamed} <= {cfg.background_nice}, files
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    ckptfs.load(out, tmp_path / "ck")
    assert all(torch.equal(out[k], sd[k]) for k in sd)


def test_a_files_chunks_checksummed_as_written_keep_the_background_priority(tmp_path, monkeypatch):
    """A chunk of 1 MiB or more is checksummed slice by slice while its file is written
    (engine/save/checked_parts.py); its bytes are staged already, so that file is written at
    ``background_nice`` like every other, not at the caller's priority."""
    from ckptfs.engine.save.checked_parts import CheckedPart
    from ckptfs.io import local_store

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice is Linux's")
    files: list[tuple[bool, int]] = []
    real_file = local_store.LocalStore._write_file

    def file_spy(self, full, parts):
        nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        files.append((any(isinstance(p, CheckedPart) for p in parts), nice))
        return real_file(self, full, parts)

    monkeypatch.setattr(local_store.LocalStore, "_write_file", file_spy)
    cfg = ckptfs.SaveOptions(background_nice=min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7))
    sd = {"w": torch.randn(1024, 1024)}  # 4 MiB: checksummed while written
    ckptfs.async_save(sd, tmp_path / "ck", options=cfg).result()
    assert any(checked for checked, _ in files), files
    assert {n for checked, n in files if checked} == {cfg.background_nice}, files
    out = {"w": torch.zeros(1024, 1024)}
    ckptfs.load(out, tmp_path / "ck")
    assert torch.equal(out["w"], sd["w"])
