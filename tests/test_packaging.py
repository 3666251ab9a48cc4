"""The package installs only what a local save and load need, and its wheel is well formed.

The optional clients (s3fs, obstore) and the zarr backends' libraries are imported on the code
path that uses them; without them ``import ckptfs`` and a local save and load work, and the
paths that need them raise ``ConfigError`` naming the extra. The wheel is built from a clean
clone and checked here; ``make wheel-check`` also installs it in a fresh venv.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from tools_dev import wheel_check

ROOT = Path(__file__).resolve().parent.parent
CORE = {"torch", "numpy", "fsspec", "google-crc32c", "crc32c", "isal", "tqdm", "xxhash"}
EXTRAS = {"s3": {"s3fs"}, "obstore": {"obstore"}, "zarr": {"zarr", "numcodecs", "ml-dtypes"}}

BLOCKER = """
import importlib.abc, sys
BLOCKED = {"s3fs", "obstore", "zarr", "numcodecs", "ml_dtypes", "safetensors", "aiobotocore",
           "botocore", "jsonschema", "transformers", "huggingface_hub"}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Blocker())
"""

WITHOUT_EXTRAS = BLOCKER + """
import json, logging, os, sys, torch, ckptfs
from ckptfs.cli import main
logging.basicConfig(level=logging.WARNING)
root = sys.argv[1]
ckptfs.save({"w": torch.arange(4.0), "step": 3}, os.path.join(root, "c"))
state = {"w": torch.zeros(4), "step": 0}
ckptfs.load(state, os.path.join(root, "c"))
assert torch.equal(state["w"], torch.arange(4.0)) and state["step"] == 3
assert main(["inspect", "-q", os.path.join(root, "c")]) == 0
errors = {}
for what, call in [
    ("s3", lambda: ckptfs.save({"w": torch.ones(1)}, "s3://bucket/c")),
    ("zarr", lambda: ckptfs.save({"w": torch.ones(1)}, os.path.join(root, "z"), backend="zarr")),
]:
    try:
        call()
    except ckptfs.ConfigError as e:
        errors[what] = str(e)
from ckptfs.io.optional import optional_dependency
try:
    with optional_dependency("the obstore client"):
        import ckptfs.io.obstore_store  # noqa: F401
except ckptfs.ConfigError as e:
    errors["obstore"] = str(e)
loaded = sorted({m.split(".")[0] for m in sys.modules} & {"s3fs", "obstore", "zarr", "numcodecs"})
print(json.dumps({"errors": errors, "loaded": loaded}))
"""


@pytest.mark.slow
def test_import_save_load_without_the_optional_dependencies(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []
    assert "pip install 'ckptfs[s3]'" in out["errors"]["s3"] and "s3fs" in out["errors"]["s3"]
    assert "pip install 'ckptfs[zarr]'" in out["errors"]["zarr"] and "zarr" in out["errors"]["zarr"]
    assert "pip install 'ckptfs[obstore]'" in out["errors"]["obstore"]
    # a missing extra is not a broken plugin: no warning on a plain local save
    assert "cannot be imported" not in res.stderr, res.stderr


def _requirement_name(req: str) -> str:
    name = req.split(";")[0].split("[")[0]
    for sep in "<>=!~ ":
        name = name.split(sep)[0]
    return name.strip().lower().replace("_", "-")


def test_pyproject_core_dependencies_and_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_requirement_name(r) for r in project["dependencies"]} == CORE
    extras = project["optional-dependencies"]
    for extra, names in EXTRAS.items():
        assert {_requirement_name(r) for r in extras[extra]} == names, extra
    assert set(extras["all"][0].split("[")[1].rstrip("]").split(",")) >= set(EXTRAS) | {"hf"}
    assert not {"ruff", "build", "twine"} & {_requirement_name(r) for r in extras["test"]}
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout (the wheel is built from a clean clone)")
    for module in ("build", "twine", "check_wheel_contents"):  # the dev extra (make venv installs it)
        pytest.importorskip(module)
    work = tmp_path_factory.mktemp("wheel")
    src = wheel_check.clean_clone(work)
    wheel, log = wheel_check.build(src, work / "dist", wheel_only=True)
    return wheel, log


@pytest.mark.slow
def test_wheel_from_a_clean_clone_builds_without_warnings_and_passes_checks(built_wheel):
    wheel, log = built_wheel
    assert wheel_check.build_warnings(log) == []
    out = wheel_check.check(wheel)
    assert "PASSED" in out, out


@pytest.mark.slow
def test_wheel_metadata_requires_only_the_core(built_wheel):
    wheel, _ = built_wheel
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(zf.read(meta_name))
        names = zf.namelist()
    requires = meta.get_all("Requires-Dist")
    core = {_requirement_name(r) for r in requires if "extra ==" not in r}
    assert core == CORE
    s3 = {_requirement_name(r) for r in requires if 'extra == "s3"' in r}
    assert s3 == {"s3fs"}
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert not any(n.startswith(("tests/", "bench/", "tools_dev/")) for n in names)


@pytest.mark.slow
def test_wheel_runs_the_quick_start_without_the_optional_dependencies(built_wheel, tmp_path):
    """The wheel's files alone (unpacked, ahead of the checkout) with the optional modules blocked."""
    wheel, _ = built_wheel
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    res = subprocess.run([sys.executable, "-c", BLOCKER + wheel_check.QUICK_START], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=240)
    assert res.returncode == 0, res.stderr
    assert "quick start: saved and loaded" in res.stdout
