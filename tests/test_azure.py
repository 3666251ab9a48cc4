"""ckptfs on Azure Blob Storage with both clients, obstore (``client="obstore"``) and adlfs
through fsspec (``client="fsspec"``), against Azurite (the Azure Storage emulator, from npm)
started by the test on a free loopback port; skipped with the reason where ``azurite-blob`` is
not installed. The container is made with the Azure SDK (azure-storage-blob); ckptfs never
creates buckets or containers.

Round trips (every tensor and value exact), a partial load (ranged reads), the atomic commit
(Azure's create-if-absent is ``If-None-Match: *`` on the PUT, answered 409; obstore raises
AlreadyExistsError, adlfs FileExistsError, ckptfs CheckpointExistsError; a second create of one
object is refused by the store itself) and two writers saving to one URL at once.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import threading
import time

import pytest
import torch

import ckptfs
from ckptfs.io.loop import run_sync
from ckptfs.io.open import open_store
from ckptfs.testing.ranks import free_port

pytestmark = pytest.mark.slow  # starts Azurite

#: Azurite's well-known development account (public; documented by Microsoft)
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "ckpt"
ENGINES = ("obstore", "fsspec")


@pytest.fixture(scope="module")
def azurite():
    # `make venv` installs it under .venv/node where npm is present
    local = pathlib.Path(__file__).resolve().parent.parent / ".venv/node/node_modules/.bin"
    exe = shutil.which("azurite-blob", path=f"{local}{os.pathsep}{os.environ.get('PATH', '')}")
    if exe is None:
        pytest.skip("azurite-blob is not installed (node and npm are missing: `make venv` "
                    "installs it with npm)")
    blob = pytest.importorskip("azure.storage.blob", reason="azure-storage-blob makes the container")
    port = free_port()
    proc = subprocess.Popen([exe, "--blobHost", "127.0.0.1", "--blobPort", str(port),
                             "--inMemoryPersistence", "--skipApiVersionCheck", "--silent"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err = proc.stderr.read().decode()[-500:] if proc.stderr else ""
                    pytest.skip(f"Azurite did not start: {err or proc.returncode}")
                time.sleep(0.2)
        endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
        conn = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
                f"BlobEndpoint={endpoint};")
        blob.BlobServiceClient.from_connection_string(conn).create_container(CONTAINER)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # a loaded machine: node may not finish its exit
            proc.kill()
            proc.wait(timeout=30)


def opts(endpoint: str, engine: str = "obstore") -> dict:
    if engine == "obstore":
        so = {"account_name": ACCOUNT, "account_key": KEY, "endpoint": endpoint,
              "client_options": {"allow_http": True}}
    else:  # adlfs: the Azure SDK's connection string names the emulator's endpoint
        pytest.importorskip("adlfs", reason="adlfs is the fsspec client of az://")
        so = {"connection_string": f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};"
                                   f"AccountKey={KEY};BlobEndpoint={endpoint};"}
    return {"storage_options": so,
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
def test_round_trip_and_ranged_read(azurite, backend, engine):
    kw = opts(azurite, engine)
    url = f"az://{CONTAINER}/rt/{engine}/{backend}"
    ckptfs.save(state(1), url, backend=backend, **kw)
    assert same(ckptfs.load_keys(url, **kw), state(1))
    tgt = {"w": torch.empty(256, 64), "b": torch.empty(9, dtype=torch.bfloat16),
           "opt": {"m": torch.empty(5, dtype=torch.int64)}, "step": 0}
    ckptfs.load(tgt, url, **kw)
    assert same(tgt, state(1))
    part = ckptfs.load_keys(url, ["opt"], **kw)  # a ranged read of one small tensor
    assert same(part, {"opt": state(1)["opt"]})
    assert ckptfs.verify(url, **kw).ok


@pytest.mark.parametrize("engine", ENGINES)
def test_create_if_absent_is_the_stores(azurite, engine):
    """The store's own create-if-absent: a second create of one object is refused with
    FileExistsError naming it, and the first bytes stay."""
    kw = opts(azurite, engine)

    async def twice():
        store = await open_store(f"az://{CONTAINER}/create/{engine}", kw["storage_options"],
                                 kw["store_options"])
        try:
            await store.put_if_absent("marker", b"first")
            with pytest.raises(FileExistsError, match="marker"):
                await store.put_if_absent("marker", b"second")
            return bytes(await store.get("marker"))
        finally:
            await store.close()

    assert run_sync(twice()) == b"first"


@pytest.mark.parametrize("engine", ENGINES)
def test_commit_is_create_if_absent(azurite, engine):
    """A second save without overwrite is refused and the first stays; overwrite replaces it;
    delete removes it."""
    kw = opts(azurite, engine)
    url = f"az://{CONTAINER}/commit/{engine}"
    ckptfs.save(state(1), url, **kw)
    with pytest.raises(ckptfs.CheckpointExistsError, match="commit"):
        ckptfs.save(state(2), url, **kw)
    assert same(ckptfs.load_keys(url, **kw), state(1))
    ckptfs.save(state(2), url, overwrite=True, **kw)
    assert same(ckptfs.load_keys(url, **kw), state(2))
    ckptfs.delete(url, **kw)
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url, **kw)


@pytest.mark.parametrize("engine", ENGINES)
def test_two_writers_one_url(azurite, engine):
    """Two saves to one URL at once: exactly one commits, the other is refused with
    CheckpointExistsError (SaveInProgressError while the first holds the lock), and the
    committed one loads exact."""
    kw = opts(azurite, engine)
    url = f"az://{CONTAINER}/race/{engine}"
    results: dict[int, BaseException | None] = {}
    gate = threading.Barrier(2)

    def writer(i: int) -> None:
        gate.wait()
        try:
            ckptfs.save(state(10 + i), url, **kw)
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
    assert same(ckptfs.load_keys(url, **kw), state(10 + winners[0]))
