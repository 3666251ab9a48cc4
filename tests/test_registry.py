"""The backend registry and its entry points: a plug-in is imported only when its pair is
looked up or the list of backends is asked for, and never replaces a built-in pair unless it
says so."""

from __future__ import annotations

import sys
import uuid
from contextlib import ExitStack
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

import ckptfs
from ckptfs.layout import registry
from ckptfs.layout.backends.zarr_backend import ZarrV3Backend
from ckptfs.layout.registry import BackendConflictWarning, entry_point_key
from ckptfs.runtime import RUNTIME


class Plugins:
    """Plug-in modules written on the fly, and a fresh per-process registry that finds them."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, stack: ExitStack) -> None:
        self.root, self.stack, self.eps = root, stack, []
        monkeypatch.syspath_prepend(str(root))

    def module(self, body: str) -> str:
        """A new module holding ``body`` (after ``from ckptfs import Backend``); its name."""
        name = f"ckptfs_test_plugin_{uuid.uuid4().hex}"
        (self.root / f"{name}.py").write_text(f"from ckptfs import Backend\n\n{body}\n")
        return name

    def backend(self, ep_name: str, name: str, version: int, extra: str = "") -> str:
        """An entry point ``ep_name`` naming a Backend class for (name, version); its module."""
        module = self.module(f"class Plug(Backend):\n    name = {name!r}\n    version = {version}\n"
                             f"{extra}")
        self.entry(ep_name, f"{module}:Plug")
        return module

    def entry(self, ep_name: str, value: str) -> None:
        self.eps.append(EntryPoint(ep_name, value, registry.ENTRY_POINT_GROUP))

    def install(self) -> None:
        self.stack.enter_context(RUNTIME.swapped(registry.BACKENDS,
                                                 registry.BackendRegistry(self.eps)))


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    with ExitStack() as stack:
        yield Plugins(tmp_path, monkeypatch, stack)


def imported(module: str) -> bool:
    return module in sys.modules


@pytest.mark.parametrize(("ep_name", "key"), [("npy_chunks_1", ("npy_chunks", 1)),
                                              ("my-layout-12", ("my-layout", 12)),
                                              ("register_all", None), ("v2", None)])
def test_entry_point_names_give_the_pair(ep_name, key):
    assert entry_point_key(ep_name) == key


def test_a_plugin_is_imported_only_when_its_pair_is_looked_up(plugins):
    module = plugins.backend("plug_1", "plug", 1)
    plugins.install()
    assert ckptfs.get_backend("safetensors_chunks", 1).name == "safetensors_chunks"
    assert not imported(module)
    cls = ckptfs.get_backend("plug", 1)
    assert cls.__module__ == module and imported(module)


def test_listing_the_backends_imports_every_plugin(plugins):
    keyed = plugins.backend("plug_1", "plug", 1)
    other = plugins.module("def register():\n    import ckptfs\n    class Two(Backend):\n"
                           "        name, version = 'two', 1\n"
                           "    ckptfs.register_backend('two', 1, Two)")
    plugins.entry("register_all", f"{other}:register")
    plugins.install()
    pairs = ckptfs.available_backends()
    assert {("plug", 1), ("two", 1), ("zarr", 3)} <= set(pairs)
    assert imported(keyed) and imported(other)


def test_an_unkeyed_plugin_is_imported_when_a_lookup_misses(plugins):
    other = plugins.module("def register():\n    import ckptfs\n    class Two(Backend):\n"
                           "        name, version = 'two', 1\n"
                           "    ckptfs.register_backend('two', 1, Two)")
    plugins.entry("register_all", f"{other}:register")
    plugins.install()
    ckptfs.get_backend("zarr", 3)
    assert not imported(other)
    assert ckptfs.get_backend("two", 1).name == "two" and imported(other)


def test_the_newest_version_counts_plugins_not_yet_imported(plugins):
    old = plugins.backend("plug_1", "plug", 1)
    new = plugins.backend("plug_2", "plug", 2)
    plugins.install()
    assert ckptfs.get_backend("plug").version == 2
    assert imported(new) and not imported(old)


def test_a_plugin_claiming_a_builtin_pair_is_refused_and_the_builtin_stays(plugins):
    module = plugins.backend("zarr_3", "zarr", 3)
    plugins.install()
    with pytest.warns(BackendConflictWarning, match=f"zarr_3 = {module}:Plug.*zarr-3.*built-in"):
        assert ckptfs.get_backend("zarr", 3) is ZarrV3Backend
    assert ckptfs.get_backend("zarr", 3) is ZarrV3Backend  # refused once, for good


def test_a_plugin_under_another_name_claiming_a_builtin_is_refused_when_listed(plugins):
    plugins.backend("fast_zarr", "zarr", 3)
    plugins.install()
    with pytest.warns(BackendConflictWarning, match="fast_zarr.*zarr-3"):
        assert ("zarr", 3) in ckptfs.available_backends()
    assert ckptfs.get_backend("zarr", 3) is ZarrV3Backend


def test_a_plugin_that_asks_replaces_a_builtin(plugins):
    module = plugins.backend("zarr_3", "zarr", 3, "    replaces_builtin = True\n")
    plugins.install()
    assert ckptfs.get_backend("zarr", 3).__module__ == module


def test_a_registering_plugin_cannot_replace_a_builtin_without_replace(plugins):
    other = plugins.module("def register():\n    import ckptfs\n    class Z(Backend):\n"
                           "        name, version = 'zarr', 2\n"
                           "    ckptfs.register_backend('zarr', 2, Z)")
    plugins.entry("register_all", f"{other}:register")
    plugins.install()
    with pytest.warns(BackendConflictWarning, match="register_all.*zarr-2 is already registered"):
        pairs = ckptfs.available_backends()
    assert ("zarr", 2) in pairs and ckptfs.get_backend("zarr", 2).__name__ == "ZarrV2Backend"


def test_two_plugins_for_one_pair_keep_the_first(plugins):
    first = plugins.backend("plug_1", "plug", 1)
    plugins.backend("plug-1", "plug", 1)
    with pytest.warns(BackendConflictWarning, match="plug-1.*plug-1 is taken"):
        plugins.install()
        cls = ckptfs.get_backend("plug", 1)
    assert cls.__module__ == first


def test_a_plugin_named_for_another_pair_is_filed_under_its_own(plugins, caplog):
    plugins.backend("plug_1", "other", 4)
    plugins.install()
    with pytest.raises(ckptfs.UnknownBackendError, match="plug-1"):
        ckptfs.get_backend("plug", 1)
    assert "holds other-4" in caplog.text
    assert ckptfs.get_backend("other", 4).name == "other"


def test_register_backend_refuses_a_taken_pair_unless_asked(plugins):
    plugins.install()

    class Mine(ckptfs.Backend):
        name, version = "zarr", 3

    with pytest.raises(ckptfs.ConfigError, match="zarr-3 is already registered.*replace=True"):
        ckptfs.register_backend("zarr", 3, Mine)
    ckptfs.register_backend("zarr", 3, Mine, replace=True)
    assert ckptfs.get_backend("zarr", 3) is Mine
