"""The package's layers import downwards only (CONTRIBUTING.md, "Layers").

    io -> layout -> dist -> planning -> state -> engine -> API (and integrations/) -> testing
    -> tools, CLI (and integrations/torchtitan.py)

A module may import modules of its own layer or of lower ones; ``ckptfs.errors`` is shared by
every layer, and only the API and above may import the package root.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import ckptfs

RANK = {"_version": 0, "runtime": 0, "io": 0, "layout": 1, "dist": 2, "planning": 3, "state": 4, "engine": 5,
        "manager": 6, "integrations": 6, "integrations.torchtitan": 8, "testing": 7, "tools": 8, "cli": 8,
        "demo": 8, "__main__": 8}
API = 6  # save, load, metadata, deletion, manager/, the package root
ROOT = pathlib.Path(ckptfs.__file__).parent


def layer(module: str) -> int:
    parts = module.split(".")
    if ".".join(parts[1:3]) in RANK:  # a module with a layer of its own inside a package
        return RANK[".".join(parts[1:3])]
    return RANK.get(parts[1], API) if len(parts) > 1 else API


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages <= set(RANK), f"add {sorted(packages - set(RANK))} to RANK and CONTRIBUTING.md"


def test_imports_point_down_only():
    upward = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(("ckptfs", *path.relative_to(ROOT).with_suffix("").parts))
        for target in re.findall(r"^\s*(?:from|import)\s+(ckptfs[\w.]*)", path.read_text(), re.M):
            if target == "ckptfs.errors":  # the error hierarchy is shared by every layer
                continue
            if (target == "ckptfs" and layer(module) < API) or layer(target) > layer(module):
                upward.append(f"{module} -> {target}")
    assert not upward, upward


#: the engine's rooms (engine/__init__.py) and the rooms each may import; the engine's
#: top-level modules (options, errors, index_io, small_files) are shared by all of them
ROOMS = {"memory": set(), "save": {"memory"}, "load": {"memory"},
         "background": {"memory", "save"}}


def test_engine_rooms_import_only_the_rooms_below_them():
    """Host memory imports no other room; the save and the load import memory, not each other;
    background savers sit above the save. Top-level engine modules import no room."""
    crossing = []
    engine = ROOT / "engine"
    assert {p.name for p in engine.iterdir() if (p / "__init__.py").exists()} == set(ROOMS)
    for path in engine.rglob("*.py"):
        rel = path.relative_to(engine).parts
        room = rel[0] if len(rel) > 1 else None
        allowed = ROOMS.get(room, set()) | {room}
        for target in re.findall(r"^\s*(?:from|import)\s+ckptfs\.engine\.(\w+)", path.read_text(),
                                 re.M):
            if target in ROOMS and target not in allowed:
                crossing.append(f"engine/{'/'.join(rel)} -> engine/{target}/")
    assert not crossing, crossing


def test_only_dist_and_dtensor_placement_call_torch_distributed():
    """``torch.distributed`` collectives live in dist/ (state/shards.py reads DTensor placements)."""
    allowed = {"dist", "testing"}
    offenders = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in allowed or rel.as_posix() == "demo.py":
            continue
        for call in re.findall(r"\bdist\.(\w+)\(", path.read_text()):
            offenders.append(f"{rel}: dist.{call}()")
    assert not offenders, offenders


def test_tools_are_exported_lazily():
    """The package root names the tools (a layer above it) and imports them on first use (PEP
    562 ``__getattr__`` through importlib), never with an import statement (the test above)."""
    names = set(ckptfs._TOOLS)
    assert names <= set(ckptfs.__all__) and names <= set(dir(ckptfs))
    for name, module in ckptfs._TOOLS.items():
        assert getattr(ckptfs, name).__module__ == module


@pytest.mark.slow
def test_import_leaves_the_heavy_modules_alone():
    """``import ckptfs`` imports neither DTensor's module (with the symbolic-shapes code it pulls
    in) nor the object-store clients: every spawned rank, writer process and command pays for
    what the package imports. DTensors are recognised without importing their module."""
    import subprocess
    import sys

    code = ("import sys, ckptfs; "
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy', 's3fs', 'obstore', "
            "'zarr') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def _module_imports() -> dict[str, set[str]]:
    """module -> the ckptfs modules it imports (anywhere in its text, function-level imports
    too); ``from pkg import sub`` counts as importing ``pkg.sub`` where that is a module."""
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[path] = ".".join(("ckptfs", *(parts[:-1] if parts[-1] == "__init__" else parts)))
    modules = set(names.values())
    graph: dict[str, set[str]] = {}
    for path, module in names.items():
        found = graph.setdefault(module, set())
        for base, what in re.findall(r"^\s*(?:from\s+(ckptfs[\w.]*)\s+import\s+([\w ,]+)|"
                                     r"import\s+(?:ckptfs[\w.]*))", path.read_text(), re.M):
            subs = {f"{base}.{n.strip()}" for n in what.split(",")} & modules
            found |= subs or {base}
        found |= set(re.findall(r"^\s*import\s+(ckptfs[\w.]*)", path.read_text(), re.M))
        found.discard("")
    return graph


def test_no_two_modules_import_each_other():
    """No import cycle between two modules (a lazy import inside a function included: the
    shared piece belongs in a module both import, below them)."""
    graph = _module_imports()
    cycles = sorted((a, b) for a, targets in graph.items() for b in targets
                    if a < b and a in graph.get(b, ()))
    assert not cycles, cycles


@pytest.mark.slow
def test_the_drop_ins_keep_their_public_names_and_load_on_first_use():
    """``ckptfs.dcp``, ``ckptfs.lightning``, ``ckptfs.megatron`` and ``ckptfs.torchtitan`` are
    the modules of ckptfs/integrations/ (one module object under either name, submodules too);
    ``import ckptfs`` imports none of them, nor Lightning, Megatron-Core or torchtitan."""
    import subprocess
    import sys

    code = (
        "import sys, ckptfs\n"
        "heavy = ('lightning', 'megatron', 'torchtitan', 'ckptfs.integrations.dcp', "
        "'ckptfs.integrations.lightning', 'ckptfs.integrations.torchtitan', 'ckptfs.dcp')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
        "assert ckptfs.dcp.__name__ == 'ckptfs.integrations.dcp'  # attribute access imports it\n"
        "import ckptfs.dcp, ckptfs.integrations.dcp.items as real\n"
        "from ckptfs.dcp.items import OPAQUE\n"
        "import ckptfs.dcp.items as public\n"
        "assert ckptfs.dcp is sys.modules['ckptfs.integrations.dcp'] is sys.modules['ckptfs.dcp']\n"
        "assert public is real and OPAQUE is real.OPAQUE\n"
        "assert ckptfs.dcp.StorageWriter.__module__ == 'ckptfs.integrations.dcp.writer'\n"
        "assert ckptfs.dcp.__spec__.name == 'ckptfs.integrations.dcp'\n"
        "import ckptfs.lightning\n"
        "assert sys.modules['ckptfs.lightning'] is sys.modules['ckptfs.integrations.lightning']\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT.parent, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "ok"], out.stdout + out.stderr
