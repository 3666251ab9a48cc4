"""The drop-ins' public import names: ``ckptfs.dcp``, ``ckptfs.lightning``, ``ckptfs.megatron``
and ``ckptfs.torchtitan`` are the modules of ``ckptfs/integrations/`` (with their submodules:
``ckptfs.dcp.items`` is ``ckptfs.integrations.dcp.items``), imported on first use.

``import ckptfs`` imports none of them, nor the peer library each needs (Lightning,
Megatron-Core, torchtitan, DCP's planners). A finder placed first on ``sys.meta_path`` answers
for the public names only: each is the same module object as its ``integrations`` name, so a
class has one identity whichever name imported it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

#: public name -> the module under ckptfs/integrations/
DROP_INS: dict[str, str] = {f"ckptfs.{name}": f"ckptfs.integrations.{name}"
                            for name in ("dcp", "lightning", "megatron", "torchtitan")}


def real_name(name: str) -> str | None:
    """The ``integrations`` module a public name stands for (None: not a drop-in's name)."""
    for public, real in DROP_INS.items():
        if name == public or name.startswith(public + "."):
            return real + name[len(public):]
    return None


class DropInNames(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``ckptfs.<drop-in>[.sub]`` to the module of ``ckptfs.integrations``."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None
                  ) -> importlib.machinery.ModuleSpec | None:
        real = real_name(fullname)
        if real is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, loader_state=real)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(spec.loader_state)
        spec.loader_state = module.__spec__  # handed back to the module in exec_module
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system set the public name's spec on the module: it keeps its own
        own = module.__spec__.loader_state if module.__spec__ is not None else None
        if own is not None:
            module.__spec__ = own


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once per process): before the path finder,
    which would otherwise load a submodule a second time under its public name."""
    if not any(isinstance(f, DropInNames) for f in sys.meta_path):
        sys.meta_path.insert(0, DropInNames())
