"""The project's text speaks of the software, not of how it was built.

Every tracked text file (README, docs, formats/, the Makefile, the package, bench/, tests/,
examples/) is scanned for words that only make sense to whoever built it: numbered stops or
issues, run letters, absolute paths of one computer, paths to notes outside the project, "this
VM", the sessions it was built in. Measurements belong in
``bench/results/`` and on the documentation's performance page, named by machine and date.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SUFFIXES = {".py", ".md", ".toml", ".yml", ".yaml", ".txt", ".cfg", ".ini", ".json", ".sh", ""}
SKIP_PARTS = ("golden", "fixtures")  # data written by other tools, byte for byte

PATTERNS = {
    "a numbered stop": r"(?i)\bstops?\s+#?\d+",
    "an issue number": r"(?i)\bissues?[\s-]+#?\d+|(?:^|[\s(\[])#\d{1,5}\b(?![-\w])",
    "a run letter": r"\b[Rr]uns?\s+[A-Z]\b(?![\w.-])|\b[Rr]uns?\s+\"[A-Z]\"",
    "a path on one computer": r"(?<![\w.])/(?:work|home|Users|root)/\w",
    "notes outside the project": r"(?:\.\./)+(?:[\w.-]+/)*notes/|\bshared/notes\b",
    "a machine of the builders": r"(?i)\b(?:this|the development|development|my) VM\b",
    "a working session": r"(?i)\b(?:previous|earlier|later|next|this|development|agent|working|"
                         r"coding) session\b|\bsession (?:notes|log)\b",
}
#: what the scan must cover: every tracked text file under these folders, and these files
COVERED = ("bench", "docs", "ckptfs", "tests", "formats", "README.md", "CONTRIBUTING.md",
           "CHANGELOG.md")
ALLOWED = {
    # the scanner's own patterns and the examples in its docstring
    "tests/test_text_scan.py",
}


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = []
    for name in out.stdout.splitlines():
        path = ROOT / name
        if name in ALLOWED or any(p in SKIP_PARTS for p in Path(name).parts):
            continue
        if path.suffix in SUFFIXES and path.is_file():
            files.append(path)
    return files


def scan(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the line) for each hit."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS.items():
            if re.search(pattern, line):
                hits.append((n, what, line.strip()))
    return hits


@pytest.mark.parametrize("line, what", [
    ("as measured at stop 27", "a numbered stop"),
    ("see issue 17 for the bench", "an issue number"),
    ("fixed in #17", "an issue number"),
    ("Run G against run D", "a run letter"),
    ("notes in /work/notes/x.md", "a path on one computer"),
    ("On this VM it took 8 min", "a machine of the builders"),
    ("Issue 17's targets per backend", "an issue number"),
    ("as Stop 4 measured", "a numbered stop"),
    ("see ../shared/notes/anchors.md", "notes outside the project"),
    ("from ../../notes/perf.md", "notes outside the project"),
    ("measured on This VM", "a machine of the builders"),
    ("written in an earlier session", "a working session"),
    ("as this session found", "a working session"),
])
def test_the_scan_finds_each_kind(line, what):
    assert [w for _, w, _ in scan(line)] == [what]


def test_the_scan_leaves_ordinary_text_alone():
    for line in ["x = d['#']  # the 2 ranks", "run the suite", "s3fs sessions are shared",
                 "Shard(0) on 2 ranks; W4 saves", "color: #fff", "step 100 of 200",
                 "https://github.com/ckptfs/ckptfs/issues", "run a save", "/tmp/ckpt",
                 'store.put("notes/a.txt", data)', "step-11/data/x, notes/step-3",
                 "pytorch/pytorch#76331 (open since 2022)", "an aiohttp session per loop",
                 "the stop event is set", "issues of the store"]:
        assert scan(line) == [], line


@pytest.mark.slow
def test_the_scan_covers_the_projects_text():
    scanned = {p.relative_to(ROOT).parts[0] for p in tracked_text_files()}
    assert set(COVERED) <= scanned, sorted(set(COVERED) - scanned)


@pytest.mark.slow
def test_tracked_text_speaks_of_the_software_only():
    hits = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{path.relative_to(ROOT)}:{n}: {what}: {line[:120]}" for n, what, line in scan(text)]
    assert not hits, "\n" + "\n".join(hits)
