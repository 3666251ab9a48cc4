"""Where an export's files go: a local directory, or a prefix on an object store.

A file is written under a staging folder and takes its name only once complete: locally
``DIR/.unshard.partial/`` and a rename; on an object store a local temporary folder of each
rank, then one upload (an object appears whole or not at all) and the local copy removed, so
local disk holds one file at a time. A local ``DIR`` written by several ranks must be visible
to all of them (one machine, or a shared filesystem).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ckptfs.errors import CheckpointExistsError
from ckptfs.io import StoreOptions, open_store, run_sync
from ckptfs.io.open import split_protocol
from ckptfs.io.store import Store

#: the folder of a local out_dir where files are written (each moved out once complete; a
#: torch file keeps its own name, which torch.save writes inside it)
PARTIAL = ".unshard.partial"
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def hf_weights(name: str) -> bool:
    """A file of a Hugging Face export (another export's shards are not mixed with ours)."""
    return name in (HF_SINGLE, HF_INDEX) or (name.startswith("model-") and name.endswith(".safetensors"))


class ExportDir:
    """The destination of one rank's share of an export (``close`` it)."""

    def __init__(self, url: str | os.PathLike, storage_options: Mapping[str, Any] | None = None,
                 store_options: StoreOptions | None = None) -> None:
        self.url = os.fspath(url)
        proto, _ = split_protocol(self.url)
        self.store: Store | None = None
        if proto in ("file", "local"):
            self.root = Path(self.url)
            self.staging = self.root / PARTIAL
        else:
            self.store = run_sync(open_store(self.url, storage_options, store_options))
            self.staging = Path(tempfile.mkdtemp(prefix="ckptfs-export-"))

    def __str__(self) -> str:
        return self.url

    def partial(self, name: str) -> Path:
        """Where the file ``name`` is written."""
        return self.staging / name

    def publish(self, name: str) -> None:
        """The file ``name``, complete, takes its name (locally) or is uploaded."""
        if self.store is None:
            os.replace(self.partial(name), self.root / name)
            return
        path = self.partial(name)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                run_sync(self.store.put(name, [b""]))
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        run_sync(self.store.put(name, [view]))
                    finally:
                        view.release()
        path.unlink()

    def _present(self) -> list[str]:
        if self.store is None:
            return [p.name for p in self.root.iterdir()] if self.root.is_dir() else []
        return [p for p in run_sync(self.store.list("")) if "/" not in p]

    def claim(self, names: list[str], hf: bool, overwrite: bool, resume: bool,
              expected: Mapping[str, tuple[int, bytes]]) -> set[str]:
        """Refuse to replace files (and, for hf, to mix with another export's shards) unless
        ``overwrite`` (every such file is removed first) or ``resume``: the planned files
        already complete are kept and returned, everything else of an earlier export removed.
        Run once, before any rank writes."""
        clash = [n for n in self._present() if n in names or n == PARTIAL or (hf and hf_weights(n))]
        if clash and not (overwrite or resume):
            raise CheckpointExistsError(
                f"{self.url}: {', '.join(sorted(clash)[:5])}{' ...' if len(clash) > 5 else ''} "
                f"already exist(s); pass overwrite=True (--overwrite) to replace them, or "
                f"resume=True (--resume) to finish an interrupted export")
        kept = {n for n in clash if resume and n in expected and self._complete(n, *expected[n])}
        gone = [n for n in clash if n not in kept]
        if self.store is not None:
            run_sync(self.store.delete(gone))
            return kept
        for n in gone:
            if n == PARTIAL:
                shutil.rmtree(self.root / n)
            else:
                (self.root / n).unlink()
        self.staging.mkdir(parents=True)
        return kept

    def _complete(self, name: str, size: int, header: bytes) -> bool:
        """Whether ``name`` is the finished file planned: its size and header as planned (a
        file gets its name only once all its bytes are written)."""
        if self.store is not None:
            if run_sync(self.store.size(name)) != size:
                return False
            return bytes(run_sync(self.store.get_range(name, 0, len(header)))) == header
        path = self.root / name
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            return f.read(len(header)) == header

    def finish(self, index: bytes | None) -> int:
        """After every file: the hf index (last, so its presence means a complete export);
        the staging folder removed. Run once, after every rank wrote."""
        if index is not None:
            if self.store is not None:
                run_sync(self.store.put(HF_INDEX, [index]))
            else:
                self.partial(HF_INDEX).write_bytes(index)
                self.publish(HF_INDEX)
        if self.store is None:
            self.staging.rmdir()
        return 0 if index is None else len(index)

    def close(self) -> None:
        if self.store is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            run_sync(self.store.close())
