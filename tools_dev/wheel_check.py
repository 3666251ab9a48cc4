"""Build ckptfs's wheel from a clean clone, check it, install it in a fresh venv, run the quick start.

    python -m tools_dev.wheel_check [--python python3.11] [--keep DIR]

Steps (each prints one line): clone HEAD into a temporary directory; ``python -m build`` (sdist,
then the wheel from the sdist; any warning fails); ``check-wheel-contents`` and ``twine check``;
a fresh venv (no system site packages) with torch alone, then ``pip install`` of the wheel: none
of s3fs, obstore, zarr, numcodecs may arrive; the quick start saves and loads local files; then
``pip install 'ckptfs[s3]'`` from the same wheel adds s3fs. ``tests/test_packaging.py`` runs the
first three steps in the test suite (the fresh venv takes minutes: torch is large).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"
OPTIONAL = ("s3fs", "obstore", "zarr", "numcodecs")
QUICK_START = """
import os, tempfile, torch, ckptfs
path = os.path.join(tempfile.mkdtemp(), "ckpt")
ckptfs.save({"w": torch.arange(6.0).reshape(2, 3), "step": 7}, path)
state = {"w": torch.zeros(2, 3), "step": 0}
ckptfs.load(state, path)
assert torch.equal(state["w"], torch.arange(6.0).reshape(2, 3)) and state["step"] == 7
print("quick start: saved and loaded", path)
"""


def sh(*cmd: str | Path, cwd: Path | None = None) -> str:
    """Run ``cmd``; its stdout and stderr together; raises with the output if it fails."""
    res = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    out = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {res.returncode}:\n{out}")
    return out


def clean_clone(dest: Path) -> Path:
    """The committed tree at HEAD, cloned into ``dest/src`` (no untracked or ignored files)."""
    head = sh("git", "-C", ROOT, "rev-parse", "HEAD").strip()
    src = dest / "src"
    sh("git", "clone", "--quiet", "--shared", "--no-checkout", ROOT, src)
    sh("git", "-C", src, "checkout", "--quiet", head)
    return src


def build(src: Path, out: Path, *, wheel_only: bool = False) -> tuple[Path, str]:
    """(the wheel, the build's output); ``wheel_only`` builds without isolation (fast)."""
    cmd = [sys.executable, "-m", "build", "--outdir", str(out)]
    cmd += ["--wheel", "--no-isolation"] if wheel_only else []
    log = sh(*cmd, str(src))
    wheels = sorted(out.glob("ckptfs-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel in {out}, found {wheels}:\n{log}")
    return wheels[0], log


def build_warnings(log: str) -> list[str]:
    """Lines of a build's output that warn (setuptools deprecations, missing files, ...).

    "byte-compiling is disabled" answers PYTHONDONTWRITEBYTECODE in the environment, not the
    package, and is left out.
    """
    return [line for line in log.splitlines()
            if "warning" in line.lower() and "byte-compiling is disabled" not in line]


def check(wheel: Path) -> str:
    """``check-wheel-contents`` and ``twine check`` on the wheel (and the sdist beside it)."""
    out = sh(sys.executable, "-m", "check_wheel_contents", wheel)
    dists = [str(p) for p in wheel.parent.iterdir() if p.suffix in (".whl", ".gz")]
    return out + sh(sys.executable, "-m", "twine", "check", "--strict", *dists)


def installed(python: Path) -> set[str]:
    """Distribution names installed in the venv of ``python`` (lower case, - for _)."""
    out = sh(python, "-m", "pip", "list", "--format=freeze")
    return {line.split("==")[0].lower().replace("_", "-") for line in out.splitlines() if "==" in line}


def fresh_venv(base_python: str, wheel: Path, work: Path) -> list[str]:
    """The report lines of installing ``wheel`` into a fresh venv with torch alone."""
    venv = work / "venv"
    sh(base_python, "-m", "venv", venv)
    py = venv / "bin" / "python"
    lines = []
    t = time.monotonic()
    sh(py, "-m", "pip", "install", "-q", TORCH)
    sh(py, "-m", "pip", "install", "-q", wheel, TORCH)
    got = installed(py)
    present = sorted(set(OPTIONAL) & got)
    lines.append(f"pip install {wheel.name}: {len(got)} distributions, optional present: "
                 f"{present or 'none'} ({time.monotonic() - t:.0f} s)")
    if present:
        raise RuntimeError(f"the core install pulled optional dependencies: {present}")
    lines.append(sh(py, "-c", QUICK_START, cwd=work).strip())
    sh(py, "-m", "pip", "install", "-q", f"ckptfs[s3] @ {wheel.as_uri()}", TORCH)
    if "s3fs" not in installed(py):
        raise RuntimeError("pip install 'ckptfs[s3]' did not install s3fs")
    lines.append("pip install 'ckptfs[s3]': s3fs installed")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="the interpreter that makes the venv")
    ap.add_argument("--keep", type=Path, help="work in this directory and keep it")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = clean_clone(work)
        wheel, log = build(src, work / "dist")
        print(f"built {wheel.name} and its sdist from a clean clone; warnings: "
              f"{build_warnings(log) or 'none'}")
        if build_warnings(log):
            return 1
        print(check(wheel).strip())
        for line in fresh_venv(args.python, wheel, work):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
