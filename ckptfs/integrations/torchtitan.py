"""``ckptfs.torchtitan.CheckpointManager``: torchtitan's checkpoints written and read by ckptfs.

    config.checkpoint = ckptfs.torchtitan.CheckpointManager.Config(enable=True, interval=500)

torchtitan's trainer builds its checkpointer from ``config.checkpoint`` and calls the contract
of ``BaseCheckpointManager`` (``torchtitan/components/checkpointer/base.py``): ``load(step)``
before the first step, ``save(curr_step, last_step)`` after every step,
``maybe_wait_for_staging()`` before the next optimizer step, ``close()`` at the end. This
manager keeps that contract on ``ckptfs.CheckpointManager``: step ``N`` is the ckptfs checkpoint
``<folder>/step-<N>`` (committed by its index, resharded on load), saves run in ckptfs's
background saver, ``keep_latest_k`` is ckptfs's retention. The saved tree is torchtitan's: the
model's keys flat at the top, then ``optimizer``, ``lr_scheduler``, ``dataloader`` (per rank)
and ``train_state``. Needs the ``torchtitan`` extra (tested with torchtitan 0.3.0).
"""

from __future__ import annotations

import base64
import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ckptfs.errors import ConfigError, MismatchError
from ckptfs.load import load
from ckptfs.manager import CheckpointManager as _CkptfsManager
from ckptfs.manager import ManagerOptions, Retention
from ckptfs.metadata import load_metadata
from ckptfs.state.flatten import PerRank
from ckptfs.tools.hf_export import export_hf
from ckptfs.tools.hf_fp8 import load_hf_fp8

try:
    from torchtitan.components.checkpointer.base import (
        DATALOADER,
        LR_SCHEDULER,
        MODEL,
        OPTIMIZER,
        BaseCheckpointManager,
        ModelWrapper,
    )
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import filesystem
except ImportError as e:  # pragma: no cover - the extra is installed where it is tested
    raise ConfigError("ckptfs.torchtitan needs torchtitan (>= 0.3.0, with "
                      "torchtitan.components.checkpointer); install the 'torchtitan' extra: "
                      "pip install 'ckptfs[torchtitan]'") from e

log = logging.getLogger(__name__)

_ASYNC_MODES = ("disabled", "async", "async_with_pinned_mem")
#: prefix of the str a ``bytes`` leaf is saved as (torchtitan's dataloader pickles its state)
_B64 = "base64:"


class CheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract on ``ckptfs.CheckpointManager``.

    Built by torchtitan's trainer as ``config.checkpoint.build(dataloader=..., model_parts=...,
    optimizers=..., lr_schedulers=..., states={"train_state": trainer}, sd_adapter=...,
    base_folder=...)``; every rank calls ``load``, ``save`` and ``close`` together.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        """torchtitan's checkpoint policies, plus where and how ckptfs writes."""

        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """``disabled``: ``save`` returns once the step is committed; ``async`` and
        ``async_with_pinned_mem``: once this rank's state is staged (copied out), the write
        and commit run in ckptfs's background saver and the next save waits for them."""

        backend: str = "safetensors_chunks"
        """The ckptfs layout of each step (``ckptfs.available_backends()``)."""

        storage_options: dict[str, Any] = field(default_factory=dict)
        """Options of the store ``folder`` names (object-store credentials, endpoint)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]
            if self.async_mode not in _ASYNC_MODES:
                raise ConfigError(f"checkpoint.async_mode: {self.async_mode!r} is not one of "
                                  f"{list(_ASYNC_MODES)}")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any],
                 sd_adapter: Any = None, base_folder: str = "") -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder) if base_folder else config.folder
        self.states = states
        self.states.update({MODEL: ModelWrapper(model_parts), OPTIMIZER: optimizers,
                            DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        self.sd_adapter = sd_adapter
        if config.last_save_in_hf and sd_adapter is None:
            raise ConfigError("checkpoint.last_save_in_hf needs the model's state-dict adapter "
                              "(sd_adapter), and the trainer gave none")
        self.export_dtype = TORCH_DTYPE_MAP[config.export_dtype]
        self.save_future: Future | None = None
        self.staging_future: Future | None = None
        keep = config.keep_latest_k or None
        #: the ckptfs manager holding the steps (ckptfs.CheckpointManager)
        self.manager = _CkptfsManager(self.folder, ManagerOptions(retention=Retention(keep_last=keep)),
                                      backend=config.backend,
                                      storage_options=config.storage_options or None)

    # -- saving -----------------------------------------------------------------------------
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        cfg = self.config
        if cfg.load_only:
            return False
        return ((curr_step == 1 and cfg.enable_first_step_checkpoint) or last_step
                or curr_step % cfg.interval == 0)

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        self.maybe_wait_for_saving()
        if last_step:
            self._save_last(curr_step)
            return True
        handle = self.manager.save(curr_step, self._state(), force=True)
        if self.config.async_mode == "disabled":
            handle.result()
        else:
            self.save_future = handle.done
        return True

    def _save_last(self, step: int) -> None:
        """The last step: model-only in ``export_dtype`` (or everything); with
        ``last_save_in_hf`` (model-only, as torchtitan requires) the model's live state goes
        through the adapter straight into Hugging Face safetensors at
        ``<folder>/step-<N>-hf``, every rank writing its share of the files
        (``ckptfs.export_hf``; the adapter's ``fqn_to_index_mapping`` names the files, else
        one ``model.safetensors``), and no ckptfs step is written."""
        if self.config.last_save_in_hf:
            hf = self.sd_adapter.to_hf(self._state(model_only=True))
            export_hf(hf, f"{self.folder}/step-{step}-hf", dtype=self.export_dtype,
                      file_index=getattr(self.sd_adapter, "fqn_to_index_mapping", None),
                      overwrite=True)
            return
        state = self._export_state() if self.config.last_save_model_only else self._state()
        self.manager.save_sync(step, state, force=True)

    def _state(self, model_only: bool = False) -> dict[str, Any]:
        """The tree a step holds: the model's keys flat, then the other states by name."""
        tree: dict[str, Any] = dict(self.states[MODEL].state_dict())
        if model_only:
            return tree
        for name, obj in self.states.items():
            if name == MODEL or name in tree or obj is None:
                continue
            got = _encode_bytes(obj.state_dict() if hasattr(obj, "state_dict") else obj)
            tree[name] = PerRank(got) if name == DATALOADER else got
        return tree

    def _export_state(self) -> dict[str, Any]:
        """The last step's model-only tree, its floating tensors in ``export_dtype``."""
        return {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor)
                and v.is_floating_point() and v.dtype != self.export_dtype else v
                for k, v in self._state(model_only=True).items()}

    # -- loading ----------------------------------------------------------------------------
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            return self._restore(step)
        latest = self.manager.latest_step()
        if latest is not None:
            return self._restore(latest)
        return self._initial_load()

    def _restore(self, step: int) -> bool:
        """Fill every state from the committed ``step`` (model only for step 0 or a step saved
        model-only, as the last step is by default)."""
        model_only = step == 0 or OPTIMIZER not in self.manager.metadata(step).containers
        target = self._target(model_only)
        self.manager.restore(target, step)
        self._apply(target)
        return True

    def _initial_load(self) -> bool:
        """An empty folder: ``initial_load_path`` (a ckptfs checkpoint, a DCP checkpoint such as
        one of torchtitan's own steps, or with ``initial_load_in_hf`` Hugging Face safetensors
        through ``sd_adapter``; with ``initial_load_in_hf_quantized`` too, FP8 block-quantized
        weights dequantised on read, ``ckptfs.load_hf_fp8``), else a fresh start."""
        cfg = self.config
        path = cfg.initial_load_path
        if path is None and cfg.initial_load_in_hf and self.sd_adapter is not None:
            path = self.sd_adapter.hf_assets_path
        if not path:
            return False
        opts = cfg.storage_options or None
        if cfg.initial_load_in_hf:
            if self.sd_adapter is None:
                raise ConfigError("checkpoint.initial_load_in_hf needs the model's state-dict "
                                  "adapter (sd_adapter), and the trainer gave none")
            hf = self.sd_adapter.to_hf(self.states[MODEL].state_dict())
            if cfg.initial_load_in_hf_quantized:  # FP8 weights, dequantised on read
                load_hf_fp8(hf, path, storage_options=opts)
            else:
                load(hf, path, storage_options=opts)
            self.states[MODEL].load_state_dict(self.sd_adapter.from_hf(hf))
            return True
        target = self._target(cfg.initial_load_model_only)
        if DATALOADER in target and DATALOADER not in load_metadata(path, storage_options=opts).per_rank:
            # DCP keeps the dataloader's pickled bytes, which ckptfs does not read
            log.warning("ckptfs.torchtitan: %s holds no dataloader state ckptfs reads (a DCP "
                        "checkpoint's is pickled bytes); the dataloader starts afresh", path)
            del target[DATALOADER]
        load(target, path, storage_options=opts)
        self._apply(target)
        return True

    def _target(self, model_only: bool) -> dict[str, Any]:
        """The tree to load into: ``_state`` without ``exclude_from_loading``."""
        excluded = set(self.config.exclude_from_loading)
        unknown = sorted(excluded - set(self.states))
        if unknown:
            raise ConfigError(f"checkpoint.exclude_from_loading: {unknown} name no state "
                              f"(states: {sorted(self.states)})")
        tree = self._state(model_only)
        return {k: v for k, v in tree.items() if k not in excluded}

    def _apply(self, target: dict[str, Any]) -> None:
        """Hand the loaded tree to the states (``load_state_dict`` of each ``Stateful``)."""
        self.states[MODEL].load_state_dict(target)
        for name, obj in self.states.items():
            if name == MODEL or name not in target or not hasattr(obj, "load_state_dict"):
                continue
            got = target[name]
            got = got.value if isinstance(got, PerRank) else got
            if _holds_bytes(got):  # where the state itself holds bytes, they come back as bytes
                got = _decode_bytes(got, obj.state_dict(), name)
            obj.load_state_dict(got)

    # -- waiting and closing ----------------------------------------------------------------
    def _maybe_wait_for_staging(self) -> None:
        # ckptfs's manager returns from save once the state is staged: nothing is left to wait
        if self.staging_future is not None:
            self.staging_future.result()
            self.staging_future = None

    def _wait_for_saving(self) -> None:
        assert self.save_future is not None
        future, self.save_future = self.save_future, None
        future.result()

    def _close(self) -> None:
        try:
            self.maybe_wait_for_saving()
        finally:
            self.manager.close()


def _encode_bytes(obj: Any) -> Any:
    """``obj`` with every ``bytes`` leaf as a base64 str (ckptfs stores no raw bytes values)."""
    if isinstance(obj, bytes):
        return _B64 + base64.b64encode(obj).decode("ascii")
    if isinstance(obj, dict):
        return {k: _encode_bytes(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_encode_bytes(v) for v in obj)
    return obj


def _holds_bytes(obj: Any) -> bool:
    if isinstance(obj, str):
        return obj.startswith(_B64)
    if isinstance(obj, dict):
        return any(_holds_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_holds_bytes(v) for v in obj)
    return False


def _decode_bytes(obj: Any, like: Any, key: str) -> Any:
    """The inverse of ``_encode_bytes`` on a loaded tree, where ``like`` (the state's own tree,
    matched by key) holds bytes (``key``: where ``obj`` sits, for errors)."""
    if isinstance(obj, str) and isinstance(like, bytes) and obj.startswith(_B64):
        try:
            return base64.b64decode(obj[len(_B64):], validate=True)
        except ValueError as e:
            raise MismatchError(f"key {key!r}: the saved bytes value is not base64: {e}") from e
    if isinstance(obj, dict):
        like = like if isinstance(like, dict) else {}
        return {k: _decode_bytes(v, like.get(k), f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        likes = list(like) if isinstance(like, list | tuple) else []
        return type(obj)(_decode_bytes(v, likes[i] if i < len(likes) else None, f"{key}/{i}")
                         for i, v in enumerate(obj))
    return obj


__all__ = ["CheckpointManager"]
