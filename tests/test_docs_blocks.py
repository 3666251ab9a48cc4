"""Every Python block of README.md and docs/ runs as written, each in its own temporary directory.

A block runs alone, as ``python block.py`` runs it, in a temporary directory of its own with the
checkout first on ``PYTHONPATH``, so it must be self-contained. Plain blocks run one after another
in one long-lived interpreter (tests/block_runner.py: each as ``__main__`` with its own directory,
environment and output, ckptfs closed after it), which saves starting Python and importing torch
for each. A comment on the line before its fence says how else to run it:

- ``<!-- run: torchrun N -->``: as ``torchrun --standalone --nproc-per-node N`` runs it (gloo):
  on N of those interpreters at once, in the same folder, each given the variables torchrun
  gives its processes (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``, ...), without the agent process (real agents launch jobs in
  tests/test_two_node.py and tests/test_hf_export.py);
- ``<!-- run: s3 -->``: against the suite's moto S3 server; the block reads its bucket URL and
  storage options from ``CKPTFS_S3_URL`` and ``CKPTFS_S3_OPTIONS`` (JSON), as a user would
  read their own from the environment;
- ``<!-- run: skip -->``: not run (it needs a real bucket, a GPU or a peer library's own
  checkpoint); the page names its runnable twin in the test suite.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.block_client import block_env as _env
from tests.block_client import torchrun_envs

ROOT = Path(__file__).resolve().parent.parent
MARK = re.compile(r"<!--\s*run:\s*(.*?)\s*-->")
TIMEOUT = 300


@dataclass(frozen=True)
class Block:
    file: str  #: relative to the checkout root
    line: int  #: of the opening fence
    mode: str  #: "python", "torchrun N", "s3" or "skip"
    code: str


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, with the run mark of the line before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            m = MARK.search(prev)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            out.append(Block(str(path.relative_to(ROOT)), i + 1, m.group(1) if m else "python",
                             "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return out


BLOCKS = [b for f in markdown_files() for b in blocks_of(f)]


def test_every_mark_is_known():
    for b in BLOCKS:
        assert b.mode in ("python", "s3", "skip") or re.fullmatch(r"torchrun \d+", b.mode), \
            f"{b.file}:{b.line}: unknown run mark {b.mode!r}"


@pytest.fixture
def s3_env(request):
    """The bucket and options of the suite's moto server (started only for S3 blocks)."""
    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

    endpoint = request.getfixturevalue("moto_server")
    reset_bucket(endpoint)
    return {"CKPTFS_S3_URL": f"s3://{BUCKET}", "CKPTFS_S3_OPTIONS": json.dumps(s3_options(endpoint))}


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.file}:{b.line}" for b in BLOCKS])
@pytest.mark.slow
def test_block_runs(block, tmp_path, request):
    if block.mode == "skip":
        pytest.skip("marked skip: its runnable twin is named on the page")
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    env = _env(request.getfixturevalue("s3_env") if block.mode == "s3" else None)
    n = int(block.mode.split()[1]) if block.mode.startswith("torchrun") else 1
    envs = torchrun_envs(env, n) if block.mode.startswith("torchrun") else [env]
    got = request.getfixturevalue("block_runners").run(script, envs, TIMEOUT)
    for rank, (rc, out) in enumerate(got):
        assert rc == 0, f"{block.file}:{block.line} failed on rank {rank} of {n} ({rc}):\n{out[-8000:]}"


def test_performance_page_tables_come_from_the_json_results():
    """docs/performance.md's current table is what ``tools_dev.perf_page`` makes of the newest
    docs/perf_results/*.json (run it after adding a result file)."""
    from tools_dev import perf_page

    page = perf_page.PAGE.read_text(encoding="utf-8")
    assert perf_page.START in page and perf_page.END in page
    assert perf_page.render(page, perf_page.newest()) == page
