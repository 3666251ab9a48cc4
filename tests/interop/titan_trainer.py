"""torchtitan's own trainer with ckptfs's checkpoint manager: a run that saves, is killed and
resumes, bit-exact with a run that was not (``make titan-trainer``; torchtitan 0.3.0 in its venv).

Two CPU ranks (gloo, FSDP over both) train torchtitan's ``llama3_debugmodel`` through its
``Trainer`` (its dataloader over a small local text set, its AdamW and LR schedule), with
``config.checkpoint = ckptfs.torchtitan.CheckpointManager.Config(interval=2)``:

1. a first run trains 6 steps, saving steps 2, 4 and 6;
2. a second run trains the same 6 steps and is SIGKILLed (the launcher and each rank) once
   step 4 is committed; step 6 was never saved;
3. a third starts again in the second's folder: torchtitan's trainer loads step 4 through
   ckptfs (model, optimizer, LR schedulers, dataloader position, train state) and trains to
   step 6.

Step 6 of the resumed run equals step 6 of the first in every tensor and value (the dataloader's
state: the same token stream, see ``same_stream``). torchtitan 0.3.0 assumes an
accelerator in a few places; ``cpu_shims`` lists them (file and line) and routes each to CPU.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
#: torchtitan's test tokenizer (tests/assets/tokenizer of its repository, BSD-3-Clause)
TOKENIZER = os.path.join(HERE, "..", "fixtures", "torchtitan", "tokenizer")
STEPS, KILL_AFTER = 6, 4


def cpu_shims() -> None:
    """torchtitan 0.3.0's trainer on a CPU-only torch, before torchtitan is imported:

    - torchtitan/tools/utils.py:55 takes ``_get_available_device_type() or "cuda"``, so without
      an accelerator the device is "cuda" (torch.cuda.set_device fails, trainer.py:301) and the
      process group backend nccl (distributed/utils.py, ``_get_distributed_backend``): the
      device type is made "cpu" (backend gloo) and its module ``torch.cpu``, given the memory
      queries torchtitan's ``DeviceMemoryMonitor`` makes (components/metrics.py:42-50), which
      ``torch.cpu`` lacks;
    - the language models' attention is FlexAttention (models/common/config_utils.py:71: flex,
      flex_flash or varlen), compiled (models/common/attention.py:277); torch's FlexAttention
      refuses a backward on CPU (torch/nn/attention/flex_attention.py, ``_validate_device``):
      its eager form (the dense reference, with autograd, not compiled) runs instead;
    - trainer.py:1062 calls ``torch.distributed.set_timeout`` (distributed/utils.py:595),
      which torch 2.13.0 has as ``distributed_c10d._set_pg_timeout``.
    """
    import types

    import torch._utils
    import torch.distributed.distributed_c10d as c10d

    cpu = types.SimpleNamespace(**{k: getattr(torch.cpu, k) for k in dir(torch.cpu)
                                   if not k.startswith("__")})
    cpu.get_device_name = lambda *a: "cpu"
    cpu.current_device = lambda: 0
    cpu.get_device_properties = lambda *a: types.SimpleNamespace(total_memory=1 << 30)
    cpu.reset_peak_memory_stats = lambda *a: None
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda *a: {}
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda device_type=None: cpu
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = lambda timeout, group=None: c10d._set_pg_timeout(timeout, group)

    import torch.nn.attention.flex_attention as fa

    fa._validate_device = lambda *a: None
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True  # the reference as is, no compile at all
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(fa.flex_attention)


def worker(out: str, data: str) -> None:
    """One rank of a torchtitan training run (under torchrun)."""
    cpu_shims()
    import ckptfs.torchtitan
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from torchtitan.tools.logging import init_logger

    init_logger()  # each step's loss in the run's log
    cfg = llama3_debugmodel()
    cfg.hf_assets_path = TOKENIZER
    cfg.dataloader.dataset_path = data
    cfg.training.steps = STEPS
    cfg.training.seq_len = 128
    cfg.training.local_batch_size = 2
    cfg.training.disable_cuda_graphs = True
    cfg.validator.enable = False
    cfg.parallelism.spmd_backend = "partial_dtensor"  # FSDP2 over plain parameters
    # replicated data parallel (HSDP, shard degree 1): FSDP's reduce-scatter over 2 ranks
    # uses ReduceOp.PREMUL_SUM, which gloo refuses
    cfg.parallelism.data_parallel_replicate_degree = 2
    cfg.parallelism.data_parallel_shard_degree = 1
    cfg.debug.seed = 0
    # debug.deterministic would compile FlexAttention again (distributed/utils.py:234); a CPU
    # run needs none of it to repeat itself
    cfg.dump_folder = out
    cfg.checkpoint = ckptfs.torchtitan.CheckpointManager.Config(
        enable=True, interval=2, folder="checkpoint", last_save_model_only=False)
    with open(f"{out}.pid.{os.environ['RANK']}", "w") as f:
        f.write(str(os.getpid()))
    trainer = cfg.build()
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.distributed.destroy_process_group()


def launch(out: str, data: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(__file__), "--worker", out, data]
    log = open(out + ".log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def committed(out: str, step: int) -> bool:
    import ckptfs

    try:
        ckptfs.load_metadata(os.path.join(out, "checkpoint", f"step-{step:08d}"))
        return True
    except ckptfs.CkptfsError:
        return False


def finish(proc: subprocess.Popen, what: str, timeout: float = 900) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"{what}: no end in {timeout} s") from None
    assert rc == 0, f"{what}: exit status {rc} (see its .log)"


def kill_after(proc: subprocess.Popen, out: str, step: int, timeout: float = 900) -> None:
    """SIGKILL the run (torchrun's process group and each rank, which torchrun starts in a
    session of its own) once ``step`` is committed."""
    end = time.monotonic() + timeout
    while not committed(out, step):
        assert proc.poll() is None, f"the run ended (status {proc.returncode}) before step {step}"
        assert time.monotonic() < end, f"step {step} not committed in {timeout} s"
        time.sleep(0.2)
    for rank in range(2):
        with open(f"{out}.pid.{rank}") as f:
            os.kill(int(f.read()), signal.SIGKILL)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(1)


def same(a: Any, b: Any, where: str = "") -> None:
    """Equal trees: tensors bit for bit (dtype, shape, bytes), everything else by ==."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (where, sorted(set(a) ^ set(b)))
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def same_stream(a: dict, b: dict) -> None:
    """The dataloaders' states (torchtitan pickles them; ckptfs keeps the bytes) deliver the
    same tokens: equal but for the read-ahead of torchtitan's text dataset, which after a resume
    holds one more sample in its buffers (the batches it cut from them are the same)."""
    import base64
    import pickle

    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for rank in a:
        assert a[rank].keys() == b[rank].keys() and a[rank]["world_size"] == b[rank]["world_size"]
        key = f"dp_rank_{rank}"
        sa, sb = (pickle.loads(base64.b64decode(x[rank][key].removeprefix("base64:")))
                  for x in (a, b))
        da, db = sa.pop("dataset_state"), sb.pop("dataset_state")
        same(sa, sb, f"dataloader/{rank}")
        for buf in ("inputs_buffer", "labels_buffer", "positions_buffer"):
            assert db[buf][:len(da[buf])] == da[buf], (rank, buf)
        assert da["epoch"] == db["epoch"] and db["sample_idx"] - da["sample_idx"] in (0, 1), (da, db)


def text_set(folder: str) -> None:
    """A small local text data set in C4's form (one JSON object with "text" a line)."""
    words = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with",
             "be", "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which"]
    rng = random.Random(0)
    os.makedirs(folder)
    with open(os.path.join(folder, "data.json"), "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(300))}) + "\n")


def main() -> int:
    import ckptfs

    root = tempfile.mkdtemp(prefix="ckptfs-titan-")
    ok = False
    try:
        data = os.path.join(root, "text")
        text_set(data)
        a, b = os.path.join(root, "a"), os.path.join(root, "b")
        t0 = time.perf_counter()
        finish(launch(a, data), "the first run")
        t_a = time.perf_counter() - t0
        kill_after(launch(b, data), b, KILL_AFTER)
        assert not committed(b, STEPS), "the killed run saved its last step"
        finish(launch(b, data), "the resumed run")
        last = f"checkpoint/step-{STEPS:08d}"
        want, got = (ckptfs.load_keys(os.path.join(x, last)) for x in (a, b))
        assert int(want["train_state"]["step"]) == STEPS, want["train_state"]
        same_stream(want.pop("dataloader"), got.pop("dataloader"))
        same(want, got)
        print(f"torchtitan trainer, 2 CPU ranks: killed after step {KILL_AFTER}, resumed to step "
              f"{STEPS}: every tensor and value of step {STEPS} bit-exact with an uninterrupted "
              f"run, the dataloader's the same token stream ({len(want)} other top-level keys; "
              f"one run {t_a:.0f} s)")
        ok = True
    finally:
        if ok:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"the runs' folders and logs are kept in {root}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main())
