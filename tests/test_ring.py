"""The pinned ring of loads into CUDA targets (engine/memory/ring.py), the allocator choice and the GDS
fall-back, on CPU: the ring runs with a stand-in copier that copies late in a worker thread, as
a DMA engine would, so a buffer reused before its copy completed corrupts the target. The CUDA
copier itself is tested in tests/test_gpu.py (GPU machines only)."""

from __future__ import annotations

import asyncio
import threading
import time
import warnings

import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.engine.index_io import read_index
from ckptfs.engine.load.gds import GdsFallbackWarning, gds_reader, gds_unavailable
from ckptfs.engine.load.run import execute_reads
from ckptfs.engine.load.schedule import TensorRead, split_piece
from ckptfs.engine.memory.buffers import (
    BufferAllocator,
    BufferPool,
    HostAllocator,
    PinnedAllocator,
    allocator_for,
)
from ckptfs.engine.memory.ring import Ring, cuda_ring
from ckptfs.engine.save.stage import staging_allocator
from ckptfs.errors import ConfigError, IntegrityError
from ckptfs.io import open_store
from ckptfs.layout.boxes import Box, full_box
from ckptfs.layout.registry import get_backend
from ckptfs.planning.load_plan import ReadPiece, plan_reads
from tests.copiers import LateCopier


class Gate:
    """A completion that the test opens; the copy runs when it is opened (late, like a DMA)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor, fail: bool = False) -> None:
        self.dst, self.src, self.fail = dst, src, fail
        self.opened = threading.Event()

    def open(self) -> None:
        if not self.fail:
            self.dst.copy_(self.src)
        self.opened.set()

    def wait(self) -> None:
        if not self.opened.wait(5):  # a broken ring must fail the test, not hang it
            raise TimeoutError("the test never opened this copy")
        if self.fail:
            raise RuntimeError("stand-in copy failed")


class Counting(BufferAllocator):
    def __init__(self) -> None:
        self.allocated = 0

    def allocate(self, nbytes: int) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8)


async def test_a_buffer_is_reused_only_after_its_copy_completed():
    gates: list[Gate] = []

    def copier(dst, src):
        gates.append(Gate(dst, src))
        return gates[-1]

    alloc = Counting()
    ring = Ring(BufferPool(alloc, limit=32), copier, slots=2, slot_bytes=16, device_type="cpu")
    dsts = [torch.zeros(16, dtype=torch.uint8) for _ in range(3)]
    for i in range(2):  # both slots filled, their copies pending
        lease = await ring.lease(16)
        lease.tensor.fill_(i + 1)
        await ring.release(lease, [ring.copier(dsts[i], lease.tensor)])
    third = asyncio.create_task(ring.lease(16))
    await asyncio.sleep(0.05)
    assert not third.done()  # the ring is full: no third buffer, no reuse of a busy one
    threading.Thread(target=gates[0].open).start()
    lease = await asyncio.wait_for(third, 5)
    assert lease.tensor.data_ptr() == gates[0].src.data_ptr()  # slot 0, once its copy completed
    lease.tensor.fill_(3)
    await ring.release(lease, [ring.copier(dsts[2], lease.tensor)])
    for g in gates[1:]:
        g.open()
    await ring.close()
    for i, d in enumerate(dsts):
        assert d.tolist() == [i + 1] * 16  # each copy saw its own bytes
    assert (alloc.allocated, ring.pool.peak, ring.pool.budget.used) == (2, 32, 0)
    assert ring.reuses == 1


async def test_a_failed_copy_surfaces_and_releases_the_buffers():
    gates: list[Gate] = []

    def copier(dst, src):
        gates.append(Gate(dst, src, fail=not gates))
        return gates[-1]

    ring = Ring(BufferPool(limit=32), copier, slots=2, slot_bytes=16, device_type="cpu")
    for _ in range(2):
        lease = await ring.lease(8)
        await ring.release(lease, [ring.copier(torch.empty(8, dtype=torch.uint8), lease.tensor)])
    for g in gates:
        g.open()
    await asyncio.sleep(0.05)
    with pytest.raises(RuntimeError, match="stand-in copy failed"):
        await ring.lease(8)  # the next lease already sees it
    with pytest.raises(RuntimeError, match="stand-in copy failed"):
        await ring.close()
    assert ring.pool.budget.used == 0
    with pytest.raises(ValueError, match="do not fit a ring slot"):
        await Ring(BufferPool(), copier, slots=1, slot_bytes=4, device_type="cpu").lease(5)


def test_split_piece_follows_the_region_c_order_within_the_limit():
    chunk = type("C", (), {"shape": (6, 5, 4)})()
    src = Box((1, 0, 1), (4, 5, 3))
    piece = ReadPiece(chunk, src, Box((10, 0, 0), (4, 5, 3)))
    region = np.arange(6 * 5 * 4).reshape(6, 5, 4)[1:5, 0:5, 1:4]
    for limit in (4, 8, 12, 20, 40, 1000):
        parts = split_piece(piece, 4, limit)
        assert all(p.src.volume * 4 <= limit for p in parts)
        got = np.concatenate([np.arange(6 * 5 * 4).reshape(6, 5, 4)[p.src.slices()].reshape(-1)
                              for p in parts])
        assert got.tolist() == region.reshape(-1).tolist()  # C order of the region, no overlap
        for p in parts:  # dst moves with src
            assert tuple(a - b for a, b in zip(p.dst.offsets, p.src.offsets, strict=True)) == (9, 0, -1)
    assert len(split_piece(piece, 4, 1000)) == 1
    with pytest.raises(ValueError, match="one element"):
        split_piece(piece, 4, 3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    sd = {"w": torch.randn(16, 24, generator=g), "b": torch.randn(40, generator=g).to(torch.bfloat16),
          "e": torch.randint(0, 100, (3, 2, 5), generator=g)}
    url = tmp_path_factory.mktemp("ring") / "ckpt"
    ckptfs.save(sd, url)
    return url, sd


async def _load(url, targets, ring, *, verify=True):
    """Fill ``targets`` (key -> (tensor, box)) through ``ring``; returns the scratch pool."""
    store = await open_store(str(url))
    pool = BufferPool(limit=1 << 20)
    try:
        index = await read_index(store)
        jobs = [TensorRead(index.tensors[k], t, tuple(plan_reads(index.tensors[k], box)))
                for k, (t, box) in targets.items()]
        backend = get_backend(index.backend, index.backend_version)(index.backend_options)
        try:
            await execute_reads(store, backend, jobs, pool=pool, verify=verify, ring=ring)
        finally:
            await ring.close(quiet=True)
        await ring.close()
    finally:
        await store.close()
    return pool


def _targets(sd):
    box = Box((3, 5), (7, 9))  # a local shard: rows 3..9, columns 5..13
    return {"w": (torch.zeros(9, 7).t(), box),  # non-contiguous (transposed) target
            "b": (torch.zeros(40, dtype=torch.bfloat16), full_box((40,))),
            "e": (torch.zeros(3, 5, 2, dtype=torch.int64).transpose(1, 2), full_box((3, 2, 5)))}


async def test_load_through_the_ring_is_bit_exact_within_the_ring(saved):
    url, sd = saved
    copier = LateCopier()
    # 128-byte slots: parts of several runs (3 rows of w's shard) and chunks cut in parts (e)
    ring = Ring(BufferPool(limit=2 * 128), copier, slots=2, slot_bytes=128, device_type="cpu")
    targets = _targets(sd)
    slots: set[int] = set()
    copier.seen = lambda: slots.update(b.data_ptr() for b in ring.buffers)
    pool = await _load(url, targets, ring)
    for k, (t, box) in targets.items():
        assert torch.equal(t, sd[k][box.slices()]), k
    assert pool.peak == 0  # nothing went through pageable scratch
    assert ring.pool.peak == 256 and ring.reuses > 0  # peak = the ring, reused
    # every copy came straight out of a ring buffer, contiguous: no host copy of a region
    assert copier.given and all(s.is_contiguous() and s.numel() * s.element_size() <= 128
                                for s in copier.given)
    wanted = sum(box.volume * t.element_size() for t, box in targets.values())
    assert sum(s.numel() * s.element_size() for s in copier.given) == wanted  # every byte
    assert all(any(a <= s.data_ptr() < a + 128 for a in slots) for s in copier.given)


class FencedCopier(LateCopier):
    """Copies late in order (one worker); per-copy completions must not be waited for: the
    ring asks ``fence()`` once per released buffer, as with CUDA's one event per buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.futures: list = []
        self.fences = 0

    def __call__(self, dst, src):
        self.given.append(src)
        self.futures.append(self.pool.submit(lambda: (time.sleep(0.001), dst.copy_(src))))
        from ckptfs.engine.memory.ring import _FENCED

        return _FENCED  # raises if waited for

    def fence(self):
        self.fences += 1
        upto = list(self.futures)
        return type("Fence", (), {"wait": lambda self: [f.result() for f in upto]})()


async def test_a_copier_with_a_fence_is_waited_for_once_per_buffer(saved):
    url, sd = saved
    copier = FencedCopier()
    ring = Ring(BufferPool(limit=2 * 128), copier, slots=2, slot_bytes=128, device_type="cpu")
    targets = _targets(sd)
    await _load(url, targets, ring)
    for k, (t, box) in targets.items():
        assert torch.equal(t, sd[k][box.slices()]), k
    assert ring.reuses > 0 and 0 < copier.fences < len(copier.given)


async def test_a_chunk_cut_into_parts_is_still_checked_whole(saved, tmp_path):
    url, sd = saved
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(url, bad)
    store = await open_store(str(bad))
    index = await read_index(store)
    await store.close()
    chunk = index.tensors["b"].chunks[0]
    path = bad / chunk.file
    data = bytearray(path.read_bytes())
    data[chunk.byte_offset + 70] ^= 0xFF  # in the last 64-byte part of the 80-byte chunk
    path.write_bytes(data)
    ring = Ring(BufferPool(limit=128), LateCopier(), slots=2, slot_bytes=64, device_type="cpu")
    with pytest.raises(IntegrityError, match=r"key 'b': chunk at \[0\].*fails its checksum"):
        await _load(bad, {"b": (torch.zeros(40, dtype=torch.bfloat16), full_box((40,)))}, ring)
    assert ring.pool.budget.used == 0
    ring = Ring(BufferPool(limit=128), LateCopier(), slots=2, slot_bytes=64, device_type="cpu")
    t = torch.zeros(40, dtype=torch.bfloat16)
    await _load(bad, {"b": (t, full_box((40,)))}, ring, verify=False)  # unchecked: it loads
    assert not torch.equal(t, sd["b"]) and torch.equal(t[:32], sd["b"][:32])


async def test_a_copy_that_fails_at_once_surfaces_and_releases_the_ring(saved):
    url, sd = saved
    ring = Ring(BufferPool(limit=128), LateCopier(fail_on=3), slots=2, slot_bytes=64,
                device_type="cpu")
    with pytest.raises(RuntimeError, match="stand-in copy refused"):
        await _load(url, _targets(sd), ring)
    assert ring.pool.budget.used == 0


def test_allocator_choice_falls_back_without_cuda():
    cpu = [torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)]
    assert type(allocator_for(cpu)) is HostAllocator
    assert type(staging_allocator({"a": cpu[0], "b": [cpu[1], (cpu[0],)], "n": 3})) is HostAllocator
    assert cuda_ring(cpu, ring_bytes=1 << 20, slots=4) is None  # a CPU load never pins
    if not torch.cuda.is_available():
        on_cuda = type("T", (), {"device": torch.device("cuda"), "is_cuda": True})()  # a CUDA tensor, as seen
        assert type(allocator_for([on_cuda])) is HostAllocator  # CPU-only torch: never pinned
        with pytest.raises(RuntimeError):
            PinnedAllocator().allocate(16)  # what pinning does on CPU-only torch


def test_ring_settings_are_checked():
    for field in ("ring_bytes", "ring_slots"):  # one home for saves and loads (``dist``)
        with pytest.raises(ConfigError, match=f"DistOptions.{field}"):
            ckptfs.DistOptions(**{field: 0})
    assert ckptfs.LoadOptions().gds is False


async def test_gds_falls_back_with_a_reason(tmp_path, memfs):
    local = await open_store(str(tmp_path))
    remote = await open_store("memory://gds")
    try:
        assert "verify=False" in gds_unavailable(local, verify=True)
        assert "not a local filesystem" in gds_unavailable(remote, verify=False)
        try:
            import kvikio  # noqa: F401
        except ImportError:
            assert "kvikio is not importable" in gds_unavailable(local, verify=False)
            with pytest.warns(GdsFallbackWarning, match="kvikio is not importable.*pinned ring"):
                assert gds_reader(local, verify=False) is None
    finally:
        await local.close()
        await remote.close()


def test_gds_setting_leaves_a_cpu_load_alone(saved):
    url, sd = saved
    t = {k: torch.zeros_like(v) for k, v in sd.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", GdsFallbackWarning)  # no CUDA target: nothing to fall back
        ckptfs.load(t, url, options=ckptfs.LoadOptions(gds=True, verify=False))
    assert all(torch.equal(t[k], sd[k]) for k in sd)


def test_pinned_slots_are_a_power_of_two_within_the_ring():
    from ckptfs.engine.memory.ring import pinned_slot_bytes

    assert pinned_slot_bytes(512 << 20, 8) == 64 << 20  # the default ring
    assert pinned_slot_bytes(300 << 20, 4) == 64 << 20  # 75 MiB each, rounded down
    assert pinned_slot_bytes(3, 4) == 1  # never zero


async def test_a_parts_device_copy_starts_before_its_check(saved, monkeypatch):
    """The CPU checks a slot while its device copy runs (measured on an H100: 21.5 against
    19.2 GB/s verified, 8 GB fp32): every part's copy is started before its crc32c is computed,
    for compact parts and for parts gathered from far-apart runs alike."""
    from ckptfs.engine.load import schedule as read

    url, sd = saved
    events: list[tuple[str, int]] = []
    real_crc, real_checksum = read.crc_of, read.checksum

    def crc_of(data):
        events.append(("check", memoryview(data).nbytes))
        return real_crc(data)

    def checksum(data):
        events.append(("check", memoryview(data).nbytes))
        return real_checksum(data)

    monkeypatch.setattr(read, "crc_of", crc_of)
    monkeypatch.setattr(read, "checksum", checksum)
    copier = LateCopier()
    copier.seen = lambda: events.append(("copy", copier.given[-1].numel()
                                         * copier.given[-1].element_size()))
    ring = Ring(BufferPool(limit=128), copier, slots=1, slot_bytes=64, device_type="cpu")
    targets = _targets(sd)
    await _load(url, targets, ring)
    for k, (t, box) in targets.items():
        assert torch.equal(t, sd[k][box.slices()]), k
    checks = [i for i, (what, _) in enumerate(events) if what == "check"]
    assert len(checks) >= 3  # b (two parts) and e (one part) are read whole and checked
    for i in checks:  # one slot: the check's own part was the copy just before it
        assert events[i - 1] == ("copy", events[i][1]), events
