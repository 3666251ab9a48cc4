"""Runs the documentation's plain Python blocks one after another in one interpreter, each as
``python block.py`` would run it, so that the blocks of a test run share one start of Python and
one import of torch (tests/test_docs_blocks.py).

Requests come on stdin, one JSON object a line: ``{"script", "cwd", "env", "out"}``. Each block
runs as ``__main__`` (``runpy.run_path``) in its own directory, with its own environment, its
script's folder first on ``sys.path`` and its stdout and stderr (file descriptors 1 and 2, so a
child's output too) in the file ``out``. Afterwards ckptfs is closed, a process group the block
left is destroyed, the modules it imported from its own directory are forgotten, and the
environment, directory, path, arguments, warning filters and logging handlers are put back. The
answer, ``{"rc": N}``, goes to the stdout the runner started with. A block that ends the
interpreter (``os._exit``) ends the runner; the test starts a new one.
"""

from __future__ import annotations

import json
import logging
import os
import runpy
import sys
import traceback
import warnings


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _forget_modules_under(folder: str) -> None:
    folder = os.path.realpath(folder) + os.sep
    for name, mod in list(sys.modules.items()):
        path = getattr(mod, "__file__", None) or ""
        if path and os.path.realpath(path).startswith(folder):
            del sys.modules[name]


def _tidy() -> None:
    """What a block may leave behind that a fresh interpreter would not have."""
    import torch.distributed as dist

    import ckptfs

    ckptfs.close()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def run(script: str, cwd: str, env: dict[str, str]) -> int:
    """Run one block as ``python script`` would, in ``cwd`` with ``env``; its exit status."""
    saved = (dict(os.environ), os.getcwd(), list(sys.path), list(sys.argv),
             list(logging.root.handlers))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script]
    rc = 0
    try:
        with warnings.catch_warnings():
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        rc = 1
    try:
        _tidy()
    except BaseException:
        traceback.print_exc()
        rc = rc or 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        env0, cwd0, path0, argv0, handlers0 = saved
        os.environ.clear()
        os.environ.update(env0)
        os.chdir(cwd0)
        sys.path[:] = path0
        sys.argv = argv0
        logging.root.handlers[:] = handlers0
        _forget_modules_under(cwd)
    return rc


def _redirected(out: str, script: str, cwd: str, env: dict[str, str]) -> int:
    """``run`` with file descriptors 1 and 2 (Python's and any child's) written to ``out``."""
    sys.stdout.flush()
    sys.stderr.flush()
    keep = os.dup(1), os.dup(2)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        return run(script, cwd, env)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(keep[0], 1)
        os.dup2(keep[1], 2)
        os.close(keep[0])
        os.close(keep[1])


def main() -> None:
    import torch  # noqa: F401  (what every block imports first, once)

    import ckptfs  # noqa: F401

    answers = os.fdopen(os.dup(1), "w", buffering=1)
    print(json.dumps({"ready": True}), file=answers)
    for line in sys.stdin:
        req = json.loads(line)
        rc = _redirected(req["out"], req["script"], req["cwd"], req["env"])
        print(json.dumps({"rc": rc}), file=answers)


if __name__ == "__main__":
    main()
