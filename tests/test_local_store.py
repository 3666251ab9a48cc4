"""LocalStore and the coalescing policy against a plain-Python reference (hypothesis)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfs.io import ReadInto, coalesce, local_store, open_store, run_sync
from ckptfs.io.options import StoreOptions

BLOB = os.urandom(1 << 16)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(0, 3000)), min_size=1,
                max_size=40),
       st.integers(0, 5000), st.sampled_from([7, 100, 1 << 20]))
def test_read_into_matches_reference(tmp_path_factory, reqs, max_gap, piece):
    root = tmp_path_factory.mktemp("ls")
    (root / "f").write_bytes(BLOB)
    reads = [ReadInto(s, memoryview(bytearray(min(n, len(BLOB) - s)))) for s, n in reqs]

    async def go():
        # a small read_piece splits spans into many parallel pieces
        store = await open_store(str(root), None, StoreOptions(max_gap=max_gap, read_piece=piece))
        await store.read_into("f", reads)
        return store.stats

    stats = run_sync(go())
    for r in reads:
        assert bytes(r.dest) == BLOB[r.start : r.start + r.dest.nbytes]
    low, high = read_bounds([(r.start, r.end) for r in reads], max_gap)
    assert low <= stats.bytes_read <= high, (low, stats.bytes_read, high)


def read_bounds(reads: list[tuple[int, int]], max_gap: int) -> tuple[int, int]:
    """Bytes a reader of ``reads`` [start, end) must fetch at least (their union), and at most
    under the coalescing policy: spans merged across gaps of at most ``max_gap`` bytes, plus a
    second read of each range that starts inside an earlier one. Plain Python, no ckptfs."""
    union = spans = again = 0
    cur_start = cur_end = covered_end = None
    for start, end in sorted(reads):  # empty ranges count too: the policy merges across them
        if covered_end is not None and start < covered_end:
            again += end - start
        if cur_end is not None and start - cur_end <= max_gap:
            union += max(0, end - max(start, covered_end))
            cur_end = max(cur_end, end)
        else:
            if cur_end is not None:
                spans += cur_end - cur_start
            union += end - start
            cur_start, cur_end = start, end
        covered_end = end if covered_end is None else max(covered_end, end)
    if cur_end is not None:
        spans += cur_end - cur_start
    return union, spans + again


def test_coalesce_policy():
    def r(s, n):
        return ReadInto(s, memoryview(bytearray(n)))

    groups = coalesce([r(100, 10), r(0, 10), r(15, 5), r(1000, 1)], max_gap=10, max_span=1 << 20)
    assert [(g.span.start, g.span.end) for g in groups] == [(0, 20), (100, 110), (1000, 1001)]
    groups = coalesce([r(0, 10), r(10, 10), r(20, 10)], max_gap=0, max_span=20)
    assert [(g.span.start, g.span.end) for g in groups] == [(0, 20), (20, 30)]


def test_short_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "f").write_bytes(b"x" * 10)

    async def go():
        store = await open_store(str(tmp_path))
        await store.read_into("f", [ReadInto(5, memoryview(bytearray(10)))])

    try:
        run_sync(go())
    except EOFError as e:
        assert "/f" in str(e)
    else:
        raise AssertionError("no EOFError")


def test_a_failed_read_into_leaves_no_read_running(tmp_path, monkeypatch):
    """When one piece fails, read_into raises only after the other pieces' threads are done:
    the caller gives the buffers back (scratch is reused) as soon as it returns."""
    import threading
    import time

    (tmp_path / "f").write_bytes(b"x" * 100)
    real, finished = local_store._preadv_all, threading.Event()

    def preadv(fd, bufs, offset, full):
        if offset == 0:
            raise EOFError(f"{full}: failed at once")
        time.sleep(0.3)
        finished.set()
        return real(fd, bufs, offset, full)

    monkeypatch.setattr(local_store, "_preadv_all", preadv)
    async def go():
        store = await open_store(str(tmp_path), None, StoreOptions(read_piece=50))
        await store.read_into("f", [ReadInto(0, memoryview(bytearray(100)))])

    try:
        run_sync(go())
    except EOFError:
        assert finished.is_set(), "read_into returned while a read was still running"
    else:
        raise AssertionError("no EOFError")


def _evict(path) -> None:
    """Drop a file's pages from the page cache (clean pages; no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_reads_of_uncached_data_go_around_the_page_cache(tmp_path, monkeypatch):
    """With direct_reads, pieces not in the page cache are read with O_DIRECT (aligned, through
    a bounce buffer) into unaligned destinations at unaligned offsets, up to an unaligned end of
    file. Cached pieces, and direct_reads=False (the default), read buffered."""
    blob = os.urandom(3 * (1 << 16) + 123)
    (tmp_path / "f").write_bytes(blob)
    reqs = [(0, 10), (4095, 4098), (5000, 70000), (len(blob) - 777, 777), (100, 150000)]
    direct = []
    real = local_store.LocalStore._read_direct

    def spy(self, path, bufs, offset, full):
        direct.append(offset)
        return real(self, path, bufs, offset, full)

    monkeypatch.setattr(local_store.LocalStore, "_read_direct", spy)

    def read(cfg: StoreOptions) -> list[bytes]:
        async def go():
            store = await open_store(str(tmp_path), None, cfg)
            dests = [memoryview(bytearray(n + 3))[3:] for _, n in reqs]  # unaligned addresses
            await store.read_into("f", [ReadInto(s, d) for (s, _), d in zip(reqs, dests)])
            await store.close()
            return [bytes(d) for d in dests]

        return run_sync(go())

    # read_piece: several pieces, each its own read
    on = StoreOptions(max_gap=0, direct_reads=True, read_piece=1 << 16)
    off = StoreOptions(max_gap=0, read_piece=1 << 16)
    for cfg, uses_direct in ((on, True), (off, False)):
        _evict(tmp_path / "f")
        fd = os.open(tmp_path / "f", os.O_RDONLY)
        assert not local_store._cached(fd, 0, len(blob))
        os.close(fd)
        direct.clear()
        assert read(cfg) == [blob[s : s + n] for s, n in reqs]
        assert bool(direct) == uses_direct, direct
    # the buffered read cached the file: read buffered now
    direct.clear()
    assert read(on) == [blob[s : s + n] for s, n in reqs] and not direct
    # a read past the end is an error naming the file on the direct path too
    _evict(tmp_path / "f")

    async def past_end():
        store = await open_store(str(tmp_path), None, on)
        await store.read_into("f", [ReadInto(len(blob) - 5, memoryview(bytearray(10)))])

    try:
        run_sync(past_end())
    except EOFError as e:
        assert "/f" in str(e) and direct
    else:
        raise AssertionError("no EOFError")


def test_put_writes_parts_and_put_if_absent_is_create_only(tmp_path):
    async def go():
        store = await open_store(str(tmp_path))
        parts = [os.urandom(5000) for _ in range(1500)]  # more buffers than IOV_MAX
        await store.put("a/b/c.bin", parts)
        await store.put_if_absent("idx", b"1")
        try:
            await store.put_if_absent("idx", b"2")
        except FileExistsError as e:
            assert "idx" in str(e)
        else:
            raise AssertionError("second create succeeded")
        return parts, await store.list()

    parts, listing = run_sync(go())
    assert (tmp_path / "a/b/c.bin").read_bytes() == b"".join(parts)
    assert (tmp_path / "idx").read_bytes() == b"1"
    assert listing == ["a/b/c.bin", "idx"]


def test_a_load_reads_each_stream_front_to_back(tmp_path, monkeypatch):
    """``StoreOptions.read_streams``: a load from a local store reads a file as that many runs, each
    one ``read_into`` at a time in file order (without a preference: every wave at once); a
    file cut short mid-run is an IntegrityError naming it, and the other runs stop."""
    import pytest
    import torch

    import ckptfs
    state = {"w": torch.randn(1 << 20), "v": torch.randn(300_000)}
    ckptfs.save(state, tmp_path / "ck")
    calls: list[int] = []
    live, peak = [0], [0]
    real = local_store.LocalStore.read_into

    async def recording(self, path, reads):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        calls.append(min(r.start for r in reads))
        try:
            await real(self, path, reads)
        finally:
            live[0] -= 1

    monkeypatch.setattr(local_store.LocalStore, "read_into", recording)

    def load(streams: int) -> list[int]:
        calls.clear()
        peak[0] = 0
        target = {k: torch.zeros_like(v) for k, v in state.items()}
        ckptfs.load(target, tmp_path / "ck", store_options=StoreOptions(read_streams=streams),
                    options=ckptfs.LoadOptions(read_wave=64 << 10))  # ~80 waves from 5 MB
        assert all(torch.equal(target[k], state[k]) for k in state)
        return list(calls)

    one = load(1)
    assert len(one) > 40 and one == sorted(one) and peak[0] == 1
    load(3)
    assert peak[0] == 3
    load(10**6)
    assert peak[0] > 10

    data = next((tmp_path / "ck" / "data").rglob("*.*"))
    with open(data, "r+b") as f:
        f.truncate(3 << 20)
    with pytest.raises(ckptfs.IntegrityError, match="truncated"):
        load(3)
    assert live[0] == 0
    with pytest.raises(ckptfs.ConfigError, match="read_streams"):
        StoreOptions(read_streams=0)
