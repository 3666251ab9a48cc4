"""Golden checkpoints of index minor versions: ``golden/index-<major>.<minor>/``.

A backend's golden directory (golden.py) pins its data layout; an index minor version (formats/
README.md §7) adds optional index members whatever the backend, so its golden directory holds one
checkpoint that uses them. ``golden/index-1.1/`` is the golden state (golden.golden_rank_state)
saved by GOLDEN_WORLD ranks with the default backend and ``stats=True`` (fingerprints, §2.4),
with ``expected.json`` (the state, as golden.py encodes it) and ``SHA256SUMS``.
``golden/index-1.2/`` holds two checkpoints (§2.5): ``base/``, the golden state saved with
content hashes, and ``checkpoint/``, a delta on it (``base="../base"``) of ``delta_reference``:
the golden state with one element of a sharded tensor (rank 1's slice), a replicated tensor and a
value changed, everything else referenced in ``base/``; ``expected.json`` is the delta's state.
``golden/index-1.3/`` is the golden state saved by GOLDEN_WORLD ranks with its index segmented
(§2.6): a root and two segment files, cut by the writer's rules (``split_index``) with one
row per segment as the target, so that each rank's run is its own segment; its packed rows name
their data file by path. ``golden/index-1.4/`` is the same checkpoint cut the same way, its
packed rows numbering the root's file table (required feature ``segment_file_ids``).
Like every golden directory they are written once and never again:

    python -m ckptfs.testing.conformance.golden_index
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import ckptfs
from ckptfs.layout.index import INDEX_FILE, Index
from ckptfs.layout.segment_rows import split_index
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
    rank_part,
)
from ckptfs.testing.ranks import run_ranks

#: minor version -> its golden directory's name
INDEX_GOLDEN = {1: "index-1.1", 2: "index-1.2", 3: "index-1.3", 4: "index-1.4"}
#: the base checkpoint of ``index-1.2``'s delta, beside its ``checkpoint/``
BASE = "base"


def delta_reference() -> dict[str, Any]:
    """The whole state of ``index-1.2``'s delta checkpoint: the golden state, changed a little."""
    state = golden_reference()
    state["sharded"]["rows"][5, 0] += 1.0  # row 5: rank 1's slice; rank 0's stays referenced
    state["keys"]["layers.0.weight"] = torch.full((2,), 2.0)  # replicated: one writer
    state["values"]["step"] = 1235
    return state


def delta_rank_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` holds of ``delta_reference`` (sharded as golden_rank_state)."""
    return rank_part(delta_reference(), rank)


def _save_delta_ranks(rank: int, world: int, root: str) -> None:
    assert world == GOLDEN_WORLD
    ckptfs.save(golden_rank_state(rank), f"{root}/{BASE}", options=ckptfs.SaveOptions(hashes=True))
    ckptfs.save(delta_rank_state(rank), f"{root}/{CHECKPOINT}", base=f"{root}/{BASE}")


def _segment(root: Path, file_ids: bool) -> None:
    """Rewrite the whole index of the checkpoint at ``root`` segmented (§2.6), under the save
    id of its data files; ``file_ids``: packed rows number the file table (1.4), else paths."""
    index = Index.loads((root / INDEX_FILE).read_bytes())
    save_id = next(iter(index.files)).split("/")[1]
    seg_root, files = split_index(index, save_id, rows=1, world=GOLDEN_WORLD, file_ids=file_ids)
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    (root / INDEX_FILE).write_bytes(seg_root.dumps())


def golden_index_dir(minor: int, root: Path = GOLDEN_ROOT) -> Path:
    return root / INDEX_GOLDEN[minor]


def _save_plain_ranks(rank: int, world: int, url: str) -> None:
    assert world == GOLDEN_WORLD
    ckptfs.save(golden_rank_state(rank), url)


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
        if minor == 1:
            run_ranks(GOLDEN_WORLD, _save_ranks, str(d / CHECKPOINT))
        elif minor in (3, 4):
            run_ranks(GOLDEN_WORLD, _save_plain_ranks, str(d / CHECKPOINT))
            _segment(d / CHECKPOINT, file_ids=minor == 4)
        else:
            run_ranks(GOLDEN_WORLD, _save_delta_ranks, str(d))
        want = delta_reference() if minor == 2 else golden_reference()
        doc = {"index": f"1.{minor}", "backend": "safetensors_chunks", "version": 1,
               "world_size": GOLDEN_WORLD, "seed": GOLDEN_SEED, "stats": minor == 1,
               "state": encode(want)}
        if minor == 2:
            doc["base"] = BASE
        (d / EXPECTED).write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n",
                                  encoding="utf-8")
        diffs = differences(ckptfs.load_keys(d / CHECKPOINT), want)
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
    make_index_golden(2)
    make_index_golden(3)
    make_index_golden(4)
    sys.exit(0)
