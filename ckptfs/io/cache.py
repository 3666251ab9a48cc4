"""The pre-download cache: a checkpoint's files copied into a local work_dir, then read locally.

Layout (one directory per checkpoint URL)::

    <work_dir>/<sha256(url)[:16]>/
        ckptfs.cache.json          done-marker: {"url", "tag", "files": {path: size}}
        .lock                      serialises fillers sharing the directory (flock)
        ckptfs.index.json          the index, as stored
        <relative path>            every downloaded file, same relative path as in the checkpoint

``tag`` identifies the checkpoint version (the index object's ETag/size from one HEAD): a
different tag wipes the directory before it is filled again. A file counts as cached when the
marker lists it and its size on disk matches; files are written to a temp name and renamed, so
a crash never leaves a partial file under its real name.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from ckptfs.errors import IntegrityError
from ckptfs.io.store import Store
from ckptfs.io.tasks import gather_all

MARKER = "ckptfs.cache.json"
LOCK = ".lock"


def cache_dir(work_dir: str | os.PathLike, url: str) -> str:
    """``<work_dir>/<sha256(url)[:16]>``: one directory per checkpoint URL."""
    digest = hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:16]
    return os.path.join(os.path.abspath(os.path.expanduser(os.fspath(work_dir))), digest)


@dataclass(frozen=True)
class Marker:
    url: str
    tag: str
    files: dict[str, int]  #: relative path -> size in bytes


def read_marker(cdir: str) -> Marker | None:
    try:
        with open(os.path.join(cdir, MARKER)) as f:
            d = json.load(f)
        return Marker(d["url"], d["tag"], {k: int(v) for k, v in d["files"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_marker(cdir: str, marker: Marker) -> None:
    tmp = os.path.join(cdir, f".{MARKER}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"url": marker.url, "tag": marker.tag, "files": dict(sorted(marker.files.items()))},
                  f, indent=1)
    os.replace(tmp, os.path.join(cdir, MARKER))


def valid_files(cdir: str, marker: Marker | None, tag: str) -> dict[str, int]:
    """Files of the marker (for ``tag``) whose size on disk still matches."""
    if marker is None or marker.tag != tag:
        return {}
    out = {}
    for path, size in marker.files.items():
        try:
            if os.path.getsize(os.path.join(cdir, *path.split("/"))) == size:
                out[path] = size
        except OSError:
            pass
    return out


@contextlib.contextmanager
def locked(cdir: str) -> Iterator[None]:
    """An exclusive flock on ``<cdir>/.lock`` (fillers on one host take turns)."""
    os.makedirs(cdir, exist_ok=True)
    fd = os.open(os.path.join(cdir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def wipe(cdir: str) -> None:
    """Remove everything but the lock file (and create ``cdir`` if missing)."""
    os.makedirs(cdir, exist_ok=True)
    for name in os.listdir(cdir):
        if name == LOCK:
            continue
        p = os.path.join(cdir, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.unlink(p)


async def fill(store: Store, cdir: str, url: str, tag: str,
               files: Mapping[str, int | None]) -> dict[str, int]:
    """Make ``cdir`` hold ``files`` (relative path -> expected size, None if unknown) for
    checkpoint version ``tag``; download only what is missing. Returns the bytes downloaded
    per file. Call with :func:`locked` held (in a worker thread it is a blocking lock)."""
    marker = read_marker(cdir)
    if marker is None or marker.tag != tag or marker.url != url:
        await asyncio.to_thread(wipe, cdir)
        marker = Marker(url, tag, {})
    have = valid_files(cdir, marker, tag)
    todo = {p: s for p, s in files.items() if p not in have or (s is not None and have[p] != s)}
    got = dict(zip(todo, await gather_all(*(download(store, cdir, p, s) for p, s in todo.items())),
                   strict=True))
    write_marker(cdir, Marker(url, tag, {**have, **got}))
    return got


async def download(store: Store, cdir: str, path: str, size: int | None) -> int:
    """Copy one file into ``cdir``: ``part_size`` ranged reads in parallel (the store bounds
    requests and bytes in flight), written in place into a temp file, checked, renamed."""
    if size is None:
        size = await store.size(path)
    final = os.path.join(cdir, *path.split("/"))
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = f"{final}.part-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.truncate(size)
    step = store.options.part_size

    def write(data, start: int) -> None:  # own fd per piece: a cancelled piece cannot hit a reused fd
        with open(tmp, "r+b") as f:
            os.pwrite(f.fileno(), data, start)

    async def piece(start: int) -> None:
        end = min(size, start + step)
        data = await store.get_range(path, start, end)
        if len(data) != end - start:
            raise IntegrityError(f"{store.full_path(path)}: the index gives {size} bytes, the "
                                 f"store returned {len(data)} bytes at offset {start}")
        await asyncio.to_thread(write, data, start)

    try:
        await gather_all(*(piece(s) for s in range(0, size, step)))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    os.replace(tmp, final)
    return size

