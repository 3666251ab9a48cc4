"""No function in ckptfs/ is longer than 60 lines (a function does one level of work)."""

from __future__ import annotations

import ast
import pathlib

import ckptfs

ROOT = pathlib.Path(ckptfs.__file__).parent
LIMIT = 60


def test_no_function_is_longer_than_the_limit():
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        if "golden" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > LIMIT:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long
