"""The documentation build counts its warnings: the mkdocs command of the Makefile's
``check-docs`` (which ``test`` runs) and ``docs`` targets, run as written on a two-page site, fails on a broken link and passes
without one (``--quiet`` would drop the warnings ``--strict`` counts)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def mkdocs_commands() -> dict[str, list[str]]:
    """Target -> the words of its ``mkdocs build`` recipe line, for ``check-docs`` and ``docs``."""
    out: dict[str, list[str]] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([\w-]+):", line)
        if m:
            target = m.group(1)
        elif line.startswith("\t") and "mkdocs build" in line and target in ("check-docs", "docs"):
            out[target] = shlex.split(line.strip())
    return out


def run(words: list[str], site: Path, out: Path) -> subprocess.CompletedProcess:
    """The Makefile's words, run on ``site``: ``VAR=value`` words go to the environment,
    ``$(BIN)/mkdocs`` is this interpreter's mkdocs, the site dir is ``out``."""
    env = dict(os.environ)
    argv: list[str] = []
    for w in words:
        if not argv and re.fullmatch(r"\w+=.*", w):
            k, _, v = w.partition("=")
            env[k] = v
        elif w == "$(BIN)/mkdocs":
            argv += [sys.executable, "-m", "mkdocs"]
        else:
            argv.append(w)
    argv[argv.index("--site-dir") + 1] = str(out)
    return subprocess.run([*argv, "-f", str(site / "mkdocs.yml")], cwd=site, env=env,
                          capture_output=True, text=True, timeout=300)


def site(root: Path, link: str) -> Path:
    (root / "docs").mkdir(parents=True)
    (root / "mkdocs.yml").write_text("site_name: t\nnav:\n  - index.md\n  - other.md\n")
    (root / "docs" / "index.md").write_text(f"# Home\n\nSee [the spec]({link}).\n")
    (root / "docs" / "other.md").write_text("# Other\n")
    return root


def test_the_makefile_builds_the_docs_strict_and_not_quiet():
    cmds = mkdocs_commands()
    assert set(cmds) == {"check-docs", "docs"}
    test = (ROOT / "Makefile").read_text().split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"\$\(MAKE\).* check-docs ", test), test  # `make test` runs it
    for target, words in cmds.items():
        assert "--strict" in words, target
        assert not {"--quiet", "-q"} & set(words), target


@pytest.mark.slow
@pytest.mark.parametrize("target", ["check-docs", "docs"])
def test_a_broken_link_fails_the_docs_build(tmp_path, target):
    words = mkdocs_commands()[target]
    good = run(words, site(tmp_path / "good", "other.md"), tmp_path / "out-good")
    assert good.returncode == 0, good.stderr
    # a link out of docs/, as a page linking the repository's formats/ would make
    bad = run(words, site(tmp_path / "bad", "../formats/README.md"), tmp_path / "out-bad")
    assert bad.returncode != 0
    said = bad.stdout + bad.stderr
    assert "../formats/README.md" in said and "Aborted" in said, said
