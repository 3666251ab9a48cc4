"""Write the golden checkpoint of every registered pair that has none yet; never touch existing ones.

    python -m ckptfs.testing.conformance.make_golden [--backend NAME:VERSION ...] [--golden-dir DIR]

Each new directory ``<golden-dir>/<backend>-<version>/`` gets ``checkpoint/`` (saved by
GOLDEN_WORLD spawned gloo ranks from a fixed seed; for a read-only pair, written by the foreign
tool through golden.FOREIGN_WRITERS), ``expected.json`` (the whole state dict,
encoded by golden.py, not by ckptfs) and ``SHA256SUMS``. It is built in a staging
directory, checked (it must load to its expected values and stay under MAX_BYTES), and only then
moved into place. Commit the new directory; from then on its bytes are frozen.
"""

from __future__ import annotations

import argparse
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
    FOREIGN_WRITERS,
    GOLDEN_ROOT,
    GOLDEN_WORLD,
    MANIFEST,
    GoldenDir,
    expected_document,
    golden_reference,
    manifest_problems,
    manifest_text,
    save_golden_ranks,
)
from ckptfs.testing.conformance.pairs import (
    GOLDEN_REQUIRED,
    Pair,
    import_error,
    is_writable,
    select_pairs,
)
from ckptfs.testing.ranks import run_ranks

MAX_BYTES = 256 * 1024


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_golden(pairs: list[Pair], root: Path, log=print) -> list[Pair]:
    """Generate the missing golden directories of ``pairs`` under ``root``; returns the new ones."""
    root.mkdir(parents=True, exist_ok=True)
    missing = []
    for p in pairs:
        g = GoldenDir(root, p)
        if g.path.exists():
            if not g.exists():
                raise RuntimeError(f"{g.path} exists without {MANIFEST}: inspect it by hand, it is "
                                   "neither golden nor missing")
            log(f"{p}: {g.path} exists, left untouched")
        else:
            missing.append(p)
    if not missing:
        return []
    with tempfile.TemporaryDirectory(dir=root, prefix=".staging-") as tmp:
        staging = Path(tmp)
        written = [p for p in missing if is_writable(p)]
        jobs = [(p.name, p.version, str(staging / p.id / CHECKPOINT)) for p in written]
        if jobs:
            run_ranks(GOLDEN_WORLD, save_golden_ranks, jobs)
        states = {p: golden_reference() for p in written}
        for p in missing:
            if p not in states:  # read-only: written by the foreign tool itself
                writer = FOREIGN_WRITERS.get((p.name, p.version))
                if writer is None:
                    raise RuntimeError(f"{p} is read-only and golden.FOREIGN_WRITERS has no writer for it")
                states[p] = writer(staging / p.id / CHECKPOINT)
        for p in missing:
            d = staging / p.id
            (d / EXPECTED).write_text(json.dumps(expected_document(p, states[p]), ensure_ascii=False,
                                                 indent=1) + "\n", encoding="utf-8")
            diffs = differences(ckptfs.load_keys(d / CHECKPOINT), GoldenDir(staging, p).expected())
            if diffs:
                raise RuntimeError(f"{p}: the new golden checkpoint does not load to its expected "
                                   f"values; nothing was written: {diffs[:5]}")
            (d / MANIFEST).write_text(manifest_text(d), encoding="utf-8")
            assert manifest_problems(d) == []
            size = _dir_bytes(d)
            if size > MAX_BYTES:
                raise RuntimeError(f"{p}: golden directory is {size} bytes (> {MAX_BYTES})")
        for p in missing:
            shutil.move(str(staging / p.id), str(root / p.id))
            log(f"{p}: wrote {root / p.id} ({_dir_bytes(root / p.id)} bytes)")
    return missing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ckptfs.testing.conformance.make_golden", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", action="append", default=[], metavar="NAME:VERSION",
                    help="only this pair (repeatable); default: every registered pair that imports")
    ap.add_argument("--golden-dir", type=Path, default=None,
                    help="where golden directories go (default: the built-in root, for the pairs "
                         "ckptfs ships; a plugin keeps its own beside its package)")
    args = ap.parse_args(argv)
    try:
        pairs = select_pairs(args.backend)
    except ValueError as e:
        ap.error(str(e))
    if args.golden_dir is None:
        foreign = [str(p) for p in pairs if (p.name, p.version) not in GOLDEN_REQUIRED]
        if args.backend and foreign:
            ap.error(f"{foreign} are not built-in pairs: pass --golden-dir (a plugin keeps its "
                     f"golden checkpoints beside its own package)")
        pairs = [p for p in pairs if (p.name, p.version) in GOLDEN_REQUIRED]
        args.golden_dir = GOLDEN_ROOT
    usable = []
    for p in pairs:
        err = import_error(p)
        if err is None:
            usable.append(p)
        elif args.backend:
            ap.error(f"backend {p} cannot be imported: {err}")
        else:
            print(f"{p}: skipped, cannot be imported: {err}")
    make_golden(usable, args.golden_dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
