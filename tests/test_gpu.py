"""Loads into and saves from CUDA tensors. Marked ``cuda`` and skipped without a GPU;
run them on a GPU machine with ``pytest -m cuda tests/test_gpu.py``. The rings' logic is tested
on CPU with stand-in copiers in test_ring.py (loads) and test_device_parts.py (saves)."""

from __future__ import annotations

import pytest
import torch

import ckptfs
from ckptfs.testing.ranks import run_ranks

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RING = ckptfs.LoadOptions(dist=ckptfs.DistOptions(ring_bytes=1 << 16, ring_slots=4))  # 16 KiB slots: most chunks are cut in parts


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(96, 80, generator=g),  # 30 KiB: two slots
            "b": torch.randn(9000, generator=g).to(torch.bfloat16),
            "i": torch.randint(-5, 5, (7, 3, 11), generator=g),
            "h": torch.randn(33, 17, generator=g).to(torch.float16)}


def _assert_saved(path, want: dict[str, torch.Tensor]) -> None:
    """The checkpoint at ``path`` holds ``want``'s values (on any device), bit for bit."""
    back = ckptfs.load_keys(path)
    for k, v in want.items():
        assert torch.equal(back[k], v.cpu()), k


def _pinned_in_use() -> tuple[int, int]:
    """(current, peak) pinned bytes in use, from torch's caching host allocator."""
    s = torch.cuda.host_memory_stats()
    return s["active_bytes.current"], s["active_bytes.peak"]


def test_load_into_cuda_tensors_is_bit_exact_through_the_ring(tmp_path):
    sd = _state()
    ckptfs.save(sd, tmp_path / "c")
    dev = torch.device("cuda", torch.cuda.current_device())
    target = {"w": torch.zeros(80, 96, device=dev).t(),  # non-contiguous on the device
              "b": torch.zeros(9000, dtype=torch.bfloat16, device=dev),
              "i": torch.zeros(7, 3, 11, dtype=torch.int64, device=dev),
              "h": torch.zeros(33, 17, dtype=torch.float16, device=dev)}
    res = ckptfs.load(target, tmp_path / "c", options=RING)
    for k, v in sd.items():
        assert target[k].device == dev and torch.equal(target[k].cpu(), v), k
    # the ring's slots, leased as needed (a small load needs only some), no pageable scratch
    assert 0 < res.scratch_peak <= RING.ring_bytes


def test_load_into_cuda_holds_no_more_pinned_memory_than_the_ring(tmp_path):
    sd = {f"t{i}": torch.randn(256, 1024) for i in range(8)}  # 8 MiB, 16x the ring
    ckptfs.save(sd, tmp_path / "c")
    target = {k: torch.empty_like(v, device="cuda") for k, v in sd.items()}
    torch.cuda.reset_peak_host_memory_stats()
    before, _ = _pinned_in_use()
    cfg = ckptfs.LoadOptions(dist=ckptfs.DistOptions(ring_bytes=1 << 19, ring_slots=4))
    res = ckptfs.load(target, tmp_path / "c", options=cfg)
    assert all(torch.equal(target[k].cpu(), v) for k, v in sd.items())
    assert res.scratch_peak == cfg.ring_bytes
    _, peak = _pinned_in_use()
    assert peak - before <= cfg.ring_bytes  # pinned memory in use at once: the ring


def test_a_corrupted_chunk_is_caught_on_the_way_to_the_device(tmp_path):
    from ckptfs.errors import IntegrityError

    sd = _state()
    ckptfs.save(sd, tmp_path / "c")
    files = sorted(p for p in (tmp_path / "c").rglob("*") if p.is_file() and p.suffix != ".json")
    data = bytearray(files[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[0].write_bytes(data)
    target = {k: torch.zeros_like(v, device="cuda") for k, v in sd.items()}
    with pytest.raises(IntegrityError, match="fails its checksum"):
        ckptfs.load(target, tmp_path / "c", options=RING)


def test_save_from_cuda_is_bit_exact(tmp_path):
    sd = _state(1)
    on_gpu = {k: v.to("cuda") for k, v in sd.items()}
    on_gpu["w_t"] = on_gpu["w"].t()  # a non-contiguous CUDA source
    ckptfs.save(on_gpu, tmp_path / "c")
    _assert_saved(tmp_path / "c", on_gpu)


def test_save_from_cuda_holds_no_more_pinned_memory_than_the_ring(tmp_path):
    sd = {f"t{i}": torch.randn(1024, 1024, device="cuda") for i in range(8)}  # 32 MiB
    sd["t_t"] = sd["t0"].t()  # non-contiguous: copied out in C-order pieces
    cfg = ckptfs.SaveOptions(dist=ckptfs.DistOptions(ring_bytes=1 << 22, ring_slots=4))  # 4 MiB: 1 MiB slots
    torch.cuda.synchronize()
    torch.cuda.reset_peak_host_memory_stats()
    before, _ = _pinned_in_use()
    ckptfs.save(sd, tmp_path / "c", options=cfg)
    _, peak = _pinned_in_use()
    assert peak - before <= cfg.ring_bytes  # no host copy of the state, pinned or not
    _assert_saved(tmp_path / "c", sd)


def test_save_from_cuda_waits_for_the_callers_stream(tmp_path):
    x = torch.zeros(1 << 22, device="cuda")
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the caller's stream is busy for a while...
        x.fill_(3.0)  # ...before it writes the tensor being saved
        ckptfs.save({"x": x}, tmp_path / "c")
    back = ckptfs.load_keys(tmp_path / "c")
    assert torch.equal(back["x"], torch.full((1 << 22,), 3.0))


@pytest.mark.parametrize("backend", ["torch_dist", "zarr"])
def test_save_from_cuda_with_a_backend_that_stages_the_chunks(tmp_path, backend):
    sd = _state(4)
    on_gpu = {k: v.to("cuda") for k, v in sd.items()}
    ckptfs.save(on_gpu, tmp_path / "c", backend=backend)
    _assert_saved(tmp_path / "c", sd)


def test_async_save_from_cuda_stages_into_pinned_buffers(tmp_path):
    sd = {f"t{i}": torch.randn(512, 256, device="cuda") for i in range(4)}
    want = {k: v.cpu() for k, v in sd.items()}
    fut = ckptfs.async_save(sd, tmp_path / "c")
    fut.staged.result()
    for v in sd.values():  # the training step goes on: the saved bytes are the staged ones
        v.add_(1)
    fut.done.result()
    _assert_saved(tmp_path / "c", want)


def test_checkpoint_manager_saves_from_cuda_through_pinned_staging(tmp_path):
    sd = {f"t{i}": torch.randn(256, 256, device="cuda") for i in range(4)}
    want = {k: v.cpu() for k, v in sd.items()}
    ckptfs.close()  # no staging buffers cached by earlier tests
    mgr = ckptfs.CheckpointManager(tmp_path / "m", ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=())))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_host_memory_stats()
    before, _ = _pinned_in_use()
    h = mgr.save(3, sd)
    h.staged.result()
    for v in sd.values():
        v.zero_()
    h.done.result()
    _, peak = _pinned_in_use()
    assert peak - before >= sum(v.numel() * 4 for v in want.values())  # staged pinned
    mgr.close()
    ckptfs.close()
    _assert_saved(tmp_path / "m" / "step-00000003", want)


def _dtensor_ranks(rank: int, world: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    torch.cuda.set_device(0)  # one GPU is enough: both ranks place their shards on it
    mesh = init_device_mesh("cuda", (world,))
    full = _state(2)["w"]
    cols = full.shape[1] // world
    local = full[:, rank * cols:(rank + 1) * cols].contiguous().to("cuda")
    ckptfs.save({"w": DTensor.from_local(local, mesh, [Shard(1)], run_check=False)},
                f"{root}/by_cols")
    rows = full.shape[0] // world
    target = DTensor.from_local(torch.zeros(rows, full.shape[1], device="cuda"), mesh, [Shard(0)],
                                run_check=False)
    ckptfs.load({"w": target}, f"{root}/by_cols", options=RING)  # resharded, into CUDA
    assert torch.equal(target.to_local().cpu(), full[rank * rows:(rank + 1) * rows])


def test_dtensor_local_shards_on_cuda_save_and_reshard(tmp_path):
    run_ranks(2, _dtensor_ranks, str(tmp_path))


def test_gds_path_when_kvikio_is_installed(tmp_path):
    pytest.importorskip("kvikio")
    sd = _state(3)
    ckptfs.save(sd, tmp_path / "c")
    target = {k: torch.zeros_like(v, device="cuda") for k, v in sd.items()}
    ckptfs.load(target, tmp_path / "c", options=ckptfs.LoadOptions(gds=True, verify=False))
    for k, v in sd.items():
        assert torch.equal(target[k].cpu(), v), k


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_wait_staged_on_a_stream_lets_the_host_go_on_before_the_copies_end(tmp_path, writer):
    """The caller's stream is busy, so the device-to-host copies (queued after its work) cannot
    end soon: ``wait_staged(stream=...)`` returns while ``staged`` is pending, and the step
    queued next on the stream (``add_``) runs after the copies: the checkpoint holds the values
    at the call."""
    sd = {f"t{i}": torch.randn(512, 256, device="cuda") for i in range(4)}
    want = {k: v.cpu() for k, v in sd.items()}
    stream = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time before the copies
    h = ckptfs.async_save(sd, tmp_path / "c", writer=writer)
    h.wait_staged(timeout=60, stream=stream)
    if writer == "thread":  # pinned staging: the copies are asynchronous
        assert h.staged.queued.result(0) and not h.staged.done()
    for v in sd.values():
        v.add_(1)  # queued on ``stream``: after the events
    h.result(timeout=120)
    _assert_saved(tmp_path / "c", want)
    ckptfs.close()


def test_process_writer_pins_its_shared_staging_for_cuda_state(tmp_path):
    from ckptfs.engine.background.defaults import default_saver

    sd = {f"t{i}": torch.randn(256, 256, device="cuda") for i in range(4)}
    want = {k: v.cpu() for k, v in sd.items()}
    h = ckptfs.async_save(sd, tmp_path / "c", writer="process")
    h.wait_staged(timeout=60, stream=torch.cuda.current_stream())
    arena = default_saver("process")._arena
    assert arena._segments and all(s.pinned for s in arena._segments)
    assert h.staged.queued.result(0)  # events recorded: the copies ran asynchronously
    for v in sd.values():
        v.zero_()
    h.result(timeout=120)
    _assert_saved(tmp_path / "c", want)
    ckptfs.close()
