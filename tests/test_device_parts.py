"""A synchronous save streaming its device chunks through a bounded ring while the files are
written (engine/memory/device_parts.py, io/streamed.py), on CPU: the "device" chunks are CPU tensors
that a stand-in copier copies late in a worker thread (as a DMA engine would), through a ring
of a few small slots that are reused, so a store that keeps a view after asking for the next,
a slot given back before its copy completed, or a piece written before its copy completed
gives wrong bytes, which the load's checksums (and the comparisons here) catch. The CUDA copier
runs in tests/test_gpu.py (GPU machines only)."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import fsspec
import pytest
import torch

import ckptfs
from ckptfs.engine.memory.device_parts import DeviceChunk, DeviceParts, SlotPool
from ckptfs.errors import StorageError
from ckptfs.io import StoreOptions, run_sync
from ckptfs.io.fsspec_store import FsspecStore
from ckptfs.io.parts import materialized, pieces
from ckptfs.io.streamed import StreamedPart
from ckptfs.layout.checksum import crc_of
from ckptfs.layout.geometry import c_order_cuts
from tests.copiers import LateCopier

SAVE = sys.modules["ckptfs.engine.save.pipeline"]  # where a synchronous save makes its ring
SLOT = 1 << 16  # 64 KiB slots: every tensor below is cut in several pieces


def _parts(slots: int = 3) -> tuple[DeviceParts, LateCopier]:
    copier = LateCopier()
    # each slot starts as garbage: a piece written before its copy landed shows
    pool = SlotPool(slots, SLOT, lambda n: torch.full((n,), 0xAB, dtype=torch.uint8))
    return DeviceParts(pool, copier, lambda t: t.dtype != torch.int64), copier


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(300, 200, generator=g)
    return {"w": w,  # 240,000 bytes: 4 slots
            "w_t": w.t(),  # not contiguous: pieces follow its C order
            "b": torch.randn(70_001, generator=g).to(torch.bfloat16),
            "h": torch.randn(3, 50, 41, generator=g).to(torch.float16),
            "i": torch.arange(10),  # int64: not accepted, written from host memory as before
            "e": torch.empty(0, 4)}


@pytest.fixture
def streamed(monkeypatch):
    made: list[tuple[DeviceParts, LateCopier]] = []

    def fake(state_dict, be, cfg):
        if not be.streams_device_chunks:
            return None
        made.append(_parts())
        return made[-1][0]

    monkeypatch.setattr(SAVE, "device_parts", fake)
    return made


def _roundtrip(sd, url, **kw):
    back = ckptfs.load_keys(url, **kw)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k


def test_a_streamed_save_is_bit_exact_and_holds_only_the_ring(tmp_path, streamed):
    sd = _state()
    ckptfs.save(sd, tmp_path / "c")
    parts, copier = streamed[0]
    want = sum(v.numel() * v.element_size() for k, v in sd.items() if k != "i")
    assert copier.bytes == want  # every accepted byte went through the copier, once
    assert 0 < parts.pool.peak <= 3 * SLOT  # host memory held at once: the ring
    assert parts.pool._out == 0
    assert "ckptfsIO" not in copier.threads
    _roundtrip(sd, tmp_path / "c")  # verify=True: every chunk's and file's crc32c
    assert ckptfs.verify(tmp_path / "c").ok


def test_a_one_slot_ring_still_streams(tmp_path, monkeypatch):
    made = []

    def fake(state_dict, be, cfg):
        made.append(_parts(slots=1))
        return made[-1][0]

    monkeypatch.setattr(SAVE, "device_parts", fake)
    sd = _state()
    ckptfs.save(sd, tmp_path / "c")
    assert made[0][0].pool.peak == SLOT
    _roundtrip(sd, tmp_path / "c")


@pytest.mark.parametrize("engine", ["fsspec", "obstore"])
def test_streamed_saves_to_s3(s3, streamed, engine):
    g = torch.Generator().manual_seed(3)
    sd = {"big": torch.randn(3_000_000, generator=g),  # 12 MB: a multipart upload of 5 MiB parts
          **_state()}
    cfg = StoreOptions(client=engine, part_size=5 << 20)
    url = f"{s3.url}/c-{engine}"
    ckptfs.save(sd, url, storage_options=s3.options, store_options=cfg)
    assert streamed[0][0].pool.peak <= 3 * SLOT
    assert streamed[0][1].threads and "ckptfsIO" not in streamed[0][1].threads  # never blocks it
    _roundtrip(sd, url, storage_options=s3.options, store_options=cfg)


def test_streamed_saves_to_an_fsspec_filesystem(memfs, streamed):
    sd = _state()
    ckptfs.save(sd, "memory://c")  # a filesystem of its own pipe_file: the parts are joined
    assert streamed[0][1].threads and "ckptfsIO" not in streamed[0][1].threads
    _roundtrip(sd, "memory://c")


def test_a_backend_that_needs_the_bytes_gets_a_staged_copy(tmp_path, streamed):
    sd = _state()
    ckptfs.save(sd, tmp_path / "c", backend="torch_dist")  # the zip container holds a CRC-32
    assert streamed == []
    _roundtrip(sd, tmp_path / "c")


def test_a_failed_write_gives_every_slot_back_and_commits_nothing(tmp_path, streamed,
                                                                  monkeypatch):
    from ckptfs.io.local_store import LocalStore

    real = LocalStore.put

    async def failing(self, path, parts):
        if any(isinstance(p, StreamedPart) for p in parts):
            def broken():
                it = pieces(parts, 1 << 16)
                next(it), next(it)  # two pieces in, then the disk fails
                it.close()
                raise OSError(28, "No space left on device")

            import asyncio

            await asyncio.to_thread(broken)
        await real(self, path, parts)

    monkeypatch.setattr(LocalStore, "put", failing)
    with pytest.raises(StorageError, match="No space left"):
        ckptfs.save(_state(), tmp_path / "c")
    parts, _ = streamed[0]
    assert parts.pool._out == 0  # the stream stopped early; its slots came back
    assert not (tmp_path / "c" / "index.json").exists()


class Reused(StreamedPart):
    """Streams ``data`` through one buffer that each step overwrites."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def stream(self) -> Iterator[memoryview]:
        buf = bytearray(self.step)
        for i in range(0, len(self.data), self.step):
            piece = self.data[i : i + self.step]
            buf[: len(piece)] = piece
            yield memoryview(buf)[: len(piece)]
            buf[:] = b"\0" * self.step  # the view is stale once the stream goes on


def test_pieces_hand_each_streamed_view_over_before_asking_for_the_next():
    data = bytes(range(256)) * 40
    parts = [b"head", Reused(data, 1000), b"tail"]
    got = b"".join(b"".join(bytes(v) for v in piece) for piece in pieces(parts, 700))
    assert got == b"head" + data + b"tail"
    kept = list(pieces(parts, 700, keep=True))  # pieces held: streamed bytes copied
    assert b"".join(bytes(v) for piece in kept for v in piece) == b"head" + data + b"tail"
    assert all(sum(v.nbytes for v in p) == 700 for p in kept[:-1])  # full-size upload parts
    assert bytes(materialized(parts)[1]) == data


def test_the_fsspec_store_writes_streamed_parts_through_one_open_file(tmp_path):
    data = bytes(range(256)) * 100
    fs = fsspec.filesystem("file")

    async def go():
        store = FsspecStore(fs, str(tmp_path), f"file://{tmp_path}")
        assert store.streaming is not None and store.streams_parts
        await store.put("f.bin", [b"x", Reused(data, 999)])

    run_sync(go())
    assert (tmp_path / "f.bin").read_bytes() == b"x" + data


def test_a_device_chunk_streams_in_c_order_and_records_its_crc():
    copier = LateCopier()
    pool = SlotPool(2, 4096, lambda n: torch.zeros(n, dtype=torch.uint8))
    t = torch.arange(5 * 7 * 11, dtype=torch.float32).reshape(5, 7, 11).permute(2, 0, 1)
    part = DeviceChunk(t, pool, copier)
    got = b"".join(bytes(v) for v in part.stream())
    want = t.contiguous().numpy().tobytes()
    assert got == want and part.crc == crc_of(want)
    assert pool.peak <= 2 * 4096 and pool._out == 0
    stream = part.stream()  # a consumer that stops once it holds every byte (a joined file)
    held = [bytes(next(stream)) for _ in c_order_cuts(tuple(t.shape), 4, 4096)]
    assert b"".join(held) == want and part.crc == crc_of(want)
    stream.close()
    assert pool._out == 0
