"""The ``ckptfs`` command (also ``python -m ckptfs``): one subcommand per tool.

    ckptfs inspect URL [--json] [--keys PATTERN] [--stats]
    ckptfs diff A B [--json] [--rtol R] [--atol A] [--keys KEY ...] [--buffer-bytes BYTES]
    ckptfs verify URL [--json] [--no-checksums]
    ckptfs clean URL [--dry-run] [--force] [--json]
    ckptfs delete URL [--force] [--missing-ok] [--json]
    ckptfs convert SRC DST --backend NAME[:VERSION] [--backend-option K=V ...] [--overwrite]
    ckptfs unshard URL DIR [--format safetensors|torch|hf] [--strategy one_file|one_file_per_tensor|chunks]
                   [--chunk-size BYTES] [--keys KEY ...] [--overwrite | --resume] [--json]
                   (under torchrun: every process writes its share of the files)
    ckptfs bench [SUITE] [ARGS ...]
    ckptfs conformance [--backend NAME:VERSION ...] [--golden-dir DIR] [pytest args ...]

Every command that reads a checkpoint takes ``--storage-option KEY=VALUE`` (repeatable; VALUE
is JSON when it parses as JSON, a dotted KEY nests: ``client_kwargs.region_name=us-east-1``),
``--storage-options FILE`` (a JSON object; single options override it) and ``-q/--quiet`` (no
progress or summaries). These global flags go before or after the subcommand
(``ckptfs -q convert ...`` and ``ckptfs convert ... -q``); given in both places, the storage
options merge (the subcommand's win). Commands that write take ``--overwrite``.

Exit status (``EXIT_*`` below): 0 ok; 1 the command failed (a ``ckptfs.CkptfsError`` other than
a configuration error, or an I/O error); 2 a usage or configuration error (bad arguments,
options or settings, an unknown or read-only backend: ``ckptfs.ConfigError``); 3 ``verify``
found problems in the checkpoint; 4 ``diff`` found the checkpoints different; 130 interrupted.

Each subcommand is a small module-level ``add_<name>(subparsers)`` that registers its parser and
sets ``run`` (a function of the parsed namespace and the leftover arguments, returning an exit
code). Only subcommands that set ``passthrough`` accept leftover arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import ckptfs
from ckptfs.errors import CkptfsError, ConfigError, UnknownBackendError, UsageError

EXIT_OK = 0
EXIT_FAILED = 1  # a ckptfs error other than a configuration error, or an I/O error
EXIT_USAGE = 2  # bad arguments, options or settings (ckptfs.ConfigError, an unknown backend)
EXIT_PROBLEMS = 3  # verify found problems in the checkpoint
EXIT_INTERRUPTED = 130

# ---------------------------------------------------------------------------- shared options


def parse_assignment(text: str, what: str) -> tuple[list[str], Any]:
    """``KEY=VALUE`` -> (KEY split at dots, VALUE as JSON if it parses, else the string)."""
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"{what} {text!r} is not KEY=VALUE")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.split("."), value


def _assign(out: dict[str, Any], path: list[str], value: Any) -> None:
    node = out
    for p in path[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise UsageError(f"option {'.'.join(path)!r}: {p!r} is already a plain value")
    node[path[-1]] = value


def storage_options(args: argparse.Namespace, prefix: str = "") -> dict[str, Any] | None:
    """storage_options from ``--{prefix}storage-options FILE`` and ``--{prefix}storage-option``."""
    names = [f"{prefix}storage_options_file", f"{prefix}storage_option"]
    if not prefix:  # the global flags (before the subcommand) first, the subcommand's override
        names = [f"global_{n}" for n in names] + names
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name.replace("-", "_"), None)
        if not value:
            continue
        if name.endswith("_file"):
            out.update(_options_file(value))
        else:
            for text in value:
                _assign(out, *parse_assignment(text, "--storage-option"))
    return out or None


def _options_file(file: str) -> dict[str, Any]:
    try:
        out = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"--storage-options {file}: {e}") from None
    if not isinstance(out, dict):
        raise UsageError(f"--storage-options {file}: must hold a JSON object")
    return out


def _common(prefix: str = "", dest_prefix: str = "") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("storage")
    dest = f"{dest_prefix}{prefix}".replace("-", "_")
    g.add_argument(f"--{prefix}storage-option", action="append", default=[], metavar="KEY=VALUE",
                   dest=f"{dest}storage_option",
                   help="an fsspec/s3fs storage option (repeatable); VALUE is JSON if it parses, "
                        "a dotted KEY nests (client_kwargs.region_name=us-east-1)")
    g.add_argument(f"--{prefix}storage-options", dest=f"{dest}storage_options_file",
                   metavar="FILE", help="a JSON file with storage options")
    return p


def _quiet(default: Any = argparse.SUPPRESS) -> argparse.ArgumentParser:
    """``-q/--quiet``; after the subcommand its default is left unset, so the global one stands."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress or summaries")
    return p


def _overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true", help=f"replace {what}")


def _json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def _emit(doc: Any) -> None:
    print(json.dumps(doc, indent=2, ensure_ascii=False, default=str))


def parse_size(text: str) -> int:
    """Bytes: an int, or a number with a unit (KB, MB, GB, TB = powers of 1000; KiB, MiB, GiB,
    TiB = powers of 1024), as Hugging Face's ``max_shard_size`` reads "5GB"."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    t = text.strip().upper()
    num = t.rstrip("KMGTIB")
    try:
        return int(float(num) * units[t[len(num):]])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1000000, 500MB, 2GiB)") from None


# ---------------------------------------------------------------------------- inspect


def run_inspect(args: argparse.Namespace, rest: list[str]) -> int:
    from ckptfs.tools.describe import describe, render
    from ckptfs.tools.source import open_checkpoint

    with open_checkpoint(args.url, storage_options(args)) as src:
        doc = describe(src.url, src.index, src.foreign, args.keys)
    if args.stats:
        from ckptfs.tools.fingerprints import fingerprints, render_fingerprints

        doc["stats"] = fingerprints(src.index, args.keys)
    if args.json:
        _emit(doc)
    else:
        print(render(doc))
        if args.stats:
            print(render_fingerprints(doc["stats"], src.index.format_minor_version >= 1))
    return 0


def add_inspect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect", parents=[_common(), _quiet()], help="show a checkpoint's index: versions, tensors, values",
        description="Show the format and backend versions, the writer, totals, a table of tensors "
                    "(key, dtype, shape, bytes, chunks) and the values of the checkpoint at URL. "
                    "Reads the index only (or, for DCP, Megatron and Hugging Face directories, "
                    "their metadata).")
    p.add_argument("url", metavar="URL", help="the checkpoint: a local path or an fsspec URL (s3://...)")
    p.add_argument("--keys", metavar="PATTERN",
                   help="only keys matching a glob (model/*.weight) or under a key (optim)")
    p.add_argument("--stats", action="store_true",
                   help="also show each tensor's recorded fingerprint (saved with stats=True)")
    _json(p, "the index summary")
    p.set_defaults(run=run_inspect)


# ---------------------------------------------------------------------------- diff


def run_diff(args: argparse.Namespace, rest: list[str]) -> int:
    from ckptfs.tools.diff import EXIT_DIFFERENT, diff

    opts = storage_options(args)
    report = diff(args.a, args.b, keys=args.keys or None, rtol=args.rtol, atol=args.atol,
                  storage_options=opts, buffer_bytes=args.buffer_bytes,
                  progress=not args.quiet and not args.json)
    if args.json:
        _emit(report.to_dict())
    else:
        for k in report.differences:
            where = f" first at {list(k.first_index)}" if k.first_index is not None else ""
            what = (f": {k.differing} element(s), max abs {k.max_abs_diff:.6g}, max rel "
                    f"{k.max_rel_diff:.6g}{where}" if k.status == "differs" and k.dtype_a else
                    f": {k.note}" if k.note else "")
            print(f"{k.status:<10} {k.key}{what}")
        if not args.quiet:
            c = report.counts()
            print(f"{'EQUAL' if report.equal else 'DIFFERENT'}: {c['equal']} equal, "
                  f"{c['differs']} differ, {c['only_in_a']} only in A, {c['only_in_b']} only "
                  f"in B, {c['mismatch']} mismatched; {report.bytes_read} bytes read in "
                  f"{report.seconds:.2f} s")
    return 0 if report.equal else EXIT_DIFFERENT


def add_diff(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diff", parents=[_common(), _quiet()], help="compare two checkpoints key by key "
                                                    "(exit 3 when they differ)",
        description="Compare checkpoints A and B (any backend, format or layout) key by key: "
                    "equal, differs, only in A, only in B, dtype or shape mismatch. Equal chunk "
                    "checksums decide without reading data; otherwise both are streamed in "
                    "bounded memory. Exit 0 equal, 3 different, 1 failed.")
    p.add_argument("a", metavar="A", help="the first checkpoint: a local path or an fsspec URL")
    p.add_argument("b", metavar="B", help="the second checkpoint, compared with A")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0)")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="only these keys or subtrees")
    p.add_argument("--buffer-bytes", type=parse_size, default=64 << 20, metavar="BYTES",
                   help="tensor data read per side at a time (default 64MiB)")
    _json(p, "the report")
    p.set_defaults(run=run_diff)


# ---------------------------------------------------------------------------- verify


def run_verify(args: argparse.Namespace, rest: list[str]) -> int:
    report = ckptfs.verify(args.url, storage_options=storage_options(args),
                           checksums=not args.no_checksums, progress=not args.quiet)
    if args.json:
        _emit(report.to_dict())
    else:
        for p in report.problems:
            print(_cli_wording(str(p), "verify"))
        if not args.quiet:
            for s in report.skipped:
                print(f"skipped: {s}", file=sys.stderr)
            what = (f"{report.tensors} tensors, {report.chunks} chunks ({report.chunks_checksummed} "
                    f"checksums matched, {report.chunks_without_checksum} without checksum), "
                    f"{report.files} files, {report.bytes_read} bytes read")
            verdict = "OK" if report.ok else f"{len(report.problems)} PROBLEM(S)"
            print(f"{verdict}: {report.url}: {what}")
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify", parents=[_common(), _quiet()], help="check a checkpoint end to end (exit 3 on any problem)",
        description="Check the index against the JSON Schema, every data file's presence and size, "
                    "that the chunks of every tensor tile it exactly, and every chunk's crc32c. "
                    "Every problem is reported with its kind, key, chunk and file. Exit 3 on any. "
                    "Reads every byte of the checkpoint once.")
    p.add_argument("url", metavar="URL", help="the checkpoint: a local path or an fsspec URL (s3://...)")
    p.add_argument("--no-checksums", action="store_true",
                   help="skip reading the data (index, files, sizes and tiling only)")
    _json(p, "the report")
    p.set_defaults(run=run_verify)


# ---------------------------------------------------------------------------- clean


def run_clean(args: argparse.Namespace, rest: list[str]) -> int:
    from ckptfs.tools.clean import clean

    result = clean(args.url, storage_options=storage_options(args), dry_run=args.dry_run,
                   force=args.force)
    if args.json:
        _emit(result.to_dict())
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for f in result.removed:
        print(f"{verb} {f}")
    if not args.quiet:
        for f in result.unknown:
            print(f"left alone (not written by a ckptfs save): {f}", file=sys.stderr)
        for d in result.nested:
            print(f"left alone (a checkpoint of its own): {d}/", file=sys.stderr)
        print(f"{result.url}: {result.state}; {verb} {len(result.removed)} file(s)"
              f"{': ' + result.summary if result.removed else ''}")
    return 0


def add_clean(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "clean", parents=[_common(), _quiet()],
        help="remove what interrupted or failed saves left at URL (never a committed checkpoint)",
        description="Remove the files of saves that did not finish: with no index at URL, the "
                    "files a ckptfs save writes (its data directories, its lock, a zarr group "
                    "ckptfs made); beside a committed checkpoint, every file its index does not "
                    "list. A committed checkpoint, checkpoints nested below URL and files no rule "
                    "recognises are left alone. Refuses while a save may be running there (its "
                    "lock is still renewed) unless --force. Run it when no save to URL runs.")
    p.add_argument("url", metavar="URL",
                   help="the checkpoint root: a local path or an fsspec URL (s3://...)")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--force", action="store_true",
                   help="remove a save's files even though its lock is fresh (no job saves there)")
    _json(p, "what was removed")
    p.set_defaults(run=run_clean)


# ---------------------------------------------------------------------------- delete


def run_delete(args: argparse.Namespace, rest: list[str]) -> int:
    removed = ckptfs.delete(args.url, storage_options=storage_options(args), force=args.force,
                            missing_ok=args.missing_ok)
    if args.json:
        _emit({"url": args.url, "removed": removed})
    elif not args.quiet:
        print(f"{args.url}: deleted ({removed} file(s) removed)")
    return 0


def add_delete(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "delete", parents=[_common(), _quiet()],
        help="delete a checkpoint (never the base of a delta beside it, unless --force)",
        description="Remove the checkpoint at URL: its index first (un-commit), then every "
                    "file under it. A checkpoint that a committed checkpoint beside it (in the "
                    "same folder, as a manager's steps are) references as its base is refused, "
                    "naming them, and nothing is removed: delete the deltas first, make them "
                    "self-contained (ckptfs convert), or pass --force (they then fail to load "
                    "their references, naming the missing file).")
    p.add_argument("url", metavar="URL",
                   help="the checkpoint root: a local path or an fsspec URL (s3://...)")
    p.add_argument("--force", action="store_true",
                   help="delete it even though delta checkpoints beside it reference its files")
    p.add_argument("--missing-ok", action="store_true",
                   help="succeed when there is no checkpoint at URL (else exit 1)")
    _json(p, "the number of files removed")
    p.set_defaults(run=run_delete)


# ---------------------------------------------------------------------------- convert


def _backend_pair(text: str) -> tuple[str, int | None]:
    name, sep, version = text.partition(":")
    if not sep:
        return name, None
    try:
        return name, int(version)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: VERSION must be an integer (NAME:VERSION)") from None


def run_convert(args: argparse.Namespace, rest: list[str]) -> int:
    name, version = args.backend
    options: dict[str, Any] = {}
    for text in args.backend_option:
        _assign(options, *parse_assignment(text, "--backend-option"))
    src_opts = storage_options(args)
    dst_opts = storage_options(args, "dst-") if (args.dst_storage_option or args.dst_storage_options_file) \
        else src_opts
    res = ckptfs.convert(args.src, args.dst, backend=name, backend_version=version,
                         backend_options=options or None, overwrite=args.overwrite,
                         storage_options=src_opts, dst_storage_options=dst_opts,
                         progress=not args.quiet)
    if args.json:
        _emit(asdict(res))
    elif not args.quiet:
        print(f"converted {res.src} -> {res.dst}: {res.backend}-{res.backend_version}, "
              f"{res.tensors} tensors, {res.values} values, {res.chunks} chunks, "
              f"{res.bytes_written} bytes in {res.seconds:.2f} s")
    return 0


def add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", parents=[_common(), _common("dst-"), _quiet()],
        help="rewrite a checkpoint with another backend (streaming)",
        description="Write the checkpoint at SRC (any backend, or a DCP, Megatron or Hugging Face "
                    "directory) to DST with another backend, a bounded batch of chunks at a time. "
                    "--dst-storage-option(s) apply to DST (default: the same as SRC's).")
    p.add_argument("src", metavar="SRC", help="the checkpoint to read: a local path or an fsspec URL")
    p.add_argument("dst", metavar="DST", help="where to write the converted checkpoint")
    p.add_argument("--backend", required=True, type=_backend_pair, metavar="NAME[:VERSION]",
                   help="target backend (ckptfs.available_backends(); VERSION: newest if omitted)")
    p.add_argument("--backend-option", action="append", default=[], metavar="K=V",
                   help="a backend option (repeatable), e.g. compressor=zstd")
    _overwrite(p, "a checkpoint at DST")
    _json(p, "the result")
    p.set_defaults(run=run_convert)


# ---------------------------------------------------------------------------- unshard


def run_unshard(args: argparse.Namespace, rest: list[str]) -> int:
    from ckptfs.dist import launcher_world

    with launcher_world() as rank:  # under torchrun: every process writes its share of the files
        res = ckptfs.unshard(args.url, args.dir, format=args.format, strategy=args.strategy,
                             chunk_size=args.chunk_size, keys=args.keys, overwrite=args.overwrite,
                             resume=args.resume, storage_options=storage_options(args),
                             progress=not args.quiet)
    if rank != 0:
        return 0
    if args.json:
        _emit(asdict(res))
    elif not args.quiet:
        kept = f", {len(res.kept)} kept from an earlier run" if res.kept else ""
        print(f"unsharded {args.url} -> {res.out_dir} ({res.format}, {res.strategy}): "
              f"{res.tensors} tensors, {res.values} values, {len(res.files)} file(s){kept}, "
              f"{res.bytes_written} bytes in {res.seconds:.2f} s on {res.ranks} rank(s)")
        for f in res.files:
            print(f"  {f}")
    return 0


def add_unshard(sub: argparse._SubParsersAction) -> None:
    from ckptfs.tools.unshard import FORMATS, STRATEGIES

    p = sub.add_parser(
        "unshard", parents=[_common(), _quiet()],
        help="write whole tensors as safetensors, torch.save or Hugging Face files",
        description="Write the whole tensors of the checkpoint at URL into the directory DIR, "
                    "a bounded batch at a time. safetensors and hf hold tensors only (select them "
                    "with --keys, e.g. --keys model); torch also holds optimizer state and values. "
                    "hf writes model.safetensors, or model-0000i-of-0000N.safetensors shards with "
                    "model.safetensors.index.json (strategies chunks and one_file_per_tensor). "
                    "Under torchrun every process writes its share of the files.")
    p.add_argument("url", metavar="URL", help="the checkpoint: a local path or an fsspec URL (s3://...)")
    p.add_argument("dir", metavar="DIR", help="the directory to write the files into: a local path "
                   "or an fsspec URL (s3://...; each file is staged locally, then uploaded)")
    p.add_argument("--format", choices=FORMATS, default="safetensors", help="the file format")
    p.add_argument("--strategy", choices=STRATEGIES, default="one_file",
                   help="one file, one file per tensor, or files of at most --chunk-size bytes")
    p.add_argument("--chunk-size", type=parse_size, metavar="BYTES",
                   help="file size limit of --strategy chunks (e.g. 5GB, 512MiB)")
    p.add_argument("--keys", nargs="+", action="extend", metavar="KEY",
                   help="only these keys or subtrees; one container (e.g. model) becomes the root")
    _overwrite(p, "existing files in DIR")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted export: keep the files it completed, write the rest")
    _json(p, "the result")
    p.set_defaults(run=run_unshard)


# ---------------------------------------------------------------------------- bench


def _bench_package():
    """The ``bench`` package of a source checkout (it is not part of the installed wheel)."""
    try:
        import bench  # importable when run from the checkout root
    except ImportError:
        root = Path.cwd()
        if not (root / "bench" / "run.py").is_file():
            return None
        sys.path.insert(0, str(root))
        import bench
    return bench


def run_bench(args: argparse.Namespace, rest: list[str]) -> int:
    import importlib
    import pkgutil
    import runpy

    pkg = _bench_package()
    if pkg is None:
        print("ckptfs bench: the benchmarks live in the source tree (bench/), not in the installed "
              "package; run `ckptfs bench` from the root of a ckptfs checkout (git clone the "
              "repository, `make venv`, then `ckptfs bench --help`)", file=sys.stderr)
        return 2
    suites = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__)
                    if m.name == "run" or m.name.endswith("_quick"))
    if args.list:
        for name in suites:
            doc = (importlib.import_module(f"bench.{name}").__doc__ or "").strip().splitlines()
            print(f"{name:<18} {doc[0] if doc else ''}")
        return 0
    if args.suite not in suites:
        print(f"ckptfs bench: no suite {args.suite!r}; suites: {', '.join(suites)}", file=sys.stderr)
        return 2
    argv = sys.argv
    sys.argv = [f"ckptfs bench {args.suite}", *rest]
    try:
        if args.suite == "run":
            return int(importlib.import_module("bench.run").main(rest) or 0)
        runpy.run_module(f"bench.{args.suite}", run_name="__main__")
    except SystemExit as e:  # argparse (--help, bad arguments) and scripts that exit
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return 0


def add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="run the benchmarks (from a source checkout; --list)", add_help=False,
        description="Run a benchmark suite of the source tree's bench/ package: `run` (the default, "
                    "= make bench: ckptfs vs torch.distributed.checkpoint) or a *_quick script. "
                    "Other arguments, --help included, go to the suite (ckptfs bench run --help).")
    p.add_argument("suite", nargs="?", default="run", help="suite name (default: run; --list)")
    p.add_argument("--list", action="store_true", help="list the suites")
    p.set_defaults(run=run_bench, passthrough=True)


# ---------------------------------------------------------------------------- conformance


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


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_inspect, add_diff, add_verify, add_clean, add_delete, add_convert, add_unshard, add_bench,
    add_conformance]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptfs", parents=[_quiet(default=False), _common(dest_prefix="global_")],
        description="ckptfs command-line tools. Global flags (-q, --storage-option(s)) go before "
                    "or after the command. Exit status: 0 ok, 1 the command failed, 2 usage or "
                    "configuration error, 3 verify found problems, 4 diff found differences, "
                    "130 interrupted.")
    parser.add_argument("--version", action="version", version=f"ckptfs {ckptfs.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    for p in sub.choices.values():  # every subcommand's help shows its defaults
        p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status (argparse's own exits included)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args, rest = parser.parse_known_args(argv)
        if rest and not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
    except SystemExit as e:  # --help, --version, usage errors (2)
        return e.code if isinstance(e.code, int) else 0
    if rest[:1] == ["--"]:
        rest = rest[1:]
    prog = f"ckptfs {args.command}"
    try:
        return args.run(args, rest)
    except (ConfigError, UnknownBackendError) as e:  # arguments and settings
        print(f"{prog}: error: {_cli_wording(str(e), args.command)}", file=sys.stderr)
        return EXIT_USAGE
    except (CkptfsError, OSError) as e:
        print(f"{prog}: {type(e).__name__}: {_cli_wording(str(e), args.command)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `ckptfs inspect ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _cli_wording(message: str, command: str) -> str:
    """A library message in the command's words: ``--overwrite`` for ``overwrite=True``, and no
    hint to run the command that is running."""
    message = message.replace("pass overwrite=True (--overwrite)", "pass --overwrite")
    message = message.replace("pass overwrite=True", "pass --overwrite")
    message = message.replace("pass force=True", "pass --force")
    if command == "verify":
        message = re.sub(r"; `ckptfs verify [^`]*` tells which", "", message)
    return message


if __name__ == "__main__":
    sys.exit(main())
