"""The conformance suite (ckptfs.testing.conformance) in the main test run: ``ckptfs conformance``,
run from a wheel installed in a fresh virtual environment (no source tree on the path), passes for
every built-in pair and for the example plugin with its own golden directory; a changed golden
byte makes it fail; make_golden only adds missing directories; the example plugin is found by
entry point, and a broken entry point does not break ckptfs."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.cli import build_parser
from ckptfs.layout import registry
from ckptfs.runtime import RUNTIME
from ckptfs.testing.conformance.golden import GOLDEN_ROOT, GoldenDir, manifest_problems
from ckptfs.testing.conformance.make_golden import make_golden
from ckptfs.testing.conformance.pairs import GOLDEN_REQUIRED, Pair, is_writable, parse_pair

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "examples" / "npy_plugin"
PLUGIN_GOLDEN = PLUGIN / "golden"
BUILT_IN = [Pair(n, v) for n, v in sorted(GOLDEN_REQUIRED)]
NPY = Pair("npy_chunks", 1)


def _ckptfs_cli(*args: str, cwd: Path, timeout: int = 280) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfs.cli", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def _outcomes(junit: Path) -> dict[str, str]:
    """test id -> passed | skipped | failed, from a junit XML report."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed"
            elif child.tag == "skipped" and state == "passed":
                state = "skipped"
        out[f"{case.get('classname')}::{case.get('name')}"] = state
    return out


def _failure_text(junit: Path, name: str) -> str:
    """The failure messages of the junit cases whose name starts with ``name``."""
    return "\n".join(child.get("message", "") + (child.text or "")
                     for case in ET.parse(junit).getroot().iter("testcase")
                     if case.get("name", "").startswith(name)
                     for child in case if child.tag in ("failure", "error"))


def _pair_outcomes(outcomes: dict[str, str], pair: Pair) -> dict[str, str]:
    return {k: v for k, v in outcomes.items() if f"[{pair.id}" in k or f"->{pair.id}]" in k}


def test_example_plugin_is_registered_by_entry_point() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="ckptfs.backends")}
    assert eps.get("npy_chunks_1") == "ckptfs_example_npy:NpyChunksBackend", (
        "the example plugin is not installed: pip install --no-deps -e examples/npy_plugin "
        "(make venv does it)")
    cls = ckptfs.get_backend("npy_chunks", 1)
    assert cls.__module__ == "ckptfs_example_npy" and ("npy_chunks", 1) in ckptfs.available_backends()


def _site_packages() -> str:
    import sysconfig

    return sysconfig.get_paths()["purelib"]


def _copy_tracked(repo: Path, dst: Path) -> None:
    """The files git tracks (what a clean clone has: an ignored or untracked file the package
    needs is missing here too); the whole tree when this is not a git checkout."""
    try:
        out = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(repo, dst, ignore=shutil.ignore_patterns(".git", ".venv", "build", "__pycache__"))
        return
    for rel in filter(None, out.decode().split("\0")):
        src = repo / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel, follow_symlinks=False)


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the ckptfs wheel and the example plugin (both installed, not
    editable); the dependencies come from this venv's site-packages through a .pth line, which
    does not run this venv's editable-install hooks, so ckptfs can only come from the wheel."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    src = root / "src"  # a copy: building in place would leave build/ (stale modules) in the tree
    _copy_tracked(REPO, src)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("ckptfs-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "_deps_from_test_venv.pth").write_text(_site_packages() + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    for target in (str(wheel), str(src / "examples" / "npy_plugin")):
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--no-index", target], check=True, capture_output=True, env=env, cwd=root,
                       timeout=300)
    return venv


@pytest.mark.slow
@pytest.mark.extended  # the same suite runs in-process in `make test`
@pytest.mark.timeout(900)  # the whole suite over every pair, in a subprocess (about 90 s quiet)
def test_conformance_passes_from_an_installed_wheel(wheel_venv: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    where = subprocess.run([str(wheel_venv / "bin" / "python"), "-c", "import ckptfs; print(ckptfs.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout
    assert str(wheel_venv) in where and str(REPO) not in where, where
    junit = tmp_path / "junit.xml"
    proc = subprocess.run([str(wheel_venv / "bin" / "ckptfs"), "conformance", "--golden-dir", str(PLUGIN_GOLDEN),
                           "-q", "--tb=short", f"--junitxml={junit}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"ckptfs conformance failed (rc {proc.returncode}):\n{proc.stdout[-6000:]}"
    outcomes = _outcomes(junit)
    for pair in [*BUILT_IN, NPY]:
        mine = _pair_outcomes(outcomes, pair)
        passed = [k for k, v in mine.items() if v == "passed"]
        if not is_writable(pair):  # read-only: the reading cases, on its foreign golden checkpoint
            musts = ("test_golden_bytes_are_unchanged", "test_golden_loads_to_expected_values",
                     "test_native_reader", "test_index_matches_schema",
                     "test_convert_to_other_backend_and_back")
            assert all(v in ("passed", "skipped") for v in mine.values()), mine
        else:
            assert len(passed) >= 40, f"{pair}: only {len(passed)} conformance cases passed: {mine}"
            musts = ("test_golden_bytes_are_unchanged", "test_golden_loads_to_expected_values",
                     "test_reshard_save_world_to_load_world", "test_ten_thousand_small_tensors")
        for must in musts:
            assert any(must in k for k in passed), f"{pair}: {must} did not pass"


@pytest.mark.slow
def test_changed_golden_byte_makes_the_suite_fail(tmp_path: Path) -> None:
    golden = tmp_path / "golden"
    shutil.copytree(GOLDEN_ROOT, golden)
    shutil.copytree(PLUGIN_GOLDEN / NPY.id, golden / NPY.id)
    g = GoldenDir(golden, Pair("safetensors_chunks", 1))
    data = sorted((g.checkpoint / "data").rglob("*.safetensors"))[0]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # last byte: tensor data
    data.write_bytes(bytes(raw))
    junit = tmp_path / "junit.xml"
    proc = _ckptfs_cli("conformance", "--backend", "safetensors_chunks:1", "--backend", "npy_chunks:1",
                       "--golden-dir", str(golden), "-k", "golden_bytes or golden_loads", "-q",
                       f"--junitxml={junit}", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout[-4000:]
    assert f"{data.relative_to(g.path).as_posix()}: sha256 differs from SHA256SUMS" in proc.stdout
    assert "golden checkpoints are frozen" in proc.stdout
    outcomes = _outcomes(junit)
    st = _pair_outcomes(outcomes, g.pair)
    assert st and all(v == "failed" for v in st.values()), st  # hashes, and the load
    loads = _failure_text(junit, "test_golden_loads_to_expected_values")
    assert "IntegrityError" in loads and "fails its checksum" in loads, loads[-2000:]  # not "differs"
    npy = _pair_outcomes(outcomes, NPY)
    assert npy and all(v == "passed" for v in npy.values()), npy  # the untouched one still passes


def test_cli_parses_pairs_and_passes_pytest_args() -> None:
    args, rest = build_parser().parse_known_args(
        ["conformance", "--backend", "zarr:3", "-k", "golden and not cross", "-x", "--golden-dir", "g"])
    assert args.backend == ["zarr:3"] and [str(d) for d in args.golden_dir] == ["g"]
    assert rest == ["-k", "golden and not cross", "-x"]
    with pytest.raises(ValueError, match=r"no_such_backend:7.*registered backends: .*safetensors_chunks:1"):
        parse_pair("no_such_backend:7")
    assert parse_pair("safetensors_chunks") == [Pair("safetensors_chunks", 1)]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["no-such-command"])


def _digests(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_make_golden_adds_missing_directories_only(tmp_path: Path) -> None:
    st, npy = Pair("safetensors_chunks", 1), NPY
    shutil.copytree(GoldenDir(GOLDEN_ROOT, st).path, GoldenDir(tmp_path, st).path)
    before = _digests(tmp_path)
    assert make_golden([st, npy], tmp_path, log=lambda _: None) == [npy]
    after = _digests(tmp_path)
    assert {k: v for k, v in after.items() if k.startswith(st.id)} == before, "existing golden rewritten"
    new = GoldenDir(tmp_path, npy)
    assert manifest_problems(new.path) == []
    committed = GoldenDir(PLUGIN_GOLDEN, npy)
    assert new.expected_file.read_bytes() == committed.expected_file.read_bytes(), \
        "golden content is not reproducible from its seed"
    assert make_golden([st, npy], tmp_path, log=lambda _: None) == []
    assert _digests(tmp_path) == after
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".staging")]


def _fake_distribution(root: Path, name: str, eps: dict[str, str]) -> None:
    info = root / f"{name}-0.0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.0.1\n")
    lines = "".join(f"{k} = {v}\n" for k, v in eps.items())
    (info / "entry_points.txt").write_text(f"[ckptfs.backends]\n{lines}")


def test_broken_entry_point_does_not_break_ckptfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    site = tmp_path / "site"
    _fake_distribution(site, "ckptfs_broken_plugin", {
        "missing_module": "ckptfs_no_such_module:Backend",
        "raising_module": "ckptfs_raising_plugin:Backend",
    })
    (site / "ckptfs_raising_plugin.py").write_text("raise RuntimeError('plugin import exploded')\n")
    monkeypatch.syspath_prepend(str(site))
    with RUNTIME.swapped(registry.BACKENDS, registry.BackendRegistry()):  # finds the fake one
        with caplog.at_level(logging.WARNING, logger="ckptfs.layout.registry"):
            pairs = ckptfs.available_backends()
        assert ("safetensors_chunks", 1) in pairs and ("npy_chunks", 1) in pairs
        text = caplog.text
        assert "missing_module" in text and "ckptfs_no_such_module" in text
        assert "raising_module" in text and "plugin import exploded" in text
        sd = {"w": torch.arange(4.0)}
        ckptfs.save(sd, tmp_path / "ckpt", backend="npy_chunks")
        assert torch.equal(ckptfs.load_keys(tmp_path / "ckpt")["w"], sd["w"])


_MUTANTS = '''"""Two broken variants of the example plugin, for tests/test_conformance.py."""
import math

from ckptfs.layout.backend import EncodedChunk, RankWrite
from ckptfs.layout.index import ChunkEntry
from ckptfs_example_npy import NpyChunksBackend


class WholeChunkNpy(NpyChunksBackend):
    """Reads every chunk whole (as if it were compressed), however little of it a load needs."""

    name, version = "npy_wholechunk", 1

    async def chunk_source(self, tensor, chunk, reader):
        raw = await super().chunk_source(tensor, chunk, reader)
        return EncodedChunk(raw.file, bytes, raw.offset, raw.offset + raw.nbytes)


class NoChecksumNpy(NpyChunksBackend):
    """Stores each chunk of 2+ rows as two index entries (top and bottom rows) and, unlike zarr
    v3's inner chunks, sets no checksum on them: its chunks are never verified."""

    name, version = "npy_nocrc", 1

    def write_rank(self, job):
        rw = super().write_rank(job)
        entries = []
        for key, e in rw.chunks:
            if not e.shape or e.shape[0] < 2:
                entries.append((key, e))
                continue
            top = e.shape[0] // 2
            row = e.byte_length // e.shape[0]
            for start, rows in ((0, top), (top, e.shape[0] - top)):
                entries.append((key, ChunkEntry((e.offsets[0] + start, *e.offsets[1:]),
                                                (rows, *e.shape[1:]), e.file,
                                                e.byte_offset + start * row, rows * row)))
        return RankWrite(rw.files, tuple(entries))
'''


@pytest.mark.slow
def test_suite_fails_backends_that_read_whole_chunks_or_skip_checksums(tmp_path: Path) -> None:
    """The conformance cases that judge reads and integrity, run on two broken variants of the
    example plugin (registered by entry point from a temporary site directory): the variant that
    reads whole chunks fails the partial-load read bound (the 3 -> 2 bound in the spawned
    reshard cases is the same check), the variant whose chunks carry no checksum fails the
    flipped byte and the checksum rule; each passes the cases that do not concern its defect
    (the plugin itself passes every case: test_conformance_passes_from_an_installed_wheel).
    Single-process cases only, to stay fast."""
    site = tmp_path / "site"
    _fake_distribution(site, "ckptfs_mutant_backends", {
        "npy_wholechunk_1": "ckptfs_mutant_backends:WholeChunkNpy",
        "npy_nocrc_1": "ckptfs_mutant_backends:NoChecksumNpy",
    })
    (site / "ckptfs_mutant_backends.py").write_text(_MUTANTS)
    junit = tmp_path / "junit.xml"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptfs.cli", "conformance", "--backend", "npy_wholechunk:1",
         "--backend", "npy_nocrc:1", "-q", f"--junitxml={junit}",
         "-k", "flipped_data_byte or partial_load_reads_only or (every_chunk_has_a_checksum and basic) "
               "or load_keys_round_trip"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 1, proc.stdout[-4000:]
    outcomes = _outcomes(junit)

    def failed(pair: Pair) -> list[str]:
        """The failed cases of ``pair``, named without the pair: test_x or test_x[param]."""
        out = []
        for name, v in _pair_outcomes(outcomes, pair).items():
            case = name.split("::")[-1]
            for with_pair, without in ((f"[{pair.id}]", ""), (f"[{pair.id}-", "["), (f"-{pair.id}]", "]")):
                case = case.replace(with_pair, without)
            if v == "failed":
                out.append(case)
            assert v != "skipped" or "golden" in case, (name, v)
        return sorted(out)

    assert failed(Pair("npy_wholechunk", 1)) == ["test_partial_load_reads_only_what_it_needs"], proc.stdout[-4000:]
    assert failed(Pair("npy_nocrc", 1)) == ["test_every_chunk_has_a_checksum[basic]",
                                            "test_flipped_data_byte_raises_integrity_error"], proc.stdout[-4000:]
