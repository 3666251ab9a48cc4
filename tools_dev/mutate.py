"""Mutation check: break one behaviour at a time in a copy of ckptfs and see which tests notice.

    python -m tools_dev.mutate                      # every mutant against its own tests
    python -m tools_dev.mutate -m delete-index-last -m checksum-off
    python -m tools_dev.mutate --list               # the mutants and what each breaks
    python -m tools_dev.mutate --check              # only that every mutant still applies
    python -m tools_dev.mutate --tree DIR           # mutate and test another checkout (e.g. main)

Each mutant is a named set of text substitutions in ckptfs's source that breaks exactly one
promised behaviour. For each, the script copies the package (``ckptfs/``) to a temporary
directory, applies the substitutions (each must match exactly once; otherwise the mutant is
reported ``stale``: the code moved and the mutant needs updating), and runs the mutant's test
files (optionally narrowed with ``-k``) with that copy first on ``PYTHONPATH``, which spawned
ranks inherit. Mutants that concern the conformance suite also run ``ckptfs conformance`` on
the cases named. A test that fails under a mutant *caught* it. First the same selection runs on
the unmutated copy: tests failing there are left out of the table (they prove nothing).

Not part of ``make test``: one run takes several minutes (``make mutate``). Add a mutant with
every behaviour the README promises that a test is meant to guard.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  #: the default checkout: this one


#: the two-rank async_save scenario's tests (one spawn runs every step: tests/scenarios.py)
ASYNC_SCENARIO = ("staged or staging or failure or flight or collectives or threaded_staging "
                  "or subgroup")


@dataclass(frozen=True)
class Mutant:
    """One broken behaviour: text substitutions in ``ckptfs/<file>`` and the tests to run."""

    name: str
    breaks: str  #: the promise it breaks, in a few words
    edits: tuple[tuple[str, str, str], ...]  #: (file under ckptfs/, old text, new text)
    tests: tuple[str, ...]  #: test files under tests/
    k: str = ""  #: pytest -k expression narrowing the test files ("" = all of them)
    conformance: str = ""  #: -k expression of conformance cases to run too ("" = none)


MUTANTS: tuple[Mutant, ...] = (
    Mutant("data-pkl-any-global",
           "torch_dist's data.pkl unpickler resolves any global",
           (("layout/backends/torch_dist_pickle.py",
             'raise ForbiddenGlobalError(f"data.pkl: global {module}.{name} is not part of a plain tensor")',
             "return super().find_class(module, name)"),),
           ("tests/test_torch_dist.py",), k="not two_d and not two_to_three and not two_and_four"),
    Mutant("delete-index-last",
           "delete removes the data first and the index last",
           (("deletion.py",
             "    if INDEX_FILE in files:\n        await store.delete([INDEX_FILE])\n"
             "    await store.delete([f for f in files if f != INDEX_FILE])\n",
             "    await store.delete([f for f in files if f != INDEX_FILE])\n"
             "    if INDEX_FILE in files:\n        await store.delete([INDEX_FILE])\n"),),
           ("tests/test_s3.py", "tests/test_save_load.py", "tests/test_errors.py"),
           k="not every_backend and not transient and not throttled"),
    Mutant("scratch-never-waits",
           "the read engine's scratch budget counts but never waits",
           (("engine/memory/buffers.py",
             "        held = await self.budget.acquire(nbytes)\n",
             "        held = self.budget._clamp(nbytes)\n        self.budget.used += held\n"
             "        self.budget.peak = max(self.budget.peak, self.budget.used)\n"),),
           ("tests/test_save_load.py",)),
    Mutant("retried-create-not-done",
           "a retried create whose first attempt landed is a conflict",
           (("io/fsspec_store.py", "if not await self.holds(path, data):", "if True:"),
            ("io/obstore_store.py", "if not await self.holds(path, data):", "if True:")),
           ("tests/test_s3.py", "tests/test_io.py"), k="not every_backend and not throttled"),
    Mutant("throttle-failure-skips-rounds",
           "a rank whose upload fails leaves the throttled rounds early",
           (("dist/throttle.py",
             "            except Exception as e:  # re-raised after the rounds: never skip a barrier\n"
             "                error = e\n",
             "            except Exception:  # re-raised after the rounds: never skip a barrier\n"
             "                raise\n"),),
           ("tests/test_s3.py", "tests/test_io.py"), k="throttle"),
    Mutant("checksum-off",
           "the read engine never verifies chunk checksums",
           (("engine/load/schedule.py", "    if not (verify and whole and chunk.checksum is not None):\n",
             "    if True:\n"),),
           ("tests/test_save_load.py", "tests/test_errors.py", "tests/test_conformance.py"),
           k="not wheel and not demo", conformance="flipped or golden_loads"),
    Mutant("whole-chunk-reads",
           "the read engine fetches every raw chunk whole (as DCP does)",
           (("engine/load/schedule.py", "            src = next(it)\n",
             "            src = next(it)\n"
             "            if isinstance(src, RawChunk) and src.stored_shape is None:\n"
             "                src = EncodedChunk(src.file, bytes, src.offset, src.offset + src.nbytes)\n"),),
           ("tests/test_s3.py", "tests/test_save_load.py", "tests/test_torch_dist.py"),
           k="not every_backend and not transient and not throttled and not two_d",
           conformance="reads_only or partial_load"),
    Mutant("obstore-double-retry",
           "obstore retries each request under ckptfs's retries (2 layers)",
           (("io/obstore_store.py",
             "ObstoreStore(client(RetryPolicy(0)), url, options, multipart_store=client(policy))",
             "ObstoreStore(client(policy), url, options, multipart_store=client(policy))"),),
           ("tests/test_s3.py",), k="retries or retried"),
    Mutant("commit-overwrites",
           "the index commit overwrites instead of create-if-absent",
           (("engine/save/commit.py", "        await store.put_if_absent(INDEX_FILE, body)\n",
             "        await store.put(INDEX_FILE, [body])\n"),),
           ("tests/test_save_load.py", "tests/test_s3.py"),
           k="not every_backend and not transient and not throttled"),
    Mutant("partial-saved-as-replicate",
           "a DTensor with a Partial placement is saved as if replicated",
           (("state/shards.py", "        if isinstance(p, Partial):\n", "        if False:\n"),
            ("state/shards.py", "if type(p) is not Shard and not isinstance(p, Replicate):",
             "if type(p) is not Shard and not isinstance(p, Replicate | Partial):"),
            ("state/shards.py", "        if isinstance(p, Replicate):\n",
             "        if isinstance(p, Replicate | Partial):\n")),
           ("tests/test_rank_errors.py",), k="mismatches"),
    Mutant("max-bytes-in-flight-ignored",
           "a store's byte budget for requests in flight is unbounded",
           (("io/store.py", "ByteBudget(self.options.max_bytes_in_flight)", "ByteBudget(None)"),),
           ("tests/test_io.py",), k="budget or flight or multipart"),
    Mutant("upload-copies-whole-file",
           "a multipart upload first joins the whole file in memory",
           (("io/parts.py", "    cur: list[memoryview] = []\n    have = 0\n",
             "    parts = [b''.join(memoryview(p).cast('B') for p in parts)]\n"
             "    cur: list[memoryview] = []\n    have = 0\n"),),
           ("tests/test_io.py",), k="multipart"),
    Mutant("local-reads-whole-spans",
           "the local store reads across gaps of any size",
           (("io/local_store.py",
             "        groups = coalesce(reads, self.options.max_gap, self.options.max_span)\n        tasks",
             "        groups = coalesce(reads, 1 << 40, self.options.max_span)\n        tasks"),),
           ("tests/test_local_store.py",)),
    Mutant("zarr-crc32c-unchecked",
           "zarr's crc32c codec is stripped on read, not verified",
           (("layout/backends/zarr_codecs.py",
             "        for i, c in enumerate(reversed(self.codecs)):\n",
             "        for i, c in enumerate(reversed(self.codecs)):\n"
             "            if isinstance(c, numcodecs.CRC32C):\n"
             "                buf = bytes(_bytes_view(buf))[:-4]\n                continue\n"),),
           ("tests/test_zarr.py",), k="crc or checksum or flipped"),
    Mutant("dcp-items-read-whole",
           "items of DCP-written checkpoints are read whole (torch.load) instead of by range",
           (("layout/backends/torch_dist.py",
             "        if layout.raw_problem(dt.torch, chunk.shape) is None:\n",
             "        if False:\n"),),
           ("tests/test_torch_dist.py",)),
    Mutant("progress-ignored",
           "save(progress=True) shows no progress bar",
           (("engine/save/write.py", "    if progress and files:\n", "    if False:\n"),),
           ("tests/test_save_load.py",), k="progress"),
    Mutant("async-staged-before-copy",
           "async_save resolves `staged` before this rank's bytes are copied",
           (("engine/save/stage.py",
             "        catch_up()\n        if on_copied is not None:\n            on_copied()\n",
             "        catch_up()\n"),
            ("engine/save/stage.py",
             "        taken.append(_take(views, shards, pool, copy, threads, device, on_queued))\n",
             "        if on_copied is not None:\n            on_copied()\n"
             "        __import__('time').sleep(0.5)\n"
             "        taken.append(_take(views, shards, pool, copy, threads, device, on_queued))\n")),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("async-on-callers-group",
           "the background save runs its collectives on the caller's process group",
           (("dist/comm.py", "            if self.size > 1:\n                lane =",
             "            if self.size > 1 and not background:\n                lane ="),),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("async-on-foreground-group",
           "the background save shares ckptfs's foreground group (where a load runs meanwhile)",
           (("dist/comm.py", "lane = (background if isinstance(background, str)\n"
             "                        else BACKGROUND if background else FOREGROUND)\n",
             "lane = FOREGROUND\n"),),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("async-saves-overlap",
           "a second async_save starts while the first is in flight",
           (("engine/background/saver.py", "            self._wait_current()\n            with public_errors",
             "            with public_errors"),
            ("engine/background/saver.py",
             "            self._wait_current()\n            self._hook_exit()\n",
             "            self._hook_exit()\n")),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("save-ignores-async",
           "save() starts while an async save is in flight",
           (("save.py", "    wait_default_idle()\n", ""),),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("staging-not-reused",
           "async saves allocate new staging buffers every time",
           (("engine/memory/buffers.py", "            self._cached[buffer.numel()].append(buffer)\n",
             "            pass\n"),),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("non-finite-saved",
           "check_finite lets a NaN or infinity through",
           (("engine/save/health.py", 'all_true={"clean": not found}', 'all_true={"clean": True}'),),
           ("tests/test_health.py",), k="refuse or non_finite"),
    Mutant("read-only-store-writes",
           "a read-only store accepts writes and deletes",
           (("io/store.py", "        if self.read_only:\n            raise ReadOnlyStoreError",
             "        if False:\n            raise ReadOnlyStoreError"),),
           ("tests/test_stores.py",), k="read_only or ReadOnly or routed"),
    Mutant("async-error-lost",
           "a failed background save resolves `done` without its error",
           (("engine/background/saver.py", "                done.set_exception(e)\n",
             "                done.set_result(None)\n"),),
           ("tests/test_async_save.py",), k=ASYNC_SCENARIO),
    Mutant("claim-kept-when-a-rank-cannot-open",
           "the save lock the coordinator took while a rank failed to open the store is kept",
           (("engine/save/pipeline.py",
             "            abandon_claim(target_of(request, opened[0]), renewals)\n",
             "            pass\n"),),
           ("tests/test_rank_errors.py",), k="mismatches"),
)


@dataclass
class Outcome:
    stale: str = ""  #: why the mutant could not be applied
    tests: list[str] = field(default_factory=list)  #: tests/ cases that caught it
    conformance: list[str] = field(default_factory=list)  #: conformance cases that caught it


def _failed(junit: Path) -> set[str]:
    """Ids of the failed (or erroring) test cases of a junit XML report."""
    if not junit.exists():
        return set()
    out = set()
    for case in ET.parse(junit).getroot().iter("testcase"):
        if any(child.tag in ("failure", "error") for child in case):
            out.add(f"{case.get('classname')}::{case.get('name')}")
    return out


def _copy_package(tree: Path, dest: Path) -> Path:
    pkg = dest / "ckptfs"
    shutil.copytree(tree / "ckptfs", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    return pkg


def _apply(pkg: Path, m: Mutant) -> str:
    """Apply ``m`` to the copy at ``pkg``; '' on success, else why it is stale."""
    for rel, old, new in m.edits:
        path = pkg / rel
        text = path.read_text() if path.exists() else ""
        n = text.count(old)
        if n != 1:
            return f"{rel}: the text to replace occurs {n} times"
        path.write_text(text.replace(old, new))
    return ""


def check(tree: Path, mutants: tuple[Mutant, ...] = MUTANTS) -> list[str]:
    """Why each of ``mutants`` that is stale in ``tree``'s ckptfs/ is stale (no copy, no
    tests): every edit's text must occur exactly once in its file, and the edits of a mutant
    are checked in order, as ``_apply`` makes them."""
    stale = []
    for m in mutants:
        texts: dict[str, str] = {}
        for rel, old, new in m.edits:
            path = tree / "ckptfs" / rel
            if rel not in texts:
                texts[rel] = path.read_text() if path.exists() else ""
            n = texts[rel].count(old)
            if n != 1:
                stale.append(f"{m.name}: {rel}: the text to replace occurs {n} times")
                break
            texts[rel] = texts[rel].replace(old, new)
    return stale


def _run(pkg_root: Path, tests_root: Path, m: Mutant, work: Path, tag: str,
         timeout: int) -> tuple[set[str], set[str], str]:
    """(failed tests, failed conformance cases, note) of ``m``'s selection with ``pkg_root``'s
    ckptfs first on the path."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(pkg_root), str(tests_root),
                                          *filter(None, [os.environ.get("PYTHONPATH")])])}
    where = subprocess.run([sys.executable, "-c", "import ckptfs; print(ckptfs.__file__)"],
                           env=env, capture_output=True, text=True, cwd=work)
    if not where.stdout.startswith(str(pkg_root)):
        raise SystemExit(f"ckptfs is imported from {where.stdout.strip() or where.stderr[-500:]}, "
                         f"not from the copy in {pkg_root}: check PYTHONPATH and editable installs")
    files = [str(tests_root / t) for t in m.tests if (tests_root / t).exists()]
    junit = work / f"{tag}.xml"
    note = ""
    # run from the scratch directory, appending (not prepending) the checkout to sys.path: with
    # pytest's default import mode the checkout's own ckptfs/ would shadow the mutated copy
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--import-mode=append",
           f"--rootdir={tests_root}", "-c", str(tests_root / "pyproject.toml"),
           f"--junitxml={junit}", *files, *(["-k", m.k] if m.k else [])]
    try:
        subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        note = f"tests still running after {timeout} s"
    failed = _failed(junit)
    cfailed: set[str] = set()
    if m.conformance:
        cjunit = work / f"{tag}-conformance.xml"
        golden = tests_root / "examples" / "npy_plugin" / "golden"
        cmd = [sys.executable, "-m", "ckptfs.cli", "conformance", "-q", "-p", "no:cacheprovider",
               f"--junitxml={cjunit}", "-k", m.conformance,
               *(["--golden-dir", str(golden)] if golden.is_dir() else [])]
        try:
            subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            note += f" conformance still running after {timeout} s"
        cfailed = _failed(cjunit)
    return failed, cfailed, note.strip()


def _short(test_id: str) -> str:
    """tests.test_s3::test_x[fsspec] -> test_s3::test_x[fsspec]"""
    where, _, name = test_id.partition("::")
    return f"{where.rsplit('.', 1)[-1]}::{name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--mutant", action="append", default=[], help="run only these (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutant's edits match exactly once (no tests)")
    ap.add_argument("--tree", type=Path, default=REPO,
                    help="checkout whose ckptfs/ is mutated and whose tests/ run; default: this one")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.mutant or m.name in args.mutant]
    unknown = set(args.mutant) - {m.name for m in MUTANTS}
    if unknown:
        ap.error(f"unknown mutant(s) {sorted(unknown)}; --list shows them")
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:32} {m.breaks}")
        return 0
    if args.check:
        stale = check(args.tree.resolve(), tuple(chosen))
        for line in stale:
            print(f"stale: {line}")
        print(f"{len(chosen) - len(stale)} of {len(chosen)} mutants apply")
        return 1 if stale else 0
    tests_root = args.tree.resolve()
    results: dict[str, Outcome] = {}
    baselines: dict[tuple, tuple[set[str], set[str]]] = {}
    with tempfile.TemporaryDirectory(prefix="ckptfs-mutate-") as tmp:
        work = Path(tmp)
        clean = work / "clean"
        _copy_package(tests_root, clean)
        for m in chosen:
            copy = work / m.name
            stale = _apply(_copy_package(tests_root, copy), m)
            if stale:
                results[m.name] = Outcome(stale=stale)
                continue
            selection = (m.tests, m.k, m.conformance)
            if selection not in baselines:  # what fails without any mutation proves nothing
                print(f"[{m.name}] baseline ...", file=sys.stderr, flush=True)
                base_t, base_c, note = _run(clean, tests_root, m, work, f"{m.name}-base", args.timeout)
                if note or base_t or base_c:
                    print(f"[{m.name}] baseline: {note} failing: {sorted(base_t | base_c)}",
                          file=sys.stderr)
                baselines[selection] = (base_t, base_c)
            base_t, base_c = baselines[selection]
            print(f"[{m.name}] mutated ...", file=sys.stderr, flush=True)
            got_t, got_c, note = _run(copy, tests_root, m, work, m.name, args.timeout)
            out = Outcome(tests=sorted(got_t - base_t), conformance=sorted(got_c - base_c))
            if note:  # a hang: pytest-timeout would fail it in CI
                out.tests.append(f"({note})")
            results[m.name] = out
            shutil.rmtree(copy, ignore_errors=True)
    print(f"\nmutants of {tests_root / 'ckptfs'}, tests of {tests_root / 'tests'}\n")
    print("| mutant | breaks | caught by tests/ | caught by conformance |\n|---|---|---|---|")
    caught = 0
    for m in chosen:
        r = results[m.name]
        if r.stale:
            print(f"| {m.name} | {m.breaks} | stale: {r.stale} | |")
            continue
        caught += bool(r.tests)
        t = ", ".join(_short(x) for x in r.tests) or "**nothing**"
        c = ", ".join(_short(x) for x in r.conformance) or ("**nothing**" if m.conformance else "(not run)")
        print(f"| {m.name} | {m.breaks} | {t} | {c} |")
    applied = sum(1 for r in results.values() if not r.stale)
    print(f"\n{caught} of {applied} applied mutants caught by tests/")
    return 0 if caught == applied else 1


if __name__ == "__main__":
    sys.exit(main())
