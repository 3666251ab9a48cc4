"""``ckptfs.clean``: remove what an interrupted or failed save left at a URL, never a checkpoint.

``survey`` classifies the files under a root (shared with ``ckptfs.verify``):

- **committed** (an index is there): files the index does not list are leftovers when the index
  lists every file of the checkpoint (written with whole-file checksums); with an older index,
  only other saves' ``data/<save_id>/`` directories, the save lock and index temp files are;
- **interrupted** (no index): with a save lock (``ckptfs.lock``) everything under the root is
  what that save wrote; without one, ``data/<save_id>/`` directories, index temp files and a
  zarr hierarchy whose root group carries ckptfs's attributes are;
- **foreign** (no index, but a backend recognises another tool's checkpoint, e.g. DCP's
  ``.metadata``, which also marks a ckptfs ``torch_dist`` checkpoint whose index was removed by
  an overwriting save that then died): only a save lock, index temp files and ``data/<save_id>/``
  directories its metadata does not use are leftovers.

Files of a checkpoint nested below the root (a directory holding its own index or lock) are
never touched, nor files that none of the rules recognise (listed as unknown). A save lock that
is still being renewed (a save may be running) stops ``clean`` unless ``force=True``.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.engine.errors import public_errors
from ckptfs.engine.index_io import read_index
from ckptfs.engine.save.lock import LEASE_SECONDS, LockInfo, read_lock
from ckptfs.errors import CheckpointNotFoundError, CkptfsError, SaveInProgressError
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.io.store import Store
from ckptfs.layout.index import INDEX_FILE, LOCK_FILE, Index
from ckptfs.options import REMOVED, moved_keywords

_SAVE_DIR = re.compile(r"data/([0-9a-f]{12})/")
#: a create-if-absent's temp file on local disk (io/local_store.py), left by a crash
_INDEX_TEMP = re.compile(f"(?:{re.escape(INDEX_FILE)}|{re.escape(LOCK_FILE)})" + r"\.tmp-[0-9]+-[0-9]+")


@dataclass(frozen=True)
class Survey:
    """What is under a checkpoint root."""

    state: str  #: "committed", "interrupted", "foreign", "empty", "unreadable"
    files: tuple[str, ...]  #: every file under the root
    leftovers: tuple[str, ...]  #: files of interrupted or failed saves (safe to remove)
    unknown: tuple[str, ...]  #: files no rule recognises (left alone)
    nested: tuple[str, ...]  #: directories holding checkpoints of their own (left alone)
    lock: LockInfo | None = None  #: the save lock, when there is a readable one
    lock_present: bool = False
    index: Index | None = None
    save_ids: tuple[str, ...] = ()  #: save ids of the leftover data directories
    note: str = ""

    @property
    def lock_fresh(self) -> bool:
        """A save may be running: its lock is being renewed (or cannot be read)."""
        return self.lock_present and (self.lock is None or not self.lock.stale())

    def describe(self, hint: bool = True) -> str:
        """One line for a person: what the root holds."""
        n = len(self.leftovers)
        ids = f" (save id(s) {', '.join(self.save_ids)})" if self.save_ids else ""
        lock = ""
        if self.lock_present:
            lock = (f"; its lock: {self.lock.describe()}" if self.lock is not None
                    else "; its lock cannot be read")
            lock += (" - a save may still be running" if self.lock_fresh
                     else " - its save is gone (stale lock)")
        if self.state == "interrupted":
            return (f"no committed checkpoint: {n} file(s) of a save that did not finish{ids}"
                    f"{lock}{'; `ckptfs clean URL` removes them' if hint else ''}")
        if self.state == "committed" and n:
            return (f"{n} file(s) that are not part of the committed checkpoint (leftovers of "
                    f"saves that did not finish{ids}){lock}"
                    f"{'; `ckptfs clean URL` removes them' if hint else ''}")
        return self.note or self.state


def survey(store: Store) -> Survey:
    """Classify every file under ``store``'s root (see the module docstring)."""
    files = tuple(run_sync(store.list()))
    nested = _nested(files)
    own = [f for f in files if not any(f.startswith(d + "/") for d in nested)]
    held = run_sync(read_lock(store))
    lock = held if isinstance(held, LockInfo) else None
    present = held is not False
    temps = {f for f in own if _INDEX_TEMP.fullmatch(f)}
    if INDEX_FILE in own:
        try:
            index = Index.loads(bytes(run_sync(store.get(INDEX_FILE))), store.full_path(INDEX_FILE))
        except CkptfsError as e:
            rest = sorted(temps | ({LOCK_FILE} if present else set()))
            return Survey("unreadable", files, tuple(rest), (), nested, lock, present,
                          note=f"the index cannot be read ({e}); only the lock and index temp "
                               f"files count as leftovers")
        listed = set(index.all_files) | {INDEX_FILE}
        if index.complete_manifest:
            left = {f for f in own if f not in listed}
        else:
            used = {m.group(1) for p in listed if (m := _SAVE_DIR.match(p))}
            left = {f for f in own if (m := _SAVE_DIR.match(f)) and m.group(1) not in used}
            left |= temps | ({LOCK_FILE} if present else set())
        unknown = sorted(set(own) - listed - left)
        return Survey("committed", files, tuple(sorted(left)), tuple(unknown), nested, lock,
                      present, index, _ids(left))
    if not own:
        return Survey("empty", files, (), (), nested, note="nothing is stored here")
    try:
        found = run_sync(read_index(store))
    except CheckpointNotFoundError:
        found = None
    except CkptfsError:
        found = None  # a foreign layout that fails to parse is no ckptfs leftover either
    if found is not None:  # loadable through another tool's metadata: keep what it uses
        used = {m.group(1) for p in [*found.all_files, *(c.file for t in found.tensors.values()
                                                         for c in t.chunks if c.file)]
                if (m := _SAVE_DIR.match(p))}
        left = temps | ({LOCK_FILE} if present else set())
        left |= {f for f in own if (m := _SAVE_DIR.match(f)) and m.group(1) not in used}
        return Survey("foreign", files, tuple(sorted(left)), (), nested, lock, present, found,
                      _ids(left), note=f"a checkpoint readable through another tool's metadata "
                                       f"({found.backend}-{found.backend_version} layout, no "
                                       f"{INDEX_FILE}); only files it does not use count as "
                                       f"leftovers")
    whole = present or _ckptfs_zarr(store, own)  # the root belongs to the save that died
    left = set(own) if whole else {f for f in own if _SAVE_DIR.match(f)} | temps
    unknown = sorted(set(own) - left)
    state = "interrupted" if left else "unknown"
    return Survey(state, files, tuple(sorted(left)), tuple(unknown), nested, lock, present,
                  save_ids=_ids(left),
                  note="" if left else "no checkpoint and nothing a ckptfs save writes")


def _nested(files: tuple[str, ...]) -> tuple[str, ...]:
    """Directories below the root that hold an index or a lock of their own."""
    out = {f.rsplit("/", 1)[0] for f in files
           if "/" in f and f.rsplit("/", 1)[1] in (INDEX_FILE, LOCK_FILE)}
    return tuple(sorted(d for d in out if not any(d.startswith(o + "/") for o in out)))


def _ids(paths: set[str]) -> tuple[str, ...]:
    return tuple(sorted({m.group(1) for p in paths if (m := _SAVE_DIR.match(p))}))


def _ckptfs_zarr(store: Store, files: list[str]) -> bool:
    """The root is a zarr group written by ckptfs (its attributes name ckptfs)."""
    for name, attrs in ((".zattrs", lambda d: d), ("zarr.json", lambda d: d.get("attributes"))):
        if name in files:
            try:
                doc = json.loads(bytes(run_sync(store.get(name))))
                return isinstance(attrs(doc), dict) and "ckptfs" in attrs(doc)
            except (ValueError, FileNotFoundError, AttributeError):
                return False
    return False


@dataclass(frozen=True)
class CleanResult:
    """What ``clean`` found and removed."""

    url: str
    state: str
    removed: tuple[str, ...]  #: removed (or, with ``dry_run``, to be removed)
    unknown: tuple[str, ...] = ()  #: left alone: no rule recognises them
    nested: tuple[str, ...] = ()  #: left alone: checkpoints of their own
    dry_run: bool = False
    seconds: float = 0.0
    summary: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "removed": list(self.removed),
                "unknown": list(self.unknown), "nested": list(self.nested),
                "dry_run": self.dry_run, "summary": self.summary, "seconds": round(self.seconds, 3)}


@moved_keywords("clean", REMOVED["store"])
def clean(url: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
          store_options: StoreOptions | None = None, dry_run: bool = False,
          force: bool = False) -> CleanResult:
    """Remove the leftovers of interrupted or failed saves at ``url`` (see ``survey``); a
    committed checkpoint and its files, nested checkpoints and unrecognised files stay. Refuses
    (SaveInProgressError) while a save may be running there (a lock still renewed) unless
    ``force``. ``dry_run`` only lists what would go. Run it when no save to ``url`` runs."""
    t0 = time.perf_counter()
    url = os.fspath(url)
    with public_errors(url):
        store = run_sync(open_store(url, storage_options, store_options))
        try:
            s = survey(store)
            if s.lock_fresh and s.leftovers and not force:
                raise SaveInProgressError(
                    f"{store.full_path(LOCK_FILE)}: {s.describe()}. Nothing was removed; wait "
                    f"until that save ends (a lock not renewed for {LEASE_SECONDS:.0f} s is "
                    f"stale), or pass force=True (--force) if no job is saving to {url}")
            if s.leftovers and not dry_run:
                rest = [f for f in s.leftovers if f != LOCK_FILE]
                run_sync(store.delete(rest))
                if LOCK_FILE in s.leftovers:  # last: the root stays locked until it is clean
                    run_sync(store.delete([LOCK_FILE]))
            return CleanResult(url, s.state, s.leftovers, s.unknown, s.nested, dry_run,
                               time.perf_counter() - t0, s.describe(hint=False))
        finally:
            run_sync(store.close())
