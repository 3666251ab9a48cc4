"""The store registry: a protocol added by a separate package's entry point alone
(examples/store_plugin, ``demo://``) passes ``StoreTests`` and carries a save and a load; the
built-in protocols keep their stores; plug-ins never take a built-in protocol; a missing
optional client names its extra."""

from __future__ import annotations

import subprocess
import sys
import warnings
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.errors import ConfigError
from ckptfs.io import Store, StoreOptions, StoreRequest, open_store, register_store, run_sync
from ckptfs.io.fsspec_store import FsspecStore
from ckptfs.io.local_store import LocalStore
from ckptfs.io.optional import MissingExtraError
from ckptfs.io.registry import (
    ENTRY_POINT_GROUP,
    STORES,
    StoreConflictWarning,
    StoreRegistry,
    split_protocol,
)
from ckptfs.runtime import RUNTIME
from ckptfs.testing.store_tests import StoreTests

REPO = Path(__file__).resolve().parent.parent


def test_the_example_package_registers_demo_by_entry_point():
    eps = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert eps.get("demo") == "ckptfs_example_store:open_demo", (
        "the example store is not installed: pip install --no-deps -e examples/store_plugin "
        "(make venv does it)")
    assert "demo" in ckptfs.io.store_protocols()


class TestDemoStore(StoreTests):
    """The third-party store, opened by URL as a user would, against the whole contract."""

    @pytest.fixture
    def store(self, tmp_path):
        store = run_sync(open_store(f"demo://{tmp_path}/root"))
        assert type(store).__module__ == "ckptfs_example_store", type(store)
        yield store
        run_sync(store.close())


def test_save_and_load_through_a_demo_url(tmp_path):
    sd = {"w": torch.arange(12.0).reshape(3, 4), "step": 7, "b": torch.ones(5, dtype=torch.bfloat16)}
    url = f"demo://{tmp_path}/ckpt"
    result = ckptfs.save(sd, url)
    assert result.files and result.bytes_written >= 12 * 4 + 5 * 2
    sizes = [(tmp_path / "ckpt" / name).stat().st_size for name in result.files]
    assert sum(sizes) == result.bytes_written  # the plug-in wrote the folder
    assert (tmp_path / "ckpt" / ckptfs.INDEX_FILE).is_file()
    back = ckptfs.load_keys(url)
    assert torch.equal(back["w"], sd["w"]) and torch.equal(back["b"], sd["b"])
    assert back["step"] == 7
    target = {"w": torch.zeros(3, 4), "step": 0, "b": torch.zeros(5, dtype=torch.bfloat16)}
    ckptfs.load(target, url)
    assert torch.equal(target["w"], sd["w"]) and target["step"] == 7


@pytest.mark.slow
def test_the_plugin_is_imported_only_when_its_protocol_is_opened(tmp_path):
    code = ("import sys, torch, ckptfs, ckptfs.io\n"
            "assert 'demo' in ckptfs.io.store_protocols()\n"
            "assert 'ckptfs_example_store' not in sys.modules\n"
            "ckptfs.save({'x': torch.ones(2)}, sys.argv[1])\n"
            "assert 'ckptfs_example_store' not in sys.modules  # a local save\n"
            "ckptfs.load_keys('demo://' + sys.argv[1])  # the same folder, through demo://\n"
            "assert 'ckptfs_example_store' in sys.modules\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, timeout=120,
                   cwd=REPO)


@pytest.mark.parametrize(("url", "client", "opener"), [
    ("/plain/path", "fsspec", "ckptfs.io.local_store:open_local"),
    ("file:///x", "obstore", "ckptfs.io.local_store:open_local"),
    ("local:///x", "fsspec", "ckptfs.io.local_store:open_local"),
    ("memory://x", "fsspec", "ckptfs.io.fsspec_store:open_request"),
    ("memory://x", "obstore", "ckptfs.io.obstore_store:open_request"),
    ("s3://bucket/p", "fsspec", "ckptfs.io.s3:open_request"),
    ("s3a://bucket/p", "fsspec", "ckptfs.io.s3:open_request"),
    ("s3://bucket/p", "obstore", "ckptfs.io.obstore_store:open_request"),
    ("gs://bucket/p", "obstore", "ckptfs.io.obstore_store:open_request"),
    ("gs://bucket/p", "fsspec", "ckptfs.io.fsspec_store:open_request"),
    ("hf://org/repo", "fsspec", "ckptfs.io.fsspec_store:open_request"),
    ("az://c/p", "obstore", "ckptfs.io.obstore_store:open_request"),
])
def test_built_in_protocols_keep_their_stores(url, client, opener):
    """The selection rules of ``open_store`` before the registry, entry by entry."""
    proto, _ = split_protocol(url)
    assert StoreRegistry([]).entry(proto, client).opener == opener


def test_built_in_stores_open_by_url(tmp_path):
    local = run_sync(open_store(tmp_path / "a"))
    mem = run_sync(open_store("memory://registry-test/a"))
    assert isinstance(local, LocalStore) and isinstance(mem, FsspecStore)
    run_sync(local.close())
    run_sync(mem.close())


def test_a_missing_optional_client_names_its_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "obstore", None)  # as if it were not installed
    monkeypatch.delitem(sys.modules, "ckptfs.io.obstore_store", raising=False)
    with pytest.raises(MissingExtraError, match=r"obstore.*pip install 'ckptfs\[obstore\]'"):
        run_sync(open_store("s3://bucket/x", {}, StoreOptions(client="obstore")))


def test_a_plugin_never_takes_a_built_in_protocol(tmp_path):
    eps = [EntryPoint("s3", "ckptfs_no_such_module:open", ENTRY_POINT_GROUP),
           EntryPoint("file", "ckptfs_no_such_module:open", ENTRY_POINT_GROUP)]
    reg = StoreRegistry(eps)
    with pytest.warns(StoreConflictWarning) as refused:
        assert reg.entry("nothing", "fsspec").opener == "ckptfs.io.fsspec_store:open_request"
    said = " ".join(str(w.message) for w in refused)
    assert "s3:// is taken" in said and "file:// is taken" in said
    assert reg.entry("s3", "fsspec").opener == "ckptfs.io.s3:open_request"
    assert reg.entry("file", "fsspec").opener == "ckptfs.io.local_store:open_local"


def test_a_broken_entry_point_raises_naming_it():
    reg = StoreRegistry([EntryPoint("broken", "ckptfs_no_such_module:open", ENTRY_POINT_GROUP)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "broken" in reg.protocols()  # listed without importing it
    with pytest.raises(ConfigError, match=r"broken://.*ckptfs_no_such_module"):
        reg.entry("broken", "fsspec")


def test_register_store_in_code_and_refuse_a_taken_protocol(tmp_path):
    opened: list[StoreRequest] = []

    async def open_mine(request: StoreRequest) -> Store:
        opened.append(request)
        return LocalStore(request.path, request.options)

    with RUNTIME.swapped(STORES, StoreRegistry([])):
        register_store("mine", open_mine)
        with pytest.raises(ConfigError, match="mine:// .*already registered"):
            register_store("mine", open_mine)
        with pytest.raises(ConfigError, match="file:// .*already registered"):
            register_store("file", open_mine)
        ckptfs.save({"x": torch.ones(2)}, f"mine://{tmp_path}/c", storage_options={"k": 1})
        assert opened[0].protocol == "mine" and opened[0].storage_options == {"k": 1}
        assert torch.equal(ckptfs.load_keys(tmp_path / "c")["x"], torch.ones(2))
        register_store("mine", lambda request: "not a store", replace=True)
        with pytest.raises(ConfigError, match="not a ckptfs.io.Store"):
            run_sync(open_store("mine://x"))
    assert "mine" not in ckptfs.io.store_protocols()  # the swapped registry is gone
    assert RUNTIME.get(STORES).entry("mine", "fsspec").opener == "ckptfs.io.fsspec_store:open_request"
