"""EIO from the storage below a local checkpoint, without root and without a faulty device: a
small C library (tests/native/eio_inject.c, built here with the C compiler; skipped with the
reason where there is none) loaded with LD_PRELOAD into a save or load run in a subprocess
makes write, fsync or read calls on chosen files fail with EIO, as the kernel does when a
disk returns a bad sector. (A real faulty block device, device-mapper's ``error`` or ``flakey``
target, needs root and a kernel with device-mapper; tests/test_disk_full.py covers ENOSPC on a
real small filesystem.)

Expected: the save raises a ckptfs error naming the file and the I/O error; nothing is committed
at its URL (no index, partial or whole); the checkpoint saved before it still loads exact. A
load that cannot read a data file raises a ckptfs error naming that file, and loads exact once
the device is sound again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.layout.index import INDEX_FILE

pytestmark = pytest.mark.slow  # builds a library and runs subprocesses

SOURCE = Path(__file__).parent / "native" / "eio_inject.c"
ROOT = Path(__file__).resolve().parent.parent

#: the child: save or load ``url`` and print what happened as one JSON line
CHILD = """
import json, sys, torch, ckptfs
op, url, fsync = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
kw = {"store_options": ckptfs.StoreOptions(fsync=fsync, retries=2, retry_delay=0.01)}
try:
    if op == "save":
        g = torch.Generator().manual_seed(1)
        ckptfs.save({f"layer{i}": torch.randn(64, 128, generator=g) for i in range(6)} | {"step": 1},
                    url, backend_options={"max_file_bytes": 64 << 10}, **kw)
    else:
        ckptfs.load_keys(url, **kw)
    print(json.dumps({"error": None}))
except ckptfs.CkptfsError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


@pytest.fixture(scope="module")
def eio_lib(tmp_path_factory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build the EIO injector (tests/native/eio_inject.c)")
    out = tmp_path_factory.mktemp("eio") / "eio_inject.so"
    r = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(SOURCE), "-ldl"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode:
        pytest.skip(f"the EIO injector does not build here: {r.stderr.strip()[-300:]}")
    return out


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(64, 128, generator=g) for i in range(6)} | {"step": seed}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def under_eio(lib: Path, op: str, url: Path, path: str, ops: str, skip: int = 0,
              fsync: bool = False) -> dict:
    """Run ``op`` (save or load) of ``url`` in a subprocess whose calls ``ops`` on files whose
    path contains ``path`` fail with EIO after ``skip`` of them went through."""
    env = {**os.environ, "LD_PRELOAD": str(lib), "CKPTFS_EIO_PATH": path, "CKPTFS_EIO_OPS": ops,
           "CKPTFS_EIO_SKIP": str(skip), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", CHILD, op, str(url), "1" if fsync else "0"],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_refused_naming(out: dict, url: Path, fragment: str) -> None:
    assert out["error"], "the save went through: the injector did not fail it"
    text = out["message"]
    assert str(url) in text and fragment in text, text
    assert "Input/output error" in text or "EIO" in text, text


def assert_nothing_committed(url: Path) -> None:
    left = [p.name for p in url.rglob("*") if p.name.startswith(INDEX_FILE)] if url.exists() else []
    assert not left, f"an index (or its temporary file) was left: {left}"
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        ckptfs.load_metadata(url)


def test_eio_writing_a_data_file_fails_the_save_and_loses_nothing(eio_lib, tmp_path):
    """The second write to a data file fails with EIO (the first went through)."""
    prev, url = tmp_path / "prev", tmp_path / "new"
    ckptfs.save(state(0), prev)
    out = under_eio(eio_lib, "save", url, f"{url}/data/", "write", skip=1)
    assert_refused_naming(out, url, f"{url}/data/")
    assert_nothing_committed(url)
    assert same(ckptfs.load_keys(prev), state(0))


def test_eio_writing_the_index_commits_nothing(eio_lib, tmp_path):
    prev, url = tmp_path / "prev", tmp_path / "new"
    ckptfs.save(state(0), prev)
    out = under_eio(eio_lib, "save", url, f"{url}/{INDEX_FILE}", "write")
    assert_refused_naming(out, url, INDEX_FILE)
    assert_nothing_committed(url)
    assert same(ckptfs.load_keys(prev), state(0))


def test_eio_on_fsync_fails_the_save(eio_lib, tmp_path):
    """With ``StoreOptions(fsync=True)`` an fsync that reports EIO (the written pages were lost)
    fails the save: a checkpoint whose bytes may not be on the disk is never committed."""
    url = tmp_path / "new"
    out = under_eio(eio_lib, "save", url, f"{url}/data/", "fsync", fsync=True)
    assert_refused_naming(out, url, f"{url}/data/")
    assert_nothing_committed(url)


def test_eio_reading_a_data_file_fails_the_load_naming_it(eio_lib, tmp_path):
    url = tmp_path / "ck"
    ckptfs.save(state(2), url, backend_options={"max_file_bytes": 64 << 10})
    out = under_eio(eio_lib, "load", url, f"{url}/data/", "read")
    assert out["error"], "the load went through: the injector did not fail it"
    assert f"{url}/data/" in out["message"], out["message"]
    assert same(ckptfs.load_keys(url), state(2))  # the device is sound again
