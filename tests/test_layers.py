"""The package's layers import downwards only: api -> state -> planning -> layout -> io."""

from __future__ import annotations

import pathlib
import re

import ckptfs

RANK = {"io": 0, "layout": 1, "planning": 2, "state": 3}  # anything else is the API (4)
ROOT = pathlib.Path(ckptfs.__file__).parent


def layer(module: str) -> int:
    parts = module.split(".")
    return RANK.get(parts[1], 4) if len(parts) > 1 else 4


def test_imports_point_down_only():
    upward = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(("ckptfs", *path.relative_to(ROOT).with_suffix("").parts))
        for target in re.findall(r"^\s*(?:from|import)\s+(ckptfs[\w.]*)", path.read_text(), re.M):
            if target == "ckptfs.errors":  # the error hierarchy is shared by every layer
                continue
            if (target == "ckptfs" and layer(module) < 4) or layer(target) > layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, upward
