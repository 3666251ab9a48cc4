"""The object-store I/O pieces on their own: retry classification and backoff, the byte budget,
multipart pieces (bounded memory on a real moto endpoint), node grouping, throttle rounds that
never hang, the pre-download cache, StoreOptions and obstore option translation."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from types import SimpleNamespace

import fsspec
import pytest
import torch
from botocore.exceptions import ClientError
from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

import ckptfs
from ckptfs.dist.nodes import NodeLayout
from ckptfs.dist.throttle import run_throttled, upload_rounds
from ckptfs.errors import StorageError
from ckptfs.io import run_sync
from ckptfs.io.budget import ByteBudget
from ckptfs.io.cache import MARKER, cache_dir, fill, read_marker
from ckptfs.io.fsspec_store import FsspecStore
from ckptfs.io.local_store import LocalStore
from ckptfs.io.obstore_store import retry_config, s3_config
from ckptfs.io.parts import MIN_PART, join, part_size_for, pieces
from ckptfs.io.ranges import ReadInto
from ckptfs.io.retry import RetryPolicy, is_transient, retrying


def client_error(status: int, code: str) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "x"},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject")


# -- retries ---------------------------------------------------------------------------------
def test_transient_and_permanent_errors_are_told_apart():
    import aiohttp
    from botocore.exceptions import FlexibleChecksumError
    from obstore.exceptions import GenericError, NotFoundError

    transient = [client_error(503, "SlowDown"), client_error(500, "InternalError"),
                 client_error(400, "RequestTimeout"), client_error(429, "TooManyRequests"),
                 ConnectionResetError("reset"), TimeoutError(), aiohttp.ServerDisconnectedError(),
                 GenericError("Generic S3 error: request failed, status: 503 Service Unavailable"),
                 GenericError("Generic S3 error: error sending request: connection closed"),
                 FlexibleChecksumError(error_msg="Expected checksum zqQvMQ== did not match "
                                                 "calculated checksum: AAAAAA=="),
                 # gcsfs parses every answer's JSON body: one that does not parse was damaged
                 json.JSONDecodeError("Invalid control character at", '{"a":"\x01"}', 6)]
    permanent = [client_error(403, "AccessDenied"), client_error(404, "NoSuchKey"),
                 FileNotFoundError("x"), PermissionError("x"), FileExistsError("x"),
                 ValueError("x"), NotFoundError("x"),
                 GenericError("Generic S3 error: request failed, status: 400 Bad Request")]
    # s3fs translates ClientError into OSError subclasses, keeping the original as __cause__
    wrapped = OSError(16, "SlowDown")
    wrapped.__cause__ = client_error(503, "SlowDown")
    transient.append(wrapped)
    denied = PermissionError("Access Denied")
    denied.__cause__ = client_error(403, "AccessDenied")
    permanent.append(denied)
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []


def test_backoff_is_bounded_exponential_with_jitter():
    p = RetryPolicy(retries=6, base_delay=0.1, max_delay=0.5)
    delays = [[p.delay(a) for _ in range(200)] for a in range(6)]
    caps = [0.1, 0.2, 0.4, 0.5, 0.5, 0.5]
    for d, cap in zip(delays, caps):
        assert min(d) >= 0 and max(d) <= cap
        assert len({round(x, 6) for x in d}) > 100  # jittered, not a fixed schedule
    assert max(delays[2]) > 0.2  # the cap grows


def test_retrying_retries_transient_then_gives_up_naming_the_url():
    calls, slept = [], []

    async def sleep(d):
        slept.append(d)

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise client_error(503, "SlowDown")
        return "ok"

    pol = RetryPolicy(retries=4, base_delay=0.01, max_delay=0.05)
    assert asyncio.run(retrying(flaky, "s3://b/k", pol, sleep=sleep)) == "ok"
    assert len(calls) == 3 and len(slept) == 2

    calls.clear()

    async def always():
        calls.append(1)
        raise ConnectionResetError("reset by peer")

    with pytest.raises(StorageError, match=r"s3://b/k: still failing after 5 attempt"):
        asyncio.run(retrying(always, "s3://b/k", pol, sleep=sleep))
    assert len(calls) == 5

    calls.clear()

    async def denied():
        calls.append(1)
        raise PermissionError("s3://b/k: access denied")

    with pytest.raises(PermissionError, match="s3://b/k"):
        asyncio.run(retrying(denied, "s3://b/k", pol, sleep=sleep))
    assert len(calls) == 1  # permanent: no retry


# -- byte budget and ranged reads -------------------------------------------------------------
def test_byte_budget_bounds_ranged_reads_in_flight(memfs):
    """40 far-apart reads of 1000 bytes, a 3000-byte budget: never more than 3 requests'
    bytes in flight inside the filesystem, and every byte lands right."""
    blob = os.urandom(200_000)
    memfs.pipe_file("/b/f.bin", blob)
    cfg = ckptfs.StoreOptions(max_gap=0, max_bytes_in_flight=3000, max_concurrency=64)
    state = {"now": 0, "peak": 0}

    async def go():
        store = FsspecStore(fsspec.filesystem("memory"), "/b", "memory://b", cfg)
        inner = store.fs._cat_file
        full = asyncio.Event()  # the first requests wait here until the budget is used up

        async def tracked(path, start=None, end=None, **kw):
            state["now"] += end - start
            state["peak"] = max(state["peak"], state["now"])
            if state["now"] >= cfg.max_bytes_in_flight:
                full.set()
            try:
                await asyncio.wait_for(full.wait(), 10)  # only a broken bound waits this long
            except TimeoutError:
                pass
            try:
                return await inner(path, start=start, end=end, **kw)
            finally:
                state["now"] -= end - start

        store.fs._cat_file = tracked
        dests = [bytearray(1000) for _ in range(40)]
        await store.read_into("f.bin", [ReadInto(i * 5000, memoryview(d)) for i, d in enumerate(dests)])
        return store, dests

    store, dests = run_sync(go())
    assert all(bytes(d) == blob[i * 5000:i * 5000 + 1000] for i, d in enumerate(dests))
    assert state["peak"] == 3000  # bounded, and the bound was reached (reads ran concurrently)
    assert store.stats.read_requests == 40


def test_byte_budget_lets_an_oversized_request_run_alone():
    async def go():
        b = ByteBudget(100)
        order = []

        async def req(name, n):
            async with b.hold(n):
                order.append((name, b.used))
                await asyncio.sleep(0.01)

        await asyncio.gather(req("small", 60), req("huge", 500), req("small2", 30))
        return order, b.peak

    order, peak = asyncio.run(go())
    assert ("huge", 100) in order and peak <= 100


# -- multipart pieces ------------------------------------------------------------------------
def test_pieces_cut_across_buffers_without_copying():
    bufs = [bytearray(b"a" * 7), bytearray(b"b" * 3), memoryview(bytearray(b"c" * 12))]
    ps = list(pieces(bufs, 5))
    assert [sum(v.nbytes for v in p) for p in ps] == [5, 5, 5, 5, 2]
    assert b"".join(join(p) for p in ps) == b"a" * 7 + b"b" * 3 + b"c" * 12
    ps[0][0][0] = ord("z")  # views share the caller's memory
    assert bufs[0][0] == ord("z")
    assert part_size_for(10, 1) == MIN_PART
    assert part_size_for(10_000 * MIN_PART * 3, MIN_PART) == 3 * MIN_PART


def _most_at_once(records) -> int:
    """Most of ``records`` in flight at the same moment at the proxy (a lower bound of the
    client's own count: the proxy sees a request only while the client waits for it)."""
    events = sorted([(r.t0, 1) for r in records] + [(r.t1, -1) for r in records])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("engine", ["fsspec", "obstore"])
def test_multipart_upload_bounds_parts_in_flight(s3, engine):
    """A 23 MiB file given as 3 buffers, 5 MiB parts, 2 parts per file at once: the upload is
    multipart (ETag "-5"), no part body exceeds part_size, and exactly 2 parts are in flight at
    once (the proxy holds the first parts until 2 are in flight: reaching the bound is proven,
    not timed)."""
    import boto3

    from ckptfs.io import open_store

    data = [os.urandom(9 * 2**20), os.urandom(2**20 + 5), os.urandom(13 * 2**20)]
    part = 5 * 2**20
    cfg = ckptfs.StoreOptions(client=engine, part_size=part, upload_concurrency=2)
    s3.proxy.configure(gate=2, gate_path="/mp/big.bin", gate_query="partNumber", gate_timeout=10)

    async def go():
        store = await open_store(f"{s3.url}/mp", s3.options, cfg)
        try:
            await store.put("big.bin", data)
        finally:
            await store.close()

    run_sync(go())
    client = boto3.client("s3", endpoint_url=s3.direct)
    head = client.head_object(Bucket=s3.bucket, Key="mp/big.bin")
    assert head["ETag"].strip('"').endswith("-5")
    assert client.get_object(Bucket=s3.bucket, Key="mp/big.bin")["Body"].read() == b"".join(data)
    parts = [r for r in s3.proxy.log() if r.method == "PUT" and "partNumber" in r.query]
    assert sorted(r.length for r in parts) == sorted([part] * 4 + [23 * 2**20 + 5 - 4 * part])
    assert _most_at_once(parts) == 2


_UPLOAD_RSS = """
import asyncio, json, os, sys
import ckptfs
from ckptfs.io import open_store, run_sync
endpoint, bucket = sys.argv[1], sys.argv[2]
opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"}}
data = [os.urandom(20 * 2**20) for _ in range(3)]
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
out = {}
for engine in ("fsspec", "obstore"):
    cfg = ckptfs.StoreOptions(client=engine, part_size=5 * 2**20, upload_concurrency=2)
    async def go():
        store = await open_store(f"s3://{bucket}/rss-{engine}", opts, cfg)
        try:
            await store.put("f.bin", [memoryview(b"")])  # clients and pools are warm
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak (VmHWM) to the current RSS
            before = status("VmRSS")
            await store.put("big.bin", data)
            return status("VmHWM") - before
        finally:
            await store.close()
    out[engine] = run_sync(go())
print(json.dumps(out))
"""


def test_multipart_upload_memory_is_bounded(s3):
    """Uploading a 60 MiB file in 5 MiB parts, 2 at a time, raises the uploading process's peak
    resident memory (Linux VmHWM, reset just before, in a fresh process) by well under the file
    (less than 45 MiB; measured: about 22 MiB with s3fs, which holds about 2 copies of each part
    being sent, under 1 MiB with obstore), never by a copy of the whole file (60 MiB and more).
    Both engines."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _UPLOAD_RSS, s3.endpoint, s3.bucket],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    grew = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(n < 45 * 2**20 for n in grew.values()), grew


_EXIT_RACE = """
import threading, time
import obstore
from obstore.store import MemoryStore
from ckptfs.io.loop import get_loop, run_sync
loop = get_loop()
write = loop._write_to_self
def slow_write():
    write()
    if threading.current_thread().name != "ckptfsIO" and threading.current_thread() is not threading.main_thread():
        time.sleep(0.5)  # GIL released: the main thread reaches interpreter exit meanwhile
loop._write_to_self = slow_write
async def put():
    await obstore.put_async(MemoryStore(), "a", b"x")
run_sync(put())
print("done", flush=True)
"""


@pytest.mark.slow
def test_exit_waits_for_a_native_thread_still_handing_a_result_to_the_loop():
    """obstore's tokio thread hands a result to the I/O loop and is still inside
    ``call_soon_threadsafe`` (here: held 0.5 s after writing the wake-up byte) when the program
    ends. Exit waits for it, so the process ends with 0; without the wait the thread takes the
    GIL during finalization and the process aborts (SIGABRT)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _EXIT_RACE], capture_output=True, text=True,
                          timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "done"), proc.stderr[-2000:]


def test_io_loop_counts_threads_handing_it_callbacks():
    """``IOLoop.wait_handed`` times out while a thread is inside ``call_soon_threadsafe`` and
    returns True once it has left."""
    from ckptfs.io.loop import IOLoop

    loop = IOLoop()
    inside, leave = threading.Event(), threading.Event()
    write = loop._write_to_self

    def held_write():
        write()
        inside.set()
        leave.wait(10)

    loop._write_to_self = held_write  # type: ignore[method-assign]
    t = threading.Thread(target=loop.call_soon_threadsafe, args=(lambda: None,))
    t.start()
    try:
        assert inside.wait(10)
        assert loop.wait_handed(0.1) is False
    finally:
        leave.set()
        t.join(10)
    assert loop.wait_handed(5) is True
    loop.close()


def test_max_bytes_in_flight_bounds_ranged_gets(s3):
    """8 ranged GETs of 64 KiB (max_span 64 KiB), max_bytes_in_flight 128 KiB: at most 2 GETs
    in flight at the S3 endpoint, and 2 at once is reached (the proxy holds the first GETs until
    2 are in flight), with both engines."""
    g = torch.Generator().manual_seed(5)
    sd = {f"t{i}": torch.randn(16 * 1024, generator=g) for i in range(8)}  # 64 KiB each
    url = f"{s3.url}/flight"
    ckptfs.save(sd, url, storage_options=s3.options)
    for engine in ("fsspec", "obstore"):
        s3.proxy.reset()
        s3.proxy.configure(gate=2, gate_path="/flight/data/", gate_timeout=10)
        cfg = ckptfs.StoreOptions(client=engine, max_gap=0, max_span=64 * 1024,
                              max_bytes_in_flight=128 * 1024)
        tgt = {k: torch.empty_like(v) for k, v in sd.items()}
        res = ckptfs.load(tgt, url, storage_options=s3.options, store_options=cfg)
        assert all(torch.equal(tgt[k], sd[k]) for k in sd)
        gets = [r for r in s3.proxy.log() if r.method == "GET" and "/data/" in r.path]
        assert len(gets) == res.read_requests == 8, (engine, gets)
        assert _most_at_once(gets) == 2, engine


# -- fsspec writes ---------------------------------------------------------------------------
def _parts() -> list:
    """A file as a save hands it over: bytes, a bytearray, a 2-D float tensor's view, a slice."""
    big = torch.arange(2 * 1024 * 1024, dtype=torch.float32).reshape(1024, 2048)  # 8 MiB
    return [b"head", bytearray(b"xy" * 5), memoryview(big.numpy()),
            memoryview(bytes(range(256)))[10:20]]


@pytest.mark.parametrize("proto", ["file", "memory"])
def test_fsspec_put_writes_exactly_its_bytes_without_a_joined_copy(tmp_path, memfs, proto):
    """Through a plain fsspec filesystem (``file``: generic pipe_file, streamed part by part;
    ``memory``: its own pipe_file, one joined copy) a put writes exactly the parts' bytes and
    counts them (a float view counts its bytes, not its elements); a streamed put holds no copy
    of the file (traced Python memory stays far below the 8 MiB part)."""
    import tracemalloc

    parts = _parts()
    want = b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    fs = fsspec.filesystem(proto, **({"auto_mkdir": True} if proto == "file" else {}))
    root = str(tmp_path) if proto == "file" else "/w"

    async def go():
        store = FsspecStore(fs, root, f"{proto}://{root}")
        tracemalloc.start()
        try:
            await store.put("d/f.bin", parts)
            await store.put("d/one.bin", [parts[2]])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return store.stats, peak

    stats, peak = run_sync(go())
    assert fs.cat_file(f"{root}/d/f.bin") == want
    assert fs.cat_file(f"{root}/d/one.bin") == bytes(memoryview(parts[2]).cast("B"))
    assert (stats.write_requests, stats.bytes_written) == (2, len(want) + 8 * 2**20)
    if proto == "file":
        assert peak < 2**20, f"a streamed put held {peak} bytes of Python memory"


class _FlakyFile(LocalFileOpener):
    """Fails data-file writes after the first bytes: ``left`` times transiently, then (with
    ``full``) as a full disk."""

    left = 0
    full = False

    def write(self, data):
        if "/data/" in self.path and memoryview(data).nbytes > 1024:
            if _FlakyFile.full:
                raise OSError(28, "No space left on device")
            if _FlakyFile.left:
                _FlakyFile.left -= 1
                raise ConnectionResetError(104, "link dropped mid-file")
        return super().write(data)


class _FlakyFs(LocalFileSystem):
    protocol = "flaky"

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(str(path).removeprefix("flaky://"))

    def _open(self, path, mode="rb", block_size=None, **kwargs):
        path = self._strip_protocol(path)
        if "w" in mode:
            self.makedirs(self._parent(path), exist_ok=True)
        return _FlakyFile(path, mode, fs=self, **kwargs)


def test_fsspec_write_failures_retry_the_whole_file_or_leave_no_index(tmp_path):
    """A streamed data file whose write drops mid-file is rewritten from its first byte (the
    checkpoint loads exactly); one that hits a full disk fails the save with an error naming
    the data file, and no index is committed."""
    fsspec.register_implementation("flaky", _FlakyFs, clobber=True)
    state = {"w": torch.randn(256, 64), "step": 3}
    cfg = ckptfs.StoreOptions(retry_delay=0.01)
    try:
        _FlakyFile.left = 2
        ckptfs.save(state, f"flaky://{tmp_path}/a", store_options=cfg)
        assert _FlakyFile.left == 0
        target = {"w": torch.zeros(256, 64), "step": 0}
        ckptfs.load(target, str(tmp_path / "a"))
        assert torch.equal(target["w"], state["w"]) and target["step"] == 3

        _FlakyFile.full = True
        with pytest.raises(StorageError, match=r"flaky://.*/b/data/.*No space left") as e:
            ckptfs.save(state, f"flaky://{tmp_path}/b", store_options=cfg)
        assert isinstance(e.value, ckptfs.CkptfsError)
        assert not (tmp_path / "b" / "ckptfs.index.json").exists()
    finally:
        _FlakyFile.left, _FlakyFile.full = 0, False


# -- nodes and throttled rounds --------------------------------------------------------------
def test_node_layout_and_rounds():
    lay = NodeLayout.from_ids(["a", "a", "b", "a", "b"])
    assert lay.node_of == (0, 0, 1, 0, 1) and lay.local_rank == (0, 1, 0, 2, 1)
    assert lay.num_nodes == 2 and lay.ranks_on(1) == [2, 4] and lay.leader(3) == 0
    assert upload_rounds(lay, 1) == (0, 1, 0, 2, 1)
    assert upload_rounds(lay, 2) == (0, 0, 0, 1, 0)


class ThreadGroup:
    """Comm's collectives over threads (a stand-in for a process group in a unit test)."""

    def __init__(self, n: int) -> None:
        self.n, self.slots, self.barrier = n, [None] * n, threading.Barrier(n, timeout=20)

    def all_gather(self, rank: int):
        def gather(obj, phase: str = ""):  # (Comm.all_gather names its phase)
            self.barrier.wait()
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return gather

    def comm(self, rank: int) -> SimpleNamespace:
        gather = self.all_gather(rank)
        return SimpleNamespace(rank=rank, all_gather=gather,
                               barrier=lambda phase="": gather(None),
                               all_min=lambda vs, phase="": [min(x) for x in zip(*gather(list(vs)))])


def test_throttle_rounds_bound_per_node_and_survive_a_failure(monkeypatch):
    """4 ranks on 2 nodes, K=1: at most one rank of a node inside fn at a time; rank 1 fails in
    its round, every rank still finishes all rounds (no hang) and only rank 1 raises."""
    group = ThreadGroup(4)
    active = {0: set(), 1: set()}
    peak = {0: 0, 1: 0}
    lock = threading.Lock()
    results: dict[int, object] = {}
    ids = ["n0", "n0", "n1", "n1"]
    monkeypatch.setattr("ckptfs.dist.throttle.node_id", lambda: ids[int(threading.current_thread().name)])

    def rank_main(rank: int) -> None:
        def fn():
            node = rank // 2
            with lock:
                active[node].add(rank)
                peak[node] = max(peak[node], len(active[node]))
            threading.Event().wait(0.05)
            with lock:
                active[node].discard(rank)
            if rank == 1:
                raise OSError("upload failed on rank 1")
            return rank * 10

        try:
            results[rank] = run_throttled(1, group.comm(rank), fn)
        except Exception as e:
            results[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,), name=str(r)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert peak == {0: 1, 1: 1}
    assert results[0] == 0 and results[2] == 20 and results[3] == 30
    assert isinstance(results[1], OSError)


def test_no_throttle_runs_at_once_single_process():
    solo = ThreadGroup(1).comm(0)
    assert run_throttled(None, solo, lambda: 7) == 7
    with pytest.raises(ValueError, match="throttle_uploads"):
        run_throttled(0, solo, lambda: 7)


# -- pre-download cache ----------------------------------------------------------------------
def test_cache_fill_reuses_verifies_and_wipes(tmp_path):
    src = tmp_path / "ckpt"
    (src / "data").mkdir(parents=True)
    blobs = {"data/a.bin": os.urandom(3000), "data/b.bin": os.urandom(10), "meta.json": b"{}"}
    for p, b in blobs.items():
        (src / p).write_bytes(b)
    cdir = cache_dir(tmp_path / "work", "s3://bucket/ckpt")
    assert cdir.startswith(str(tmp_path / "work")) and len(os.path.basename(cdir)) == 16
    cfg = ckptfs.StoreOptions(part_size=1024)

    def run(files, tag="v1"):
        store = LocalStore(str(src), cfg)
        got = run_sync(fill(store, cdir, "s3://bucket/ckpt", tag, files))
        return got, store.stats.read_requests

    got, nreq = run({"data/a.bin": 3000, "meta.json": None})
    assert got == {"data/a.bin": 3000, "meta.json": 2} and nreq == 3 + 1  # 3 pieces of 1 KiB
    assert (tmp_path / "work" / os.path.basename(cdir) / "data" / "a.bin").read_bytes() == blobs["data/a.bin"]
    assert read_marker(cdir).files == {"data/a.bin": 3000, "meta.json": 2}
    # same version again: nothing fetched; a new file: only that one
    assert run({"data/a.bin": 3000, "meta.json": None}) == ({}, 0)
    assert run({"data/a.bin": 3000, "data/b.bin": 10}) == ({"data/b.bin": 10}, 1)
    # a damaged cached file (wrong size) is fetched again
    with open(os.path.join(cdir, "data", "a.bin"), "ab") as f:
        f.write(b"junk")
    assert run({"data/a.bin": 3000}) == ({"data/a.bin": 3000}, 3)
    # a size that disagrees with the index is an error naming the file
    with pytest.raises(ckptfs.IntegrityError, match="b.bin"):
        run({"data/b.bin": 11}, tag="v2")
    # a new checkpoint version wipes the old files
    run({"meta.json": None}, tag="v3")
    assert sorted(os.listdir(cdir)) == [MARKER, "meta.json"]


# -- config and option translation -----------------------------------------------------------
def test_store_options_validate_client_and_sizes():
    with pytest.raises(ckptfs.ConfigError, match="StoreOptions.client"):
        ckptfs.StoreOptions(client="boto")
    with pytest.raises(ckptfs.ConfigError, match="StoreOptions.part_size"):
        ckptfs.StoreOptions(part_size=0)
    assert ckptfs.StoreOptions(client="obstore").retry_policy.retries == 5


def test_obstore_takes_s3fs_style_options():
    cfg, client = s3_config({"endpoint_url": "http://127.0.0.1:9", "key": "k", "secret": "s",
                             "client_kwargs": {"region_name": "eu-west-1"},
                             "config_kwargs": {"max_pool_connections": 4}, "anon": False})
    assert cfg == {"endpoint": "http://127.0.0.1:9", "access_key_id": "k", "secret_access_key": "s",
                   "region": "eu-west-1"}
    assert client == {"allow_http": True}
    rc = retry_config(RetryPolicy(3, 0.5, 4.0))
    assert rc["max_retries"] == 3 and rc["backoff"]["max_backoff"].total_seconds() == 4.0


def test_gather_all_cancels_the_rest_on_failure():
    """A failed request must not leave its siblings running (they would keep uploading or
    writing into targets after save/load raised)."""
    from ckptfs.io.tasks import gather_all

    finished = []

    async def slow(i):
        await asyncio.sleep(5)
        finished.append(i)

    async def fail():
        await asyncio.sleep(0.01)
        raise PermissionError("s3://b/k: access denied")

    async def go():
        with pytest.raises(PermissionError, match="s3://b/k"):  # the error itself, not a group
            await gather_all(slow(1), fail(), slow(2))
        await asyncio.sleep(0.05)
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(go()) == [] and finished == []
    assert asyncio.run(gather_all(asyncio.sleep(0, result=1), asyncio.sleep(0, result=2))) == [1, 2]
