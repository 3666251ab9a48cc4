"""Model and optimizer checkpoints in one call, as OLMo-core's helpers: the state comes from
``torch.distributed.checkpoint.state_dict`` (FQN-keyed, DTensor shards for FSDP2 and
tensor-parallel modules, optimizer state initialised), is saved as
``{"model": ..., "optim": ...}`` and loaded back in place on any world size and sharding.

``async_save_model_and_optim_state`` saves the same state in the background
(``ckptfs.async_save``): change the model or step the optimizer only after ``handle.staged``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ckptfs.async_save import AsyncSave, async_save
from ckptfs.errors import MissingKeysError
from ckptfs.load import LoadResult, load
from ckptfs.save import SaveResult, save

log = logging.getLogger(__name__)

MODEL, OPTIM = "model", "optim"


def _options(flatten: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=False, flatten_optimizer_state_dict=flatten, strict=strict)


def model_and_optim_state(model: torch.nn.Module, optim: torch.optim.Optimizer | None = None, *,
                          flatten_optimizer_state: bool = False) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (no "optim" without an optimizer) as the helpers save
    and load it. ``flatten_optimizer_state`` uses DCP's flat optimizer keys
    (``state.<fqn>.<name>``, ``param_groups.<fqn>.<name>``), needed when param groups differ
    between ranks (pipeline parallelism); save and load must agree on it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    opts = _options(flatten_optimizer_state)
    if optim is None:
        return {MODEL: get_model_state_dict(model, options=opts)}
    msd, osd = get_state_dict(model, optim, options=opts)
    return {MODEL: msd, OPTIM: osd}


@torch.no_grad()
def save_model_and_optim_state(url: str | os.PathLike, model: torch.nn.Module,
                               optim: torch.optim.Optimizer | None = None, *,
                               flatten_optimizer_state: bool = False,
                               **save_options: Any) -> SaveResult:
    """Save the model's (and optimizer's) state to ``url``; every rank calls this. Sharded
    modules (FSDP2 ``fully_shard``, DTensor parallelism) write only their own shards; plain
    modules are written once. ``save_options`` go to ``ckptfs.save`` (``overwrite``,
    ``backend``, ``storage_options``, ``process_group``, ``throttle_uploads``, ...)."""
    state = model_and_optim_state(model, optim, flatten_optimizer_state=flatten_optimizer_state)
    return save(state, url, **save_options)


@torch.no_grad()
def async_save_model_and_optim_state(url: str | os.PathLike, model: torch.nn.Module,
                                     optim: torch.optim.Optimizer | None = None, *,
                                     flatten_optimizer_state: bool = False,
                                     **save_options: Any) -> AsyncSave:
    """``save_model_and_optim_state`` in the background: returns ``ckptfs.async_save``'s handle
    at once. Do not step the optimizer (or change the model) before ``handle.staged``."""
    state = model_and_optim_state(model, optim, flatten_optimizer_state=flatten_optimizer_state)
    return async_save(state, url, **save_options)


@torch.no_grad()
def load_model_and_optim_state(url: str | os.PathLike, model: torch.nn.Module,
                               optim: torch.optim.Optimizer | None = None, *,
                               key_mapping: Mapping[str, str] | None = None, strict: bool = True,
                               flatten_optimizer_state: bool = False,
                               **load_options: Any) -> LoadResult:
    """Load the model's (and optimizer's) state in place from ``url``, whatever world size and
    sharding saved it; every rank calls this. ``key_mapping`` maps a parameter's current FQN
    to its FQN in the checkpoint (renamed modules); it applies to the optimizer state too.
    ``strict`` refuses keys of the model or optimizer missing from the checkpoint (checked by
    ``ckptfs.load`` before anything is read, and again by torch's ``set_state_dict``).
    ``load_options`` go to ``ckptfs.load`` (``storage_options``, ``process_group``,
    ``pre_download``, ``work_dir``, ...)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = model_and_optim_state(model, optim, flatten_optimizer_state=flatten_optimizer_state)
    mapping = dict(key_mapping or {})
    _check_mapping(url, state[MODEL], mapping, strict)
    if mapping:
        swap_param_keys(state, mapping)
    result = load(state, url, strict=strict, **load_options)
    if mapping:
        swap_param_keys(state, {v: k for k, v in mapping.items()})
    opts = _options(flatten_optimizer_state, strict)
    set_model_state_dict(model, state[MODEL], options=opts)
    if optim is not None:
        set_optimizer_state_dict(model, optim, state[OPTIM], options=opts)
    return result


def _check_mapping(url: str | os.PathLike, model: Mapping[str, Any], mapping: Mapping[str, str],
                   strict: bool) -> None:
    """``key_mapping`` keys the model lacks: MissingKeysError naming them (strict), else a warning."""
    absent = sorted(k for k in mapping if k not in model)
    if not absent:
        return
    shown = ", ".join(repr(k) for k in absent[:20])
    message = (f"key_mapping names {len(absent)} key(s) the model lacks: {shown} (loading "
               f"{os.fspath(url)}; a key_mapping maps the model's own parameter names)")
    if strict:
        err = MissingKeysError(os.fspath(url), absent)
        err.args = (message,)
        raise err
    log.warning("ckptfs: %s", message)


def swap_param_keys(state: dict[str, Any], mapping: Mapping[str, str]) -> None:
    """Rename parameters ``old -> new`` in place: model keys, optimizer state keys and the FQNs
    listed in param groups (nested or flattened optimizer state)."""
    model = state[MODEL]
    for old, new in mapping.items():
        if old in model:
            model[new] = model.pop(old)
    optim = state.get(OPTIM)
    if optim is None:
        return
    if "state" in optim or "param_groups" in optim:  # nested: {"state": {fqn: ...}, "param_groups": [...]}
        st = optim.get("state", {})
        for old, new in mapping.items():
            if old in st:
                st[new] = st.pop(old)
        for group in optim.get("param_groups", []):
            group["params"] = [mapping.get(p, p) for p in group["params"]]
        return
    for key in list(optim):  # flattened: "state.<fqn>.<name>", "param_groups.<fqn>.<name>"
        for prefix in ("state.", "param_groups."):
            if key.startswith(prefix):
                for old, new in mapping.items():
                    if key.startswith(f"{prefix}{old}."):
                        optim[f"{prefix}{new}.{key[len(prefix) + len(old) + 1:]}"] = optim.pop(key)
                        break
