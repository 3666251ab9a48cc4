"""Options by layer: StoreOptions (io), SaveOptions and LoadOptions with their groups (engine),
ManagerOptions (manager), their validation, each setting defined once, the keywords removed
(each naming its new home), and BackgroundSaver instances that share nothing."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import ckptfs
from ckptfs.engine.background.defaults import default_saver
from ckptfs.engine.background.saver import BackgroundSaver


def _state() -> dict:
    return {"w": torch.arange(64.0).reshape(8, 8), "step": 3}


def test_options_are_frozen_values_with_documented_defaults():
    for cls in (ckptfs.StoreOptions, ckptfs.SaveOptions, ckptfs.LoadOptions):
        opts = cls()
        assert dataclasses.is_dataclass(opts)
        with pytest.raises(dataclasses.FrozenInstanceError):
            opts.__setattr__(dataclasses.fields(cls)[0].name, None)
        assert cls() == opts and hash(cls()) == hash(opts)


@pytest.mark.parametrize(("cls", "field", "value"), [
    (ckptfs.StoreOptions, "max_concurrency", 0),
    (ckptfs.StoreOptions, "read_piece", 0),
    (ckptfs.StoreOptions, "client", "boto"),
    (ckptfs.StoreOptions, "retries", -1),
    (ckptfs.StoreOptions, "part_size", 1.5),
    (ckptfs.SaveOptions, "copy_threads", 0),
    (ckptfs.SaveOptions, "copy_piece", 0),
    (ckptfs.SaveOptions, "background_nice", 20),
    (ckptfs.DistOptions, "collective_timeout", 0),
    (ckptfs.SaveOptions, "throttle_uploads", True),
    (ckptfs.LoadOptions, "scratch_bytes", 0),
    (ckptfs.LoadOptions, "read_wave", -1),
    (ckptfs.DistOptions, "ring_bytes", -5),
])
def test_bad_values_are_config_errors_naming_the_field(cls, field, value):
    with pytest.raises(ckptfs.ConfigError, match=rf"{cls.__name__}\.{field}"):
        cls(**{field: value})


def test_the_common_call_passes_no_options(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation on the plain path
        ckptfs.save(_state(), tmp_path / "c")
        target = {"w": torch.zeros(8, 8), "step": 0}
        ckptfs.load(target, tmp_path / "c")
    assert torch.equal(target["w"], _state()["w"]) and target["step"] == 3


def test_options_reach_the_store_and_the_engine(tmp_path):
    """A StoreOptions field changes what the store does (fsync off: no fsync call), a
    LoadOptions field what the engine does (verify off: a corrupted chunk loads unchecked)."""
    import os
    from unittest import mock

    with mock.patch.object(os, "fsync", wraps=os.fsync) as fsync:
        ckptfs.save(_state(), tmp_path / "nofsync", store_options=ckptfs.StoreOptions(fsync=False))
    assert fsync.call_count == 0
    with mock.patch.object(os, "fsync", wraps=os.fsync) as fsync:
        ckptfs.save(_state(), tmp_path / "fsync")
    assert fsync.call_count > 0
    data = next((tmp_path / "fsync" / "data").rglob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(ckptfs.IntegrityError):
        ckptfs.load({"w": torch.zeros(8, 8), "step": 0}, tmp_path / "fsync")
    ckptfs.load({"w": torch.zeros(8, 8), "step": 0}, tmp_path / "fsync",
                options=ckptfs.LoadOptions(verify=False))


def test_removed_keywords_name_their_new_home_and_write_nothing(tmp_path):
    """The keywords deprecated for a minor version are gone: each is refused with TypeError
    naming where the setting lives now, before anything is written."""
    with pytest.raises(TypeError, match=r"throttle_uploads= \(use options=ckptfs.SaveOptions\(throttle"):
        ckptfs.save(_state(), tmp_path / "c", throttle_uploads=1)
    with pytest.raises(TypeError, match=r"collective_timeout= \(use .*DistOptions"):
        ckptfs.async_save(_state(), tmp_path / "c", collective_timeout=5)
    assert not (tmp_path / "c").exists()
    ckptfs.save(_state(), tmp_path / "c")
    for kw in ("verify", "pre_download", "work_dir", "exchange"):
        with pytest.raises(TypeError, match=rf"load\(\) no longer takes {kw}= \(use options=ckptfs.LoadOptions"):
            ckptfs.load({"w": torch.zeros(8, 8)}, tmp_path / "c", **{kw: False})
    with pytest.raises(TypeError, match=r"io_config= \(use store_options=ckptfs.StoreOptions"):
        ckptfs.load_metadata(tmp_path / "c", io_config=None)
    with pytest.raises(AttributeError, match=r"IOConfig was removed.*StoreOptions\(client=\.\.\.\)"):
        ckptfs.IOConfig  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'Bogus'"):
        ckptfs.Bogus  # noqa: B018


def test_no_option_field_is_defined_in_two_option_classes():
    """Every setting is a field of one option class. A field holding an option group (``dist``
    in SaveOptions and LoadOptions) refers to the group; the group's own fields are the
    settings."""
    import importlib
    import inspect

    modules = ["ckptfs.options", "ckptfs.engine.options", "ckptfs.io.options",
               "ckptfs.manager.options", "ckptfs.manager.steps", "ckptfs.manager.preemption"]
    classes = {cls for name in modules
               for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass)
               if dataclasses.is_dataclass(cls) and cls.__module__ == name
               and (cls.__name__.endswith(("Options", "Policy")) or cls is ckptfs.Retention)}
    assert {ckptfs.SaveOptions, ckptfs.LoadOptions, ckptfs.StoreOptions, ckptfs.DistOptions,
            ckptfs.AsyncOptions, ckptfs.HealthOptions, ckptfs.ManagerOptions, ckptfs.TierOptions,
            ckptfs.Retention, ckptfs.PreemptionPolicy} <= classes
    home: dict[str, str] = {}
    for cls in sorted(classes, key=lambda c: c.__name__):
        for f in dataclasses.fields(cls):
            group = f.default_factory if f.default_factory is not dataclasses.MISSING else None
            if group in classes:
                continue  # a reference to a group
            assert f.name not in home, f"{f.name} is a field of {home.get(f.name)} and {cls.__name__}"
            home[f.name] = cls.__name__
    for name in ("ring_bytes", "ring_slots", "collective_timeout"):
        assert home[name] == "DistOptions"
    assert home["host_memory_limit"] == home["writer"] == "AsyncOptions"
    assert home["check_finite"] == home["stats"] == "HealthOptions"


def test_keyword_shortcuts_set_the_fields(tmp_path):
    """``check_finite=`` / ``stats=`` / ``host_memory_limit=`` / ``writer=`` set the option
    fields; a shortcut left out keeps what ``options`` says."""
    import math

    opts = ckptfs.SaveOptions(health=ckptfs.HealthOptions(check_finite=True))
    bad = {"w": torch.tensor([1.0, math.nan])}
    with pytest.raises(ckptfs.NonFiniteError):
        ckptfs.save(bad, tmp_path / "a", options=opts)
    with pytest.raises(ckptfs.NonFiniteError):
        ckptfs.save(bad, tmp_path / "b", check_finite=True)
    ckptfs.save(bad, tmp_path / "c", options=opts, check_finite=False)  # the keyword wins
    assert not (tmp_path / "a" / ckptfs.INDEX_FILE).exists()  # refused: nothing committed
    assert ckptfs.load_metadata(tmp_path / "c").tensors
    ckptfs.async_save(_state(), tmp_path / "d", stats=True).result(timeout=60)
    assert ckptfs.load_metadata(tmp_path / "d").tensors["w"].stats is not None
    both = opts.with_shortcuts(writer="process", host_memory_limit=1 << 20, stats=True)
    assert both.asynchronous == ckptfs.AsyncOptions(writer="process", host_memory_limit=1 << 20)
    assert both.health == ckptfs.HealthOptions(check_finite=True, stats=True)
    assert opts.with_shortcuts() is opts


def test_unknown_keywords_are_refused():
    with pytest.raises(TypeError, match="bogus"):
        ckptfs.save(_state(), "/nonexistent", bogus=1)
    with pytest.raises(TypeError, match="copy_threads"):  # a field, but never a keyword
        ckptfs.save(_state(), "/nonexistent", copy_threads=1)
    with pytest.raises(TypeError, match="scratch_bytes"):
        ckptfs.load({}, "/nonexistent", scratch_bytes=1)


def test_background_savers_share_nothing(tmp_path):
    """Each saver has its own staging pool; the default one is the per-process saver of
    ``async_save``; closing one frees its buffers only."""
    mine = BackgroundSaver("background:test")
    h = ckptfs.async_save(_state(), tmp_path / "a", saver=mine)
    h.result(timeout=60)
    assert mine.staging_pool().allocator.cached_bytes > 0
    assert default_saver() is default_saver() is not mine
    ckptfs.async_save(_state(), tmp_path / "b").result(timeout=60)
    held = default_saver().staging_pool().allocator.cached_bytes
    mine.close()
    assert mine.staging_pool().allocator.cached_bytes == 0
    assert default_saver().staging_pool().allocator.cached_bytes == held > 0
    for name in ("a", "b"):
        target = {"w": torch.zeros(8, 8), "step": 0}
        ckptfs.load(target, tmp_path / name)
        assert torch.equal(target["w"], _state()["w"])


def test_manager_options_are_grouped_and_old_keywords_name_their_home(tmp_path):
    import inspect

    params = inspect.signature(ckptfs.CheckpointManager.__init__).parameters
    assert len(params) - 1 <= 8, list(params)  # self aside
    opts = ckptfs.ManagerOptions(retention=ckptfs.Retention(keep_last=1),
                                 preemption=ckptfs.PreemptionPolicy(signals=(), exit=False),
                                 save=ckptfs.SaveOptions(dist=ckptfs.DistOptions(collective_timeout=30)))
    with ckptfs.CheckpointManager(tmp_path / "m", opts) as mgr:
        for step in (1, 2, 3):
            mgr.save_sync(step, _state())
        assert mgr.steps() == [3]
        assert mgr.preemption.signals == () and not mgr.preemption.exit
        assert mgr.load_options.collective_timeout == 30  # restores wait as long as saves
    for old, home in (("keep_last", r"retention=ckptfs.Retention\(keep_last"),
                      ("exit_on_preemption", r"PreemptionPolicy\(exit="),
                      ("local_dir", r"tiers=ckptfs.TierOptions\(local_dir"),
                      ("check_finite", r"SaveOptions\(health=ckptfs.HealthOptions\(check_finite"),
                      ("writer", r"SaveOptions\(asynchronous=ckptfs.AsyncOptions\(writer"),
                      ("save_options", r"save=ckptfs.SaveOptions\(\.\.\.\)")):
        with pytest.raises(TypeError, match=rf"CheckpointManager\(\) no longer takes {old}= \(use options=ckptfs.ManagerOptions\(.*{home}"):
            ckptfs.CheckpointManager(tmp_path / "m", **{old: 2})
    with pytest.raises(TypeError, match="keep_newest"):
        ckptfs.CheckpointManager(tmp_path / "m", keep_newest=2)
    with pytest.raises(ckptfs.ConfigError, match="ManagerOptions"):
        ckptfs.CheckpointManager(tmp_path / "m", ckptfs.Retention(keep_last=1))


@pytest.mark.parametrize(("cls", "field", "value"), [
    (ckptfs.Retention, "keep_last", 0),
    (ckptfs.PreemptionPolicy, "timeout", 0),
    (ckptfs.TierOptions, "replicas", -1),
    (ckptfs.TierOptions, "keep_local", 0),
    (ckptfs.ManagerOptions, "save_interval_steps", 0),
    (ckptfs.ManagerOptions, "save", ckptfs.LoadOptions()),
    (ckptfs.DistOptions, "ring_slots", 0),
    (ckptfs.AsyncOptions, "writer", "fork"),
    (ckptfs.HealthOptions, "stats", "yes"),
    (ckptfs.SaveOptions, "dist", 5),
])
def test_bad_group_values_are_config_errors_naming_the_field(cls, field, value):
    with pytest.raises(ckptfs.ConfigError, match=rf"{cls.__name__}\.{field}"):
        cls(**{field: value})


def test_the_docs_options_table_is_the_generated_one():
    """docs/options.md lists every field of every option class with its default and meaning,
    as tools_dev.options_table prints it from the classes (a field without a ``#:`` comment
    fails here)."""
    from tools_dev import options_table

    text = options_table.DOC.read_text()
    assert options_table.generated_part(text) == options_table.table()
    for cls, _ in options_table.CLASSES:
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` |" in text, f"{cls.__name__}.{f.name}"
