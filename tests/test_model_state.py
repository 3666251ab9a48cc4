"""``save_model_and_optim_state`` / ``load_model_and_optim_state`` (OLMo-core's helpers) on FSDP2
(``fully_shard``) modules over 2 spawned gloo ranks and on plain modules, with key_mapping,
strictness and flattened optimizer state; and a Hugging Face directory loaded into DTensors,
each rank reading only its bytes. One spawn serves every ranked case."""

from __future__ import annotations

import json
import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

import ckptfs
from ckptfs.testing.ranks import run_ranks

pytestmark = pytest.mark.slow  # every test spawns ranks

WORLD = 2


class Net(nn.Module):
    def __init__(self, first: str = "inp", last: str = "out", extra: bool = False) -> None:
        super().__init__()
        self.names = (first, last)
        setattr(self, first, nn.Linear(6, 8))
        setattr(self, last, nn.Linear(8, 4))
        if extra:
            self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = (getattr(self, n) for n in self.names)
        return b(torch.relu(a(x)))


def make(seed: int, wrap=None, **kw) -> tuple[Net, torch.optim.Optimizer]:
    """A model (sharded by ``wrap`` first, if given) and its optimizer."""
    torch.manual_seed(seed)
    model = Net(**kw)
    if wrap is not None:
        wrap(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int = 7) -> None:
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd}


def diffs(a, b, where: str = "") -> list[str]:
    if isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in b for d in diffs(a[k], b[k], f"{where}/{k}")]
    if isinstance(b, list | tuple):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in diffs(x, y, f"{where}/{i}")]
    if isinstance(b, torch.Tensor):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        ok = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
            if b.numel() and b.dim() else torch.equal(a, b)
        return [] if ok else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


# ---------------------------------------------------------------------------- spawned ranks
def ranks_main(rank: int, world: int, root: str, hf_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    out = Path(root)
    errors: dict[str, str | None] = {}

    def shard(model: Net) -> Net:
        for name in model.names:
            fully_shard(getattr(model, name), mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    def fsdp2() -> None:
        model, opt = make(0, shard)
        train_step(model, opt)
        res = ckptfs.save_model_and_optim_state(out / "fsdp", model, opt)
        assert res.bytes_written < res.total_bytes, "each rank writes only its shards"
        ref = full_state(model, opt)
        if rank == 0:
            torch.save(ref, out / "ref.pt")
        fresh, fresh_opt = make(1, shard)
        ckptfs.load_model_and_optim_state(out / "fsdp", fresh, fresh_opt)
        bad = diffs(full_state(fresh, fresh_opt), ref)
        assert not bad, bad[:5]
        train_step(model, opt, 8)  # the optimizer state took effect: the next steps agree
        train_step(fresh, fresh_opt, 8)
        bad = diffs(full_state(fresh, fresh_opt)["model"], full_state(model, opt)["model"])
        assert not bad, bad[:5]

    def hf_dtensors() -> None:
        from torch.distributed.tensor import Shard, distribute_tensor

        whole = ckptfs.load_keys(hf_dir)
        targets = {k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(i % t.dim())], src_data_rank=None)
                   for i, (k, t) in enumerate(sorted(whole.items()))}
        res = ckptfs.load(targets, hf_dir, store_options=ckptfs.StoreOptions(max_gap=0))  # no coalescing
        for k, t in targets.items():
            want = distribute_tensor(whole[k], mesh, t.placements, src_data_rank=None).to_local()
            assert torch.equal(t.to_local(), want), k
        total = sum(t.nbytes for t in whole.values())
        assert res.bytes_read == res.bytes_needed < total, (res.bytes_read, res.bytes_needed, total)

    for name, case in (("fsdp2", fsdp2), ("hf_dtensors", hf_dtensors)):
        try:
            case()
            errors[name] = None
        except Exception:
            errors[name] = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps(errors))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> Path:
    from tests.test_tools import write_hf

    root = tmp_path_factory.mktemp("model_state")
    write_hf(root / "hf")
    run_ranks(WORLD, ranks_main, str(root), str(root / "hf"))
    return root


def _case(root: Path, case: str) -> None:
    errors = {r: json.loads((root / f"rank{r}.json").read_text())[case] for r in range(WORLD)}
    bad = {r: e for r, e in errors.items() if e}
    if bad:
        pytest.fail("\n".join(f"rank {r}:\n{e}" for r, e in bad.items()), pytrace=False)


def test_fsdp2_save_and_load_on_two_ranks(spawned):
    _case(spawned, "fsdp2")
    meta = ckptfs.load_metadata(spawned / "fsdp")
    assert {c.offsets for c in meta.tensors["model/inp.weight"].chunks} == {(0, 0), (4, 0)}
    assert "optim/state/inp.weight/exp_avg" in meta.tensors and "optim/param_groups/0/lr" in meta.values


def test_hf_directory_loads_into_dtensors_reading_only_each_ranks_bytes(spawned):
    _case(spawned, "hf_dtensors")


def test_plain_module_loads_the_fsdp2_checkpoint(spawned):
    ref = torch.load(spawned / "ref.pt", weights_only=True)
    model, opt = make(3)
    res = ckptfs.load_model_and_optim_state(spawned / "fsdp", model, opt)
    assert res.missing_keys == [] and res.unexpected_keys == []
    assert not diffs(full_state(model, opt), ref)


def test_key_mapping_strict_and_flattened_optimizer_state(spawned, tmp_path):
    ref = torch.load(spawned / "ref.pt", weights_only=True)
    renamed, opt = make(4, first="enc", last="dec")
    mapping = {f"{new}.{p}": f"{old}.{p}" for new, old in (("enc", "inp"), ("dec", "out"))
               for p in ("weight", "bias")}
    ckptfs.load_model_and_optim_state(spawned / "fsdp", renamed, opt, key_mapping=mapping)
    got = full_state(renamed, opt)
    back = {v: k for k, v in mapping.items()}
    assert not diffs(got["model"], {back[k]: v for k, v in ref["model"].items()})
    assert not diffs(got["optim"]["state"], {back[k]: v for k, v in ref["optim"]["state"].items()})
    assert got["optim"]["param_groups"][0]["params"] == [back[p] for p in ref["optim"]["param_groups"][0]["params"]]

    extra, opt = make(5, extra=True)
    with pytest.raises(ckptfs.MissingKeysError, match="model/scale"):
        ckptfs.load_model_and_optim_state(spawned / "fsdp", extra, opt)
    res = ckptfs.load_model_and_optim_state(spawned / "fsdp", extra, opt, strict=False)
    assert "model/scale" in res.missing_keys
    assert torch.equal(extra.inp.weight.detach(), ref["model"]["inp.weight"])

    model, opt = make(6)
    train_step(model, opt)
    ckptfs.save_model_and_optim_state(tmp_path / "flat", model, opt, flatten_optimizer_state=True)
    assert "optim/state.inp.weight.exp_avg" in ckptfs.load_metadata(tmp_path / "flat").tensors
    fresh, fresh_opt = make(7)
    ckptfs.load_model_and_optim_state(tmp_path / "flat", fresh, fresh_opt, flatten_optimizer_state=True)
    assert not diffs(full_state(fresh, fresh_opt), full_state(model, opt))
    with pytest.raises(ckptfs.CheckpointExistsError):
        ckptfs.save_model_and_optim_state(tmp_path / "flat", model, opt)
    ckptfs.save_model_and_optim_state(tmp_path / "flat", model, overwrite=True, backend="zarr")
    assert set(ckptfs.load_metadata(tmp_path / "flat").tensors) == {f"model/{k}" for k in model.state_dict()}
