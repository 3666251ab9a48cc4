"""ckptfs on Google Cloud Storage with both clients, gcsfs (``client="fsspec"``, GCS's JSON API)
and obstore (``client="obstore"``, the XML API), against fake-gcs-server started by the tests
on a free loopback port (tests/gcs_fixtures.py; skipped with the reason where it is not
installed), through the fault proxy.

Round trips of three backends (every tensor and value exact), a partial load (ranged reads),
``verify``, the atomic commit (GCS's create-if-absent: ``ifGenerationMatch=0``, answered 412;
a second save without overwrite is refused by the store, not by a look first), two writers
saving to one URL at once, and a whole checkpoint deleted. The fault matrix runs GCS cells too
(tests/test_fault_matrix.py).
"""

from __future__ import annotations

import threading

import pytest
import torch

import ckptfs
from ckptfs.io.loop import run_sync
from ckptfs.io.open import open_store

pytestmark = pytest.mark.slow  # starts fake-gcs-server

ENGINES = ("fsspec", "obstore")


def kw(gcs, engine: str) -> dict:
    return {"storage_options": gcs.client_options(engine),
            "store_options": ckptfs.StoreOptions(client=engine, retry_delay=0.01)}


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(9, generator=g).bfloat16(),
            "opt": {"m": torch.arange(seed, seed + 5)}, "step": seed}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("backend", ["safetensors_chunks", "torch_dist", "zarr"])
def test_round_trip_and_ranged_read(gcs, engine, backend):
    k = kw(gcs, engine)
    url = f"{gcs.url}/{backend}"
    ckptfs.save(state(1), url, backend=backend, **k)
    assert same(ckptfs.load_keys(url, **k), state(1))
    tgt = {"w": torch.empty(256, 64), "b": torch.empty(9, dtype=torch.bfloat16),
           "opt": {"m": torch.empty(5, dtype=torch.int64)}, "step": 0}
    ckptfs.load(tgt, url, **k)
    assert same(tgt, state(1))
    gcs.proxy.reset()
    part = ckptfs.load_keys(url, ["opt"], **k)  # one small tensor: a ranged read
    assert same(part, {"opt": state(1)["opt"]})
    data_gets = [r for r in gcs.proxy.log() if r.method == "GET" and "/data/" in r.path.replace("%2F", "/")]
    if backend == "safetensors_chunks":
        assert data_gets and all(r.range for r in data_gets), [(r.path, r.range) for r in data_gets]
    assert ckptfs.verify(url, **k).ok


@pytest.mark.parametrize("engine", ENGINES)
def test_create_if_absent_is_the_stores(gcs, engine):
    """The store's own create-if-absent: a second create of one object is refused with
    FileExistsError after the emulator answered 412, and the first bytes stay."""
    k = kw(gcs, engine)

    async def twice():
        store = await open_store(gcs.url, k["storage_options"], k["store_options"])
        try:
            await store.put_if_absent("marker", b"first")
            with pytest.raises(FileExistsError, match="marker"):
                await store.put_if_absent("marker", b"second")
            return bytes(await store.get("marker"))
        finally:
            await store.close()

    gcs.proxy.reset()
    assert run_sync(twice()) == b"first"
    assert [r.status for r in gcs.proxy.log() if r.method in ("PUT", "POST")] == [200, 412]


@pytest.mark.parametrize("engine", ENGINES)
def test_commit_is_create_if_absent(gcs, engine):
    """A second save without overwrite is refused and the first stays; overwrite replaces it;
    delete removes every object."""
    k = kw(gcs, engine)
    url = f"{gcs.url}/commit"
    ckptfs.save(state(1), url, **k)
    with pytest.raises(ckptfs.CheckpointExistsError, match="commit"):
        ckptfs.save(state(2), url, **k)
    assert same(ckptfs.load_keys(url, **k), state(1))
    ckptfs.save(state(2), url, overwrite=True, **k)
    assert same(ckptfs.load_keys(url, **k), state(2))
    ckptfs.delete(url, **k)
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url, **k)


@pytest.mark.parametrize("engine", ENGINES)
def test_two_writers_one_url(gcs, engine):
    """Two saves to one URL at once: exactly one commits, the other is refused with
    CheckpointExistsError, and the committed one loads exact."""
    k = kw(gcs, engine)
    url = f"{gcs.url}/race"
    results: dict[int, BaseException | None] = {}
    gate = threading.Barrier(2)

    def writer(i: int) -> None:
        gate.wait()
        try:
            ckptfs.save(state(10 + i), url, **k)
            results[i] = None
        except ckptfs.CkptfsError as e:
            results[i] = e

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    winners = [i for i, e in results.items() if e is None]
    assert len(winners) == 1, results
    loser = results[1 - winners[0]]
    assert isinstance(loser, ckptfs.CheckpointExistsError), repr(loser)
    assert same(ckptfs.load_keys(url, **k), state(10 + winners[0]))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_403_is_access_denied_naming_the_url(gcs, engine):
    """Every upload refused with 403 (gcsfs raises a plain OSError "Forbidden", obstore its
    PermissionDeniedError): AccessDeniedError naming the checkpoint, not retried, nothing
    committed."""
    k = kw(gcs, engine)
    url = f"{gcs.url}/denied"
    gcs.proxy.configure(deny=["/upload/", f"/{gcs.bucket}/"])
    with pytest.raises(ckptfs.AccessDeniedError, match="denied"):
        ckptfs.save(state(1), url, **k)
    denied = [r for r in gcs.proxy.log() if r.fault == "deny"]
    gcs.proxy.reset()
    assert len(denied) <= 2, [(r.method, r.path) for r in denied]  # not retried
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url, **k)
