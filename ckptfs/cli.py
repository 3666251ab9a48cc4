"""The ``ckptfs`` command: one subcommand per tool.

    ckptfs conformance [--backend NAME:VERSION ...] [--golden-dir DIR] [pytest args ...]

Each subcommand is a small module-level ``add_<name>(subparsers)`` that registers its parser and
sets ``run`` (a function of the parsed namespace and the leftover arguments, returning an exit
code). Only subcommands that set ``passthrough`` accept leftover arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import ckptfs


def run_conformance(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        import pytest

        import ckptfs.testing.conformance as suite_pkg
    except ImportError as e:
        print(f"ckptfs conformance needs pytest and jsonschema (pip install 'ckptfs[conformance]'): "
              f"{e}", file=sys.stderr)
        return 2
    suite = Path(suite_pkg.__file__).resolve().parent
    # one token per option: pytest reads its ini file before it knows the suite's options,
    # and would take a separate value (a golden directory) for a test path
    argv = [str(suite), "-p", "no:cacheprovider", f"--rootdir={suite}", "-c", str(suite / "pytest.ini")]
    argv += [f"--backend={pair}" for pair in args.backend]
    argv += [f"--golden-dir={Path(d).resolve()}" for d in args.golden_dir]
    return int(pytest.main([*argv, *rest]))


def add_conformance(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "conformance", help="run the conformance suite against registered backends",
        description="Run the ckptfs conformance suite (ckptfs.testing.conformance) with pytest against every "
                    "registered (backend, version) pair, or the ones named by --backend. Other "
                    "arguments go to pytest (e.g. -x, -k golden, -q).")
    p.add_argument("--backend", action="append", default=[], metavar="NAME:VERSION",
                   help="run only this pair (repeatable; NAME alone selects every version)")
    p.add_argument("--golden-dir", action="append", type=Path, default=[], metavar="DIR",
                   help="a root of golden checkpoints searched before the built-in one "
                        "(repeatable): a plugin passes the directory holding its own")
    p.set_defaults(run=run_conformance, passthrough=True)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_conformance]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ckptfs", description="ckptfs command-line tools.")
    parser.add_argument("--version", action="version", version=f"ckptfs {ckptfs.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(argv)
    if rest and not getattr(args, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if rest[:1] == ["--"]:
        rest = rest[1:]
    return args.run(args, rest)


if __name__ == "__main__":
    sys.exit(main())
