"""Options by layer: StoreOptions (io), SaveOptions and LoadOptions (engine), their validation,
the deprecated IOConfig and keywords they replace, and BackgroundSaver instances that share
nothing."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import ckptfs
from ckptfs.engine.background.defaults import default_saver
from ckptfs.engine.background.saver import BackgroundSaver
from ckptfs.options import IOConfig


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
    (ckptfs.SaveOptions, "collective_timeout", 0),
    (ckptfs.SaveOptions, "throttle_uploads", True),
    (ckptfs.LoadOptions, "scratch_bytes", 0),
    (ckptfs.LoadOptions, "read_wave", -1),
    (ckptfs.LoadOptions, "collective_timeout", -5),
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


def test_io_config_is_deprecated_and_maps_one_to_one(tmp_path):
    with pytest.warns(DeprecationWarning, match="StoreOptions") as rec:
        cfg = IOConfig(engine="obstore", max_gap=0, scratch_bytes=4096, copy_threads=2,
                       background_nice=3)
    assert rec[0].filename == __file__  # the warning points at the caller's line
    assert cfg.store_options() == ckptfs.StoreOptions(client="obstore", max_gap=0)
    with pytest.warns(DeprecationWarning):
        bad = pytest.raises(ckptfs.ConfigError, match="scratch_bytes")
        with bad:
            IOConfig(scratch_bytes=0)


def test_deprecated_keywords_still_work_and_warn_at_the_call(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"throttle_uploads= is deprecated.*SaveOptions"):
        ckptfs.save(_state(), tmp_path / "c", throttle_uploads=1)
    target = {"w": torch.zeros(8, 8), "step": 0}
    with pytest.warns(DeprecationWarning, match=r"verify= is deprecated.*LoadOptions") as rec:
        ckptfs.load(target, tmp_path / "c", verify=False)
    assert any(r.filename == __file__ for r in rec)
    assert torch.equal(target["w"], _state()["w"])
    with pytest.warns(DeprecationWarning, match="io_config") as rec:
        ckptfs.load(target, tmp_path / "c", io_config=IOConfig(max_gap=0))
    assert any(r.filename == __file__ and "io_config=" in str(r.message) for r in rec)


def test_a_deprecated_io_configs_engine_fields_reach_the_engine(tmp_path):
    """``IOConfig(scratch_bytes=...)`` bounds a load's scratch as ``LoadOptions`` would: its
    engine fields are not dropped on the way."""
    ckptfs.save({"w": torch.randn(64, 64)}, tmp_path / "c")
    target = {"w": torch.zeros(64, 64).t()}  # not contiguous: read through scratch
    with pytest.warns(DeprecationWarning):
        res = ckptfs.load(target, tmp_path / "c", io_config=IOConfig(scratch_bytes=4096))
    assert 0 < res.scratch_peak <= 4096, res
    big = ckptfs.load({"w": torch.zeros(64, 64).t()}, tmp_path / "c")
    assert big.scratch_peak > 4096, big


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


def test_manager_policies_are_grouped_and_the_flat_keywords_deprecated(tmp_path):
    with ckptfs.CheckpointManager(tmp_path / "m", retention=ckptfs.Retention(keep_last=1),
                                  preemption=ckptfs.PreemptionPolicy(signals=())) as mgr:
        for step in (1, 2, 3):
            mgr.save_sync(step, _state())
        assert mgr.steps() == [3]
        assert mgr.preemption.signals == () and mgr.preemption.exit
    with pytest.warns(DeprecationWarning, match=r"keep_last=.*retention=ckptfs.Retention") as rec:
        mgr = ckptfs.CheckpointManager(tmp_path / "m", keep_last=2, preemption_signals=(),
                                       exit_on_preemption=False)
    assert rec[0].filename == __file__
    assert mgr.retention == ckptfs.Retention(keep_last=2)
    assert mgr.preemption == ckptfs.PreemptionPolicy(signals=(), exit=False)
    mgr.close()
    with pytest.raises(ckptfs.ConfigError, match="Retention.keep_last"):
        ckptfs.Retention(keep_last=0)
    with pytest.raises(ckptfs.ConfigError, match="PreemptionPolicy.timeout"):
        ckptfs.PreemptionPolicy(timeout=0)
    with pytest.raises(TypeError, match="keep_newest"):
        ckptfs.CheckpointManager(tmp_path / "m", keep_newest=2)


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
