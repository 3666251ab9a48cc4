"""Golden checkpoints of index minor versions: ``golden/index-<major>.<minor>/``.

A backend's golden directory (golden.py) pins its data layout; an index minor version (formats/
README.md §7) adds optional index members whatever the backend, so its golden directory holds one
checkpoint that uses them. ``golden/index-1.1/`` is the golden state (golden.golden_rank_state)
saved by GOLDEN_WORLD ranks with the default backend and ``stats=True`` (fingerprints, §2.4),
with ``expected.json`` (the state, as golden.py encodes it) and ``SHA256SUMS``. Like every golden
directory it is written once and never again:

    python -m ckptfs.testing.conformance.golden_index
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import ckptfs
from ckptfs.testing.conformance.cases import differences
from ckptfs.testing.conformance.golden import (
    CHECKPOINT,
    EXPECTED,
    GOLDEN_ROOT,
    GOLDEN_SEED,
    GOLDEN_WORLD,
    MANIFEST,
    encode,
    golden_rank_state,
    golden_reference,
    manifest_problems,
    manifest_text,
)
from ckptfs.testing.ranks import run_ranks

#: minor version -> its golden directory's name
INDEX_GOLDEN = {1: "index-1.1"}


def golden_index_dir(minor: int, root: Path = GOLDEN_ROOT) -> Path:
    return root / INDEX_GOLDEN[minor]


def _save_ranks(rank: int, world: int, url: str) -> None:
    assert world == GOLDEN_WORLD
    ckptfs.save(golden_rank_state(rank), url, stats=True)


def make_index_golden(minor: int, root: Path = GOLDEN_ROOT, log=print) -> bool:
    """Write the golden directory of index 1.``minor`` unless it exists; True if written."""
    target = golden_index_dir(minor, root)
    if target.exists():
        log(f"{target} exists, left untouched")
        return False
    with tempfile.TemporaryDirectory(dir=root, prefix=".staging-") as tmp:
        d = Path(tmp) / target.name
        run_ranks(GOLDEN_WORLD, _save_ranks, str(d / CHECKPOINT))
        doc = {"index": f"1.{minor}", "backend": "safetensors_chunks", "version": 1,
               "world_size": GOLDEN_WORLD, "seed": GOLDEN_SEED, "stats": True,
               "state": encode(golden_reference())}
        (d / EXPECTED).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n",
                                  encoding="utf-8")
        diffs = differences(ckptfs.load_keys(d / CHECKPOINT), golden_reference())
        if diffs:
            raise RuntimeError(f"the new golden checkpoint does not load to its expected values: "
                               f"{diffs[:5]}")
        (d / MANIFEST).write_text(manifest_text(d), encoding="utf-8")
        assert manifest_problems(d) == []
        shutil.move(str(d), str(target))
    log(f"wrote {target}")
    return True


if __name__ == "__main__":
    make_index_golden(1)
    sys.exit(0)
