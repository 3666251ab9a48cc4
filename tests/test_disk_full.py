"""A disk that fills up mid-save, on a real small filesystem: a size-limited tmpfs mounted by the
test (root only; skipped with the reason where it cannot mount).

Each trial leaves a different, seeded amount of free space, so the save runs out at a different
point (a data file, the last data file, the index, the lock). Expected: the save raises a ckptfs
error naming the file it could not write; nothing is committed at its URL (no index, partial or
whole); the checkpoint saved before it still loads exact; once space is freed, a save to a new
URL works. (EIO needs a faulty block device, device-mapper's ``error``/``flakey`` targets, which
a container often lacks; not covered here.)
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.layout.index import INDEX_FILE

pytestmark = pytest.mark.slow  # runs mount/umount

SIZE = 2 << 20  #: the filesystem's size


@pytest.fixture
def small_fs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mnt)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=60)


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}": torch.randn(64, 128, generator=g) for i in range(6)} | {"step": seed}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def fill(mnt: Path, leave: int) -> None:
    """Write a filler file so that about ``leave`` bytes stay free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    with open(mnt / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


OPTS = {"max_file_bytes": 64 << 10}  # several data files: the space runs out at varied points


def test_a_full_disk_mid_save_commits_nothing_and_loses_nothing(small_fs):
    prev = small_fs / "prev"
    ckptfs.save(state(0), prev, backend_options=OPTS)
    need = sum(p.stat().st_size for p in prev.rglob("*") if p.is_file())
    rng = random.Random(0)
    outcomes = []
    files: set[str] = set()  #: what the errors named (data files, the index, the lock)
    for trial in range(8):
        leave = rng.randrange(0, need + (need >> 2))
        fill(small_fs, leave)
        url = small_fs / f"new{trial}"
        try:
            ckptfs.save(state(trial + 1), url, backend_options=OPTS)
            outcomes.append("saved")
            assert same(ckptfs.load_keys(url), state(trial + 1))
        except ckptfs.CkptfsError as e:
            outcomes.append(type(e).__name__)
            text = str(e)
            assert str(url) in text, f"the error does not name the checkpoint: {text}"
            assert "No space left on device" in text, text
            named = re.search(re.escape(str(url)) + r"/[^' ]+", text)
            assert named, f"the error does not name the file: {text}"
            files.add(named.group(0).rsplit("/", 1)[-1])
            left = [p.name for p in url.rglob("*") if p.name.startswith(INDEX_FILE)]
            assert not left, f"an index (or its temporary file) was left: {left}"
            with pytest.raises(ckptfs.CheckpointNotFoundError):
                ckptfs.load_metadata(url)
        assert same(ckptfs.load_keys(prev), state(0)), f"trial {trial}: the previous checkpoint"
        (small_fs / "filler").unlink()
        shutil.rmtree(url, ignore_errors=True)
    assert "saved" in outcomes and set(outcomes) - {"saved"}, outcomes  # both ends were reached
    assert len(files) >= 2, files  # the space ran out at different files
    ckptfs.save(state(9), small_fs / "after", backend_options=OPTS)
    assert same(ckptfs.load_keys(small_fs / "after"), state(9))
