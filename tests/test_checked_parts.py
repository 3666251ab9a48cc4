"""Chunk bytes checksummed while they are written (engine/save/checked_parts.py): on a local store
each large chunk's crc32c is computed slice by slice, a bounded number of slices ahead of the
writer thread's write of them (never by the saving thread), and the index holds
the same chunk and file checksums as bytes read back give; small chunks, encoded chunks and
stores that do not take streamed parts keep the checksum computed apart."""

from __future__ import annotations

import math
import threading

import google_crc32c
import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.engine.background.writer_process import ProcessSaver
from ckptfs.engine.save import write as write_mod
from ckptfs.engine.save.checked_parts import MIN_BYTES, CheckedPart, address, checked_files
from ckptfs.layout.backend import FileWrite
from ckptfs.layout.index import Index
from ckptfs.layout.tensor_bytes import tensor_bytes


def test_a_checked_part_yields_its_bytes_in_slices_and_their_crc():
    data = memoryview(np.random.default_rng(0).integers(0, 255, 5000, dtype=np.uint8).tobytes())
    part = CheckedPart(data, slice_bytes=1024)
    assert part.nbytes == 5000 and part.crc is None
    got = []
    for view in part.stream():
        assert part.crc is None  # known only once every slice went by
        got.append(bytes(view))
    assert [len(g) for g in got] == [1024] * 4 + [904]
    assert b"".join(got) == bytes(data) and part.crc == google_crc32c.value(bytes(data))
    stream = part.stream()  # a retried write streams again, from the start
    next(stream)
    assert part.crc is None
    stream.close()


def test_the_checksum_runs_a_bounded_number_of_slices_ahead_and_ends_with_the_stream():
    """While the writer holds a slice the checksum thread has summed at most ``AHEAD`` of them;
    a writer that stops early ends that thread before the stream is closed, and no crc."""
    from ckptfs.engine.save import checked_parts

    data = memoryview(bytes(range(256)) * 64)
    part = CheckedPart(data, slice_bytes=1024)
    stream = part.stream()
    next(stream)
    threads = [t for t in threading.enumerate() if t.name == "ckptfsChunkCrc"]
    assert len(threads) == 1
    threads[0].join(0.2)  # the most it can do without the writer going on
    ahead = stream.gi_frame.f_locals["ahead"]
    assert len(ahead.crcs) <= checked_parts.AHEAD
    stream.close()
    assert not threads[0].is_alive() and part.crc is None
    assert b"".join(bytes(v) for v in part.stream()) == bytes(data)
    assert part.crc == google_crc32c.value(bytes(data))


def test_only_parts_that_are_large_chunks_are_wrapped():
    big = torch.arange(MIN_BYTES // 4 + 7, dtype=torch.float32)
    small = torch.arange(100, dtype=torch.float32)
    encoded = bytes(tensor_bytes(big))  # the same bytes elsewhere: an encoded copy
    header = b"h" * 16
    files = [FileWrite("a", (header, tensor_bytes(big), tensor_bytes(small))),
             FileWrite("b", (encoded,)), FileWrite("c", (tensor_bytes(small),))]
    out, made = checked_files(files, [tensor_bytes(big), tensor_bytes(small)])
    assert list(made) == [address(tensor_bytes(big))]
    a, b, c = out
    assert a.parts[0] is header and isinstance(a.parts[1], CheckedPart) and a.parts[1] is made[
        address(tensor_bytes(big))]
    assert not isinstance(a.parts[2], CheckedPart)
    assert b is files[1] and c is files[2]  # unchanged files are the same objects


def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(3 << 18, generator=g),  # 3 MiB: checked while written
            "wide": torch.randn(512, 1024, generator=g).bfloat16(),  # 1 MiB
            "small": torch.randn(300, generator=g), "step": 7}


def _sizes_checksummed_by_this_thread(monkeypatch) -> list[int]:
    """The sizes of the buffers the calling thread checksums from now on (write.crcs_of
    wrapped: the write phase checksums a rank's chunks in one call)."""
    main = threading.current_thread()
    apart: list[int] = []
    real = write_mod.crcs_of

    def crcs_of(buffers, **kw):
        buffers = list(buffers)
        if threading.current_thread() is main:
            apart.extend(memoryview(b).nbytes for b in buffers)
        return real(buffers, **kw)

    monkeypatch.setattr(write_mod, "crcs_of", crcs_of)
    return apart


@pytest.mark.parametrize("backend", ["safetensors_chunks", "torch_dist", "zarr"])
def test_large_chunks_are_checksummed_in_the_writer_threads(tmp_path, monkeypatch, backend):
    """No large chunk is checksummed by the saving thread; every chunk and file checksum in the
    index is the crc32c of the bytes on disk, and the checkpoint loads and verifies."""
    apart = _sizes_checksummed_by_this_thread(monkeypatch)
    state = _state()
    ckptfs.save(state, tmp_path / "ck", backend=backend)
    assert apart and all(n < MIN_BYTES for n in apart), apart  # the small chunks: here
    index = Index.loads((tmp_path / "ck" / ckptfs.INDEX_FILE).read_bytes())
    for path, want in index.file_checksums.items():
        data = (tmp_path / "ck" / path).read_bytes()
        assert f"crc32c:{google_crc32c.value(data):08x}" == want, path
    for key in ("big", "wide", "small"):
        raw = bytes(tensor_bytes(state[key]))
        (chunk,) = index.tensors[key].chunks
        assert chunk.checksum == f"crc32c:{google_crc32c.value(raw):08x}", key
    report = ckptfs.verify(tmp_path / "ck")
    assert report.ok, report.problems
    back = {"big": torch.zeros(3 << 18), "wide": torch.zeros(512, 1024).bfloat16(),
            "small": torch.zeros(300), "step": 0}
    ckptfs.load(back, tmp_path / "ck")
    assert all(torch.equal(back[k], state[k]) for k in ("big", "wide", "small"))


def test_a_store_that_would_copy_streamed_views_gets_host_bytes(memfs, monkeypatch):
    """A remote store takes streamed parts but copies their views to upload them: its chunks
    are checksummed apart, as before, never streamed."""
    apart = _sizes_checksummed_by_this_thread(monkeypatch)
    state = _state()
    ckptfs.save(state, "memory://remote")
    assert sorted(apart)[-2:] == [1 << 20, 3 << 20], apart
    assert ckptfs.verify("memory://remote").ok


def test_the_writer_goes_on_while_the_last_slices_are_checksummed(monkeypatch):
    """A stream that has yielded every slice returns at once, its checksum thread still
    running; ``crc`` waits for that thread, and ``finish`` ends it."""
    from ckptfs.engine.save import checked_parts

    gate = threading.Event()
    real_crc_of = checked_parts.crc_of

    def held_crc_of(view: memoryview) -> int:
        gate.wait(30)
        return real_crc_of(view)

    monkeypatch.setattr(checked_parts, "crc_of", held_crc_of)
    data = bytes(range(256)) * 16
    part = CheckedPart(memoryview(data), slice_bytes=1024)
    got: list[bytes] = []
    writer = threading.Thread(target=lambda: got.extend(bytes(v) for v in part.stream()))
    writer.start()
    writer.join(5)
    alive = writer.is_alive()
    gate.set()
    writer.join()
    assert not alive and b"".join(got) == data  # every slice written, no checksum yet
    assert part.crc == google_crc32c.value(data)
    part.finish()
    assert not [t for t in threading.enumerate() if t.name == "ckptfsChunkCrc"]


def test_a_checked_part_checksums_each_block_right_after_its_test(monkeypatch):
    """Each slice is tested and checksummed ``BLOCK`` bytes at a time, the crc32c of a block
    right after its test (which read it into the cache); no block is tested after a hit (the
    checksum goes on); a retried write tests again from the start."""
    from ckptfs.engine.save import checked_parts

    monkeypatch.setattr(checked_parts, "BLOCK", 1024)
    data = np.zeros(4000, dtype=np.float32)
    data[2500] = np.nan  # byte 10,000: the tenth block, the third slice
    seen: list[int] = []
    real_extend = checked_parts.extend
    order: list[str] = []

    def extend(crc: int, block: memoryview) -> int:
        order.append("crc")
        return real_extend(crc, block)

    def test(view: memoryview) -> bool:
        order.append("test")
        seen.append(view.nbytes)
        return bool(np.isnan(np.frombuffer(view, dtype=np.float32)).any())

    monkeypatch.setattr(checked_parts, "extend", extend)
    part = CheckedPart(memoryview(data.tobytes()), slice_bytes=4096, test=test)
    assert part.tested and not part.suspect
    assert b"".join(bytes(v) for v in part.stream()) == data.tobytes()
    assert part.suspect and seen == [1024] * 10  # no block tested after the hit
    # the rest of the third slice block by block, the fourth whole (crc_of)
    assert order[:20] == ["test", "crc"] * 10 and order[20:] == ["crc"] * 2
    assert part.crc == google_crc32c.value(data.tobytes())
    stream = part.stream()  # a retried write tests again, from the start
    next(stream)
    assert not part.suspect
    stream.close()
    assert not CheckedPart(memoryview(data.tobytes())).tested


def _bad_state() -> dict:
    """``_state`` with a NaN and an infinity in the 3 MiB chunk (its third 1 MiB), an infinity
    in the 1 MiB one and a NaN in the small one."""
    state = _state()
    state["big"][700_000], state["big"][-1] = float("nan"), float("-inf")
    state["wide"][511, 1023] = float("inf")
    state["small"][5] = float("nan")
    return state


def _keys_searched_apart(monkeypatch) -> list[str]:
    """The keys of the chunks the write phase searches apart from their write (the health
    hook's ``during_write``: the chunks no block test runs on)."""
    from ckptfs.engine.save import health

    apart: list[str] = []
    real = health.HealthHook.during_write

    def during_write(self, untested, note):
        if note.search:
            apart.extend(c.key for c in health._unsearched(untested, note))
        return real(self, untested, note)

    monkeypatch.setattr(health.HealthHook, "during_write", during_write)
    return apart


FOUND = {"big": (1, 1), "wide": (0, 1), "small": (1, 0)}


@pytest.mark.parametrize("writer", [None, "thread", "process"])
@pytest.mark.slow
def test_large_chunks_are_searched_for_nan_while_written(tmp_path, monkeypatch, writer):
    """check_finite on a fresh local target: the large chunks are searched slice by slice in
    the writer threads (``save``, ``async_save`` and its writer process alike), only the small
    one apart; a refused save raises NonFiniteError with exact counts and leaves no file."""
    apart = _keys_searched_apart(monkeypatch)
    url = tmp_path / "fresh"
    with pytest.raises(ckptfs.NonFiniteError) as e:
        if writer is None:
            ckptfs.save(_bad_state(), url, check_finite=True)
        else:
            saver = ProcessSaver() if writer == "process" else ckptfs.BackgroundSaver()
            try:
                ckptfs.async_save(_bad_state(), url, check_finite=True, writer=writer,
                                  saver=saver).result(120)
            finally:
                saver.close()
    assert e.value.found == FOUND
    assert not list(url.rglob("*"))
    if writer != "process":  # (the writer process's calls are not seen here)
        assert apart == ["small"]
    ckptfs.save(_state(), url, check_finite=True)  # a finite state at the same URL: committed
    assert ckptfs.verify(url).ok


def test_every_float_dtype_is_searched_block_by_block_while_written(tmp_path, monkeypatch):
    """Chunks of each float dtype tested block by block in the checksum thread: a NaN of either
    sign and an infinity of either sign, each in its own chunk and in a different block (the
    first, a middle one, the short last one), are found and counted exactly; chunks of finite
    extremes are not; nothing is written."""
    from ckptfs.engine.save import checked_parts

    monkeypatch.setattr(checked_parts, "MIN_BYTES", 32 << 10)
    monkeypatch.setattr(checked_parts, "BLOCK", 8 << 10)
    apart = _keys_searched_apart(monkeypatch)
    state, want = {}, {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e5m2):
        n = (66 << 10) // dtype.itemsize  # 8 blocks and a short last one
        fi = torch.finfo(dtype)
        base = torch.tensor([fi.max, -fi.max, fi.tiny, -fi.tiny, 0.0, -0.0, 1.0, -1.0],
                            dtype=torch.float64).repeat(n // 8 + 1)[:n]
        state[f"{dtype}-ok"] = base.to(dtype)
        for name, value, where, counts in (("nan", math.nan, 0, (1, 0)),
                                           ("neg-nan", -math.nan, n // 2, (1, 0)),
                                           ("inf", math.inf, n - 1, (0, 1)),
                                           ("neg-inf", -math.inf, n // 3, (0, 1))):
            x = base.clone()
            x[where] = value
            state[f"{dtype}-{name}"], want[f"{dtype}-{name}"] = x.to(dtype), counts
    url = tmp_path / "fresh"
    with pytest.raises(ckptfs.NonFiniteError) as e:
        ckptfs.save(state, url, check_finite=True)
    assert e.value.found == want
    assert apart == [] and not list(url.rglob("*"))


def test_a_refused_replacing_save_leaves_the_checkpoint_as_it_was(tmp_path, monkeypatch):
    """overwrite=True over a committed checkpoint: the search runs before the old index is
    touched (every chunk apart, nothing written)."""
    apart = _keys_searched_apart(monkeypatch)
    ckptfs.save(_state(), tmp_path / "ck")
    before = {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()}
    with pytest.raises(ckptfs.NonFiniteError) as e:
        ckptfs.save(_bad_state(), tmp_path / "ck", overwrite=True, check_finite=True)
    assert e.value.found == FOUND and apart == []  # not searched while written
    assert {p: p.read_bytes() for p in (tmp_path / "ck").rglob("*") if p.is_file()} == before
    assert ckptfs.verify(tmp_path / "ck").ok


def test_a_remote_store_is_searched_before_anything_is_written(memfs, monkeypatch):
    apart = _keys_searched_apart(monkeypatch)
    with pytest.raises(ckptfs.NonFiniteError) as e:
        ckptfs.save(_bad_state(), "memory://remote", check_finite=True)
    assert e.value.found == FOUND and apart == [] and not memfs.find("/remote")
