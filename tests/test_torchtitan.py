"""``ckptfs.torchtitan``: torchtitan's checkpoint manager contract on ckptfs, with torchtitan's own
``ModelWrapper``, optimizers container (AdamW) and LR-scheduler container, a dataloader whose
state is per-rank pickled bytes (as torchtitan's ``ParallelAwareDataloader``), and a train state.

Two spawned gloo ranks train an FSDP2 model on the CPU: a reference run of 6 steps; a run saved
asynchronously at steps 2 and 4 that stops after step 5 and resumes from the latest step in a
fresh process state, bit-exact with the reference; retention (``keep_latest_k``), the last
step saved model-only in ``export_dtype``; torchtitan's own DCP manager's step read through
``initial_load_path``. Two ranks SIGKILLed while a save may be in flight resume from the newest
committed step, bit-exact. Single-process tests cover an S3 folder (moto), Hugging Face loads
(FP8 block-quantized ones dequantised as DCP's quantized reader does) and exports from live state
through a state-dict adapter, the policies (``load_only``, ``exclude_from_loading``,
``enable=False``) and the refused configurations."""

from __future__ import annotations

import os
import pickle
import signal

import pytest
import torch
from torch import nn

pytest.importorskip("torchtitan.components.checkpointer",
                    reason="torchtitan (>= 0.3.0) is not installed: pip install 'ckptfs[torchtitan]'")

import ckptfs.torchtitan
from torchtitan.components.checkpointer import CheckpointManager as TitanDCPManager
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

import ckptfs
from ckptfs.testing.ranks import RanksFailed, pooled, run_ranks

Manager = ckptfs.torchtitan.CheckpointManager


class Loader:
    """A dataloader stand-in: its position, saved as torchtitan's saves its own (per-rank pickled
    bytes under ``dp_rank_<r>``); each rank draws its own batches."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.pos = rank, world, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.rank + self.pos)
        self.pos += 1
        return torch.randn(4, 16, generator=g)

    def state_dict(self) -> dict:
        return {f"dp_rank_{self.rank}": pickle.dumps({"pos": self.pos}), "world_size": self.world}

    def load_state_dict(self, sd: dict) -> None:
        assert sd["world_size"] == self.world
        self.pos = pickle.loads(sd[f"dp_rank_{self.rank}"])["pos"]


class TrainState:
    """The trainer's own state, as torchtitan's ``Trainer.state_dict``."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int32)}

    def load_state_dict(self, sd: dict) -> None:
        self.step = int(sd["step"].item())


def parts(seed: int, rank: int = 0, world: int = 1, shard: bool = False) -> dict:
    """What torchtitan's trainer hands its checkpointer (model, optimizers, LR schedulers,
    dataloader, train state), built with torchtitan's own containers."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    if shard:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": 1e-2, "weight_decay": 0.1})],
        implementation="for-loop").build(model_parts=[model])
    lr = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=6)
    return {"model": model, "opt": opt, "lr": lr, "data": Loader(rank, world),
            "train": TrainState()}


def build(p: dict, root: str, **config) -> Manager:
    cfg = Manager.Config(enable=True, folder="ckpt", **config)
    return cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                     lr_schedulers=p["lr"], states={"train_state": p["train"]}, sd_adapter=None,
                     base_folder=root)


def train(p: dict, mgr, steps: range, last: int) -> None:
    """torchtitan's loop: a step, then ``save(step, last_step=...)``; staging waited for before
    the optimizer changes the weights again."""
    for step in steps:
        p["train"].step = step
        loss = p["model"](p["data"].next()).square().mean()
        loss.backward()
        mgr.maybe_wait_for_staging()
        p["opt"].step()
        p["lr"].step()
        p["opt"].zero_grad()
        mgr.save(step, last_step=step == last)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def snapshot(p: dict) -> dict:
    """Every tensor and value of the run, whole (DTensors gathered)."""
    opt = {k: full(v).clone() if isinstance(v, torch.Tensor) else v
           for k, v in p["opt"].state_dict().items()}
    return {"model": {k: full(v).clone() for k, v in p["model"].state_dict().items()},
            "opt": opt, "lr": p["lr"].state_dict(), "pos": p["data"].pos, "step": p["train"].step}


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, dict):
            if not same(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _resume(rank: int, world: int, root: str) -> None:
    policy = {"interval": 2, "keep_latest_k": 2, "async_mode": "async",
              "export_dtype": "bfloat16"}
    ref = parts(0, rank, world, shard=True)
    mgr = build(ref, f"{root}/ref", **policy)
    assert mgr.load() is False  # an empty folder, no initial_load_path: a fresh start
    train(ref, mgr, range(1, 7), last=6)
    mgr.close()
    want = snapshot(ref)

    run = parts(0, rank, world, shard=True)
    mgr = build(run, f"{root}/run", **policy)
    train(run, mgr, range(1, 6), last=6)  # saves 2 and 4, stops after step 5
    mgr.close()

    again = parts(7, rank, world, shard=True)  # other weights: all must come from the checkpoint
    mgr = build(again, f"{root}/run", **policy)
    assert mgr.load() is True
    assert again["train"].step == 4 and again["data"].pos == 4
    assert again["lr"].state_dict() == {"last_epoch": 4}
    train(again, mgr, range(5, 7), last=6)
    mgr.close()
    got = snapshot(again)
    assert same(got, want), "the resumed run differs from the uninterrupted one"

    # the last step is model-only in export_dtype, and a fresh model loads it as the latest
    meta = ckptfs.load_metadata(f"{root}/ref/ckpt/step-00000006")
    assert "optimizer" not in meta.containers
    assert {e.dtype for e in meta.tensors.values()} == {"bfloat16"}
    fresh = parts(3, rank, world, shard=False)
    fresh["model"].to(torch.bfloat16)
    mgr = build(fresh, f"{root}/ref", **policy)
    assert mgr.load() is True
    mgr.close()
    for k, v in want["model"].items():
        assert torch.equal(fresh["model"].state_dict()[k], v.to(torch.bfloat16)), k

    # torchtitan's own DCP manager's step, read through initial_load_path
    titan = parts(0, rank, world, shard=True)
    cfg = TitanDCPManager.Config(enable=True, folder="titan", interval=2,
                                 keep_latest_k=0)
    own = cfg.build(dataloader=titan["data"], model_parts=[titan["model"]],
                    optimizers=titan["opt"], lr_schedulers=titan["lr"],
                    states={"train_state": titan["train"]}, sd_adapter=None, base_folder=root)
    train(titan, own, range(1, 3), last=99)
    own.close()
    saved = snapshot(titan)
    moved = parts(5, rank, world, shard=True)
    mgr = build(moved, f"{root}/moved", initial_load_path=f"{root}/titan/step-2",
                initial_load_model_only=False)
    assert mgr.load() is True
    mgr.close()
    got = snapshot(moved)
    assert got.pop("pos") == 0 and saved.pop("pos") == 2  # DCP's pickled dataloader state: not read
    assert same(got, saved), "torchtitan's DCP step did not load whole"


class NoCheckpoints:
    """The loop without a checkpointer (the uninterrupted reference)."""

    def save(self, step: int, last_step: bool = False) -> bool:
        return False

    def maybe_wait_for_staging(self) -> None:
        pass


def _killed(rank: int, world: int, root: str) -> None:
    p = parts(0, rank, world, shard=True)
    mgr = build(p, root, interval=2, keep_latest_k=2, async_mode="async")
    train(p, mgr, range(1, 5), last=6)  # step 4's save may still be writing: SIGKILL now
    os.kill(os.getpid(), signal.SIGKILL)


def _after_kill(rank: int, world: int, root: str) -> None:
    ref = parts(0, rank, world, shard=True)
    train(ref, NoCheckpoints(), range(1, 7), last=6)
    again = parts(7, rank, world, shard=True)
    mgr = build(again, root, interval=2, keep_latest_k=2, async_mode="async")
    assert mgr.load() is True
    resumed = again["train"].step
    assert resumed in (2, 4), resumed  # the newest committed step
    train(again, mgr, range(resumed + 1, 7), last=6)
    mgr.close()
    assert same(snapshot(again), snapshot(ref)), f"resumed from step {resumed}: differs"


@pytest.mark.slow
def test_two_ranks_killed_during_an_async_save_resume_bit_exact(tmp_path, rank_pool):
    with pytest.raises(RanksFailed):
        run_ranks(2, _killed, str(tmp_path), timeout=120)
    with pooled(rank_pool):  # the resume leaves nothing behind: the run's pool, not 2 new ranks
        run_ranks(2, _after_kill, str(tmp_path), timeout=120)


@pytest.mark.slow
@pytest.mark.pooled_ranks  # its ranks leave nothing behind: the run's pool
def test_two_ranks_save_async_stop_and_resume_bit_exact(tmp_path):
    run_ranks(2, _resume, str(tmp_path), timeout=300)
    steps = sorted(os.listdir(tmp_path / "ref" / "ckpt"))
    assert steps == ["step-00000004", "step-00000006"]  # keep_latest_k=2: step 2 deleted
    assert ckptfs.CheckpointManager(str(tmp_path / "run" / "ckpt")).steps() == [4, 6]


def test_an_object_store_folder_keeps_k_steps_and_resumes(s3):
    policy = {"interval": 1, "keep_latest_k": 2, "async_mode": "async",
              "storage_options": s3.options, "last_save_model_only": False}
    p = parts(0)
    cfg = Manager.Config(enable=True, folder=f"{s3.url}/run", **policy)
    mgr = cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                    lr_schedulers=p["lr"], states={"train_state": p["train"]}, sd_adapter=None)
    train(p, mgr, range(1, 4), last=3)
    mgr.close()
    with ckptfs.CheckpointManager(f"{s3.url}/run", storage_options=s3.options) as steps:
        assert steps.steps() == [2, 3]  # keep_latest_k=2
    q = parts(1)
    cfg = Manager.Config(enable=True, folder=f"{s3.url}/run", **policy)
    mgr = cfg.build(dataloader=q["data"], model_parts=[q["model"]], optimizers=q["opt"],
                    lr_schedulers=q["lr"], states={"train_state": q["train"]}, sd_adapter=None)
    assert mgr.load() is True
    mgr.close()
    assert same(snapshot(q), snapshot(p))


def test_load_only_never_saves_and_exclude_from_loading_keeps_the_state(tmp_path):
    p = parts(0)
    mgr = build(p, str(tmp_path), interval=1, keep_latest_k=0)
    train(p, mgr, range(1, 3), last=99)
    mgr.close()
    saved = snapshot(p)

    q = parts(1)
    before = snapshot(q)
    mgr = build(q, str(tmp_path), interval=1, keep_latest_k=0, load_only=True,
                exclude_from_loading=["optimizer", "lr_scheduler", "dataloader"])
    assert mgr.load() is True
    assert same(snapshot(q)["model"], saved["model"]) and q["train"].step == 2
    assert q["data"].pos == 0 and q["lr"].state_dict() == before["lr"]
    assert same(snapshot(q)["opt"], before["opt"])
    assert mgr.save(4) is False  # load_only
    mgr.close()
    assert ckptfs.CheckpointManager(str(tmp_path / "ckpt")).steps() == [1, 2]


class Renamer:
    """A state-dict adapter as torchtitan's models have: native keys <-> Hugging Face keys."""

    hf_assets_path = None

    def to_hf(self, sd: dict) -> dict:
        return {f"model.layers.{k}": v for k, v in sd.items()}

    def from_hf(self, sd: dict) -> dict:
        return {k.removeprefix("model.layers."): v for k, v in sd.items()}


def test_initial_load_in_hf_reads_safetensors_through_the_adapter(tmp_path):
    from safetensors.torch import save_file

    src = parts(0)
    save_file(Renamer().to_hf(src["model"].state_dict()), str(tmp_path / "model.safetensors"))
    p = parts(1)
    cfg = Manager.Config(enable=True, folder="ckpt", initial_load_path=str(tmp_path),
                         initial_load_in_hf=True)
    mgr = cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                    lr_schedulers=p["lr"], states={"train_state": p["train"]},
                    sd_adapter=Renamer(), base_folder=str(tmp_path / "run"))
    assert mgr.load() is True
    mgr.close()
    assert same(snapshot(p)["model"], snapshot(src)["model"])


def test_last_save_in_hf_writes_safetensors_through_the_adapter(tmp_path):
    from safetensors.torch import load_file

    p = parts(0)
    cfg = Manager.Config(enable=True, folder="ckpt", interval=10, last_save_in_hf=True,
                         export_dtype="bfloat16")
    mgr = cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                    lr_schedulers=p["lr"], states={"train_state": p["train"]},
                    sd_adapter=Renamer(), base_folder=str(tmp_path))
    train(p, mgr, range(1, 3), last=2)
    mgr.close()
    hf = load_file(str(tmp_path / "ckpt" / "step-2-hf" / "model.safetensors"))
    want = Renamer().to_hf(snapshot(p)["model"])
    assert hf.keys() == want.keys()
    assert all(torch.equal(hf[k], v.to(torch.bfloat16)) for k, v in want.items())


class ShardedRenamer(Renamer):
    """An adapter whose Hugging Face checkpoint has two files (``fqn_to_index_mapping``)."""

    fqn_to_index_mapping = {"model.layers.0.weight": 1, "model.layers.0.bias": 1,
                            "model.layers.2.weight": 2, "model.layers.2.bias": 2}


def test_last_save_in_hf_writes_the_adapters_files_from_live_state(tmp_path):
    from safetensors.torch import load_file

    p = parts(0)
    cfg = Manager.Config(enable=True, folder="ckpt", interval=10, last_save_in_hf=True)
    mgr = cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                    lr_schedulers=p["lr"], states={"train_state": p["train"]},
                    sd_adapter=ShardedRenamer(), base_folder=str(tmp_path))
    train(p, mgr, range(1, 3), last=2)
    mgr.close()
    out = tmp_path / "ckpt" / "step-2-hf"
    assert sorted(f.name for f in out.iterdir()) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json"]
    want = Renamer().to_hf(snapshot(p)["model"])
    first = load_file(str(out / "model-00001-of-00002.safetensors"))
    assert sorted(first) == ["model.layers.0.bias", "model.layers.0.weight"]
    assert torch.equal(first["model.layers.0.weight"], want["model.layers.0.weight"].to(torch.float32))
    assert ckptfs.CheckpointManager(str(tmp_path / "ckpt")).steps() == []  # no ckptfs step first


def test_initial_load_in_hf_quantized_dequantises_fp8_weights(tmp_path):
    import json

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    hf = Renamer().to_hf(parts(0)["model"].state_dict())
    stored = {}
    for k, v in hf.items():
        if k.endswith("weight"):  # one 128 x 128 tile each: scale = max |w| / 448
            scale = v.abs().max() / 448
            stored[k] = (v / scale).to(torch.float8_e4m3fn)
            stored[k + "_scale_inv"] = scale.reshape(1, 1)
        else:
            stored[k] = v
    save_file(stored, str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": dict.fromkeys(stored, "model.safetensors")}))
    ref = {k: torch.zeros_like(v) for k, v in hf.items()}
    dcp.load(ref, storage_reader=QuantizedHuggingFaceStorageReader(str(tmp_path)), no_dist=True)
    p = parts(1)
    cfg = Manager.Config(enable=True, folder="ckpt", initial_load_path=str(tmp_path),
                         initial_load_in_hf=True, initial_load_in_hf_quantized=True)
    mgr = cfg.build(dataloader=p["data"], model_parts=[p["model"]], optimizers=p["opt"],
                    lr_schedulers=p["lr"], states={"train_state": p["train"]},
                    sd_adapter=Renamer(), base_folder=str(tmp_path / "run"))
    assert mgr.load() is True
    mgr.close()
    got = Renamer().to_hf(p["model"].state_dict())
    assert all(torch.equal(got[k], v) for k, v in ref.items())
    assert not torch.equal(got["model.layers.0.weight"], hf["model.layers.0.weight"])  # lossy FP8


def test_a_step_not_saved_is_refused_naming_it(tmp_path):
    p = parts(0)
    mgr = build(p, str(tmp_path), interval=2, keep_latest_k=0)
    train(p, mgr, range(1, 3), last=99)
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="step 3"):
        mgr.load(step=3)
    mgr.close()


def test_disabled_manager_does_nothing(tmp_path):
    p = parts(0)
    mgr = Manager.Config(enable=False, folder="x").build(
        dataloader=None, model_parts=[p["model"]], optimizers=p["opt"], lr_schedulers=p["lr"],
        states={}, sd_adapter=None, base_folder=str(tmp_path))
    assert mgr.save(500) is False and mgr.load() is False
    mgr.close()
    assert not (tmp_path / "x").exists()


def test_refused_configurations_name_the_field(tmp_path):
    with pytest.raises(ckptfs.ConfigError, match="async_mode"):
        Manager.Config(enable=True, async_mode="later")  # type: ignore[arg-type]
    p = parts(0)
    with pytest.raises(ckptfs.ConfigError, match="last_save_in_hf.*sd_adapter"):
        build(p, str(tmp_path), last_save_in_hf=True)
    with pytest.raises(ckptfs.ConfigError, match="exclude_from_loading.*'nope'"):
        mgr = build(p, str(tmp_path), exclude_from_loading=["nope"])
        try:
            mgr.save(500)
            mgr.load()
        finally:
            mgr.close()
