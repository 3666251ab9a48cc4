"""The options table of the docs, generated from the option classes themselves.

    python -m tools_dev.options_table            # print the Markdown
    python -m tools_dev.options_table --write    # rewrite the generated part of docs/options.md

Each field's description is its ``#:`` comment in the class body (the one place it is written);
tests/test_options.py checks that docs/options.md holds exactly what this prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
from pathlib import Path

import ckptfs

#: the classes, in the order of the table, with the layer each tunes
CLASSES = (
    (ckptfs.StoreOptions, "the store (`store_options=`; `ManagerOptions.store`)"),
    (ckptfs.SaveOptions, "a save (`options=` of `save` / `async_save`; `ManagerOptions.save`)"),
    (ckptfs.LoadOptions, "a load (`options=` of `load` / `load_keys`; `ManagerOptions.load`)"),
    (ckptfs.DistOptions, "what a save and a load share (`SaveOptions.dist`, `LoadOptions.dist`)"),
    (ckptfs.AsyncOptions, "an asynchronous save's writer and staging bound "
     "(`SaveOptions.asynchronous`; `writer=`, `host_memory_limit=`)"),
    (ckptfs.HealthOptions, "a save's health checks (`SaveOptions.health`; `check_finite=`, "
     "`stats=`)"),
    (ckptfs.ManagerOptions, "a checkpoint manager (`CheckpointManager(url, options)`)"),
    (ckptfs.Retention, "the manager's retention (`ManagerOptions.retention`)"),
    (ckptfs.TierOptions, "the manager's recovery tiers (`ManagerOptions.tiers`)"),
    (ckptfs.PreemptionPolicy, "the manager's preemption saves (`ManagerOptions.preemption`)"),
)
#: environment variables ckptfs reads, with what they set
ENVIRONMENT = (
    ("CKPTFS_COLLECTIVE_TIMEOUT", "default of `collective_timeout` (seconds; else 600)"),
    ("CKPTFS_NODE_ID", "this process's node, where the hostname does not tell nodes apart"),
    ("CKPTFS_FAILURE_DOMAIN", "this process's failure domain (a rack, a power feed): a "
     "local step's copies go to nodes of other domains first (``failure_domain=`` wins)"),
    ("CKPTFS_MAX_INDEX_BYTES", "largest index file a reader parses (bytes; else 1 GiB)"),
)
DOC = Path(__file__).resolve().parent.parent / "docs" / "options.md"
BEGIN, END = "<!-- options-table:begin -->", "<!-- options-table:end -->"


def comments(cls: type) -> dict[str, str]:
    """field name -> its ``#:`` comment (the lines above it and a trailing one), from the source."""
    out: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"(\w+)\s*:[^=]*=.*?(?:#:\s*(.*))?$", s)
        if m:
            out[m.group(1)] = " ".join([*pending, m.group(2) or ""]).strip()
        pending = []
    return out


def default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # an option group
        return f"{getattr(f.default_factory, '__name__', 'factory')}()"
    value = f.default
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1024:
        for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
            if value >= 1 << shift and value % (1 << shift) == 0:
                return f"{value >> shift} {unit}"
    if isinstance(value, tuple) and value and all(hasattr(v, "name") for v in value):
        return ", ".join(v.name for v in value)
    return repr(value)


def table() -> str:
    lines = []
    for cls, tunes in CLASSES:
        lines += [f"### `{cls.__name__}`: {tunes}", "", "| field | default | meaning |",
                  "| --- | --- | --- |"]
        text = comments(cls)
        for f in dataclasses.fields(cls):
            desc = text.get(f.name)
            if not desc:
                raise SystemExit(f"{cls.__name__}.{f.name} has no #: comment to document it")
            lines.append(f"| `{f.name}` | `{default_text(f)}` | {desc.replace('|', '/')} |")
        lines.append("")
    lines += ["### Environment variables", "", "| variable | sets |", "| --- | --- |"]
    lines += [f"| `{name}` | {what} |" for name, what in ENVIRONMENT]
    return "\n".join(lines) + "\n"


def generated_part(text: str) -> str:
    """The part of ``text`` between the markers (what ``--write`` rewrites)."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.name}")
    args = ap.parse_args(argv)
    if not args.write:
        sys.stdout.write(table())
        return 0
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table()}{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
