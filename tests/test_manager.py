"""``ckptfs.CheckpointManager`` on spawned gloo ranks against the moto S3 endpoint (through the
fault proxy) with a local tier on disk: retention over 20 steps, restore from the local tier
(0 remote data bytes; per-file fallback for a corrupt and a missing copy), restore into one
process (whole and a block of rows), a SIGTERM on one rank, a job SIGKILLed during a save and during background
persistence, and the training-loop example of docs/guide/manager.md run as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ckptfs
from ckptfs.engine.save.lock import LockInfo
from ckptfs.layout.index import LOCK_FILE
from ckptfs.testing.ranks import run_ranks
from tests.block_client import block_env, torchrun_envs
from tests.scenarios import outcomes_of, passed, run_steps

ROWS = 8  #: rows of the weight per rank (tiny: these tests are about bookkeeping)


def expected_kept(saved: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Retention written out independently of manager/steps.py."""
    newest = sorted(saved)[-keep_last:]
    return sorted({s for s in saved if s % keep_every == 0} | set(newest))


def state(rank: int, world: int, step: int) -> dict:
    """A row-sharded weight, a replicated bias, a value; every element depends on the step."""
    rows = 2 * ROWS // world
    w = torch.arange(2 * ROWS * 4, dtype=torch.float32).reshape(2 * ROWS, 4) + 1000 * step
    return {"w": ckptfs.ShardedTensor(w[rank * rows:(rank + 1) * rows].clone(), (2 * ROWS, 4),
                                      (rank * rows, 0)),
            "b": torch.full((3,), float(step)), "step": step}


def check(sd: dict, rank: int, world: int, step: int) -> None:
    want = state(rank, world, step)
    assert torch.equal(sd["w"].local_tensor, want["w"].local_tensor), (rank, step)
    assert torch.equal(sd["b"], want["b"]) and sd["step"] == step


def blank(rank: int, world: int) -> dict:
    sd = state(rank, world, 0)
    sd["w"].local_tensor.fill_(-1)
    sd["b"].fill_(-1)
    sd["step"] = -1
    return sd


def local_files(local: str, step: int) -> list[str]:
    root = os.path.join(local, f"step-{step:08d}")
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def flip(path: str, at: int) -> None:
    """Spoil the byte at offset ``at`` of the file."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


@dataclass
class Run:
    """What the steps on one rank share: where they save, and the manager steps hand on."""

    url: str
    local: str
    opts: dict
    url2: str
    mgr: ckptfs.CheckpointManager | None = None


def retention(rank: int, world: int, run: Run) -> None:
    """Retention over 20 steps: keep_last=3, keep_every=5; async saves, tensors changed as soon as
    `staged`; after each commit the committed steps are exactly the kept ones."""
    run.mgr = ckptfs.CheckpointManager(run.url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=run.local), retention=ckptfs.Retention(keep_last=3, keep_every=5), preemption=ckptfs.PreemptionPolicy(signals=())), storage_options=run.opts)
    assert run.mgr.latest_step() is None and run.mgr.restore(blank(rank, world)) is None
    sd = state(rank, world, 1)
    for step in range(1, 21):
        for k, v in state(rank, world, step).items():
            if k == "w":
                sd["w"].local_tensor.copy_(v.local_tensor)
            elif k == "b":
                sd["b"].copy_(v)
            else:
                sd[k] = v
        h = run.mgr.save(step, sd)
        assert h.staged.done()  # save() returns once staged, as the documented loop relies on
        sd["w"].local_tensor.fill_(-7)  # after `staged`: must not reach the checkpoint
        h.result(timeout=60)
        kept = expected_kept(list(range(1, step + 1)), 3, 5)
        assert run.mgr.steps() == kept, (step, run.mgr.steps(), kept)
        dist.barrier()  # every rank's local pruning of this step is over
        on_disk = sorted(int(n[5:]) for n in os.listdir(run.local) if n.startswith("step-"))
        assert on_disk == kept, (step, on_disk)
    assert run.mgr.latest_step() == 20 and run.mgr.metadata(20).values["step"] == 20
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="step 4 is not committed"):
        run.mgr.metadata(4)
    # a committed step is refused without force (nothing lost), replaced with it
    err = run.mgr.save(20, state(rank, world, 99)).done.exception(timeout=60)
    assert isinstance(err, (ckptfs.CheckpointExistsError, ckptfs.RankError)), repr(err)
    target = blank(rank, world)
    assert run.mgr.restore(target) == 20
    check(target, rank, world, 20)


def local_restore(rank: int, world: int, run: Run) -> None:
    """Restore from the local tier: every file local and intact -> 0 remote data bytes."""
    target = blank(rank, world)
    assert run.mgr.restore(target) == 20
    check(target, rank, world, 20)
    r = run.mgr.last_restore
    assert r.remote_bytes == 0 and r.remote_files == () and r.local_bytes > 0, r
    # read once: every chunk checked as it lands, nothing read only to check it
    assert r.local_files and r.checked_bytes == 0 and r.local_bytes == r.load.bytes_read, r


def local_fallback(rank: int, world: int, run: Run) -> None:
    """A corrupt local copy (rank 0's file, which also holds the replicated bias that both ranks
    read), then a missing one (rank 1's file): each falls back alone, values exact. First only rank
    0's rows of the weight are spoiled: rank 1 reads nothing else from that file (the bias) and
    keeps reading its copy; then the bias too: both fall back."""
    dist.barrier()
    f0, f1 = local_files(run.local, 20)
    assert "r00000" in f0 and "r00001" in f1, (f0, f1)
    index = run.mgr.metadata(20)
    w0 = next(c for c in index.tensors["w"].chunks if c.offsets == (0, 0))
    bias = index.tensors["b"].chunks[0]
    assert w0.file == bias.file == f0, (w0, bias)
    for spoiled, chunk in ((False, w0), (True, bias)):
        dist.barrier()
        if rank == 0:  # a data byte of the chunk: the size stays right
            flip(os.path.join(run.local, "step-00000020", f0), chunk.byte_offset + chunk.byte_length - 3)
        dist.barrier()
        target = blank(rank, world)
        assert run.mgr.restore(target, 20) == 20
        check(target, rank, world, 20)
        r = run.mgr.last_restore
        if rank == 1 and not spoiled:
            assert r.remote_files == () and r.local_files == (f0, f1) and r.rejected == (), r
            continue
        assert r.remote_files == (f0,) and r.rejected == (f0,) and r.remote_bytes > 0, r
        assert r.local_files == ((f1,) if rank == 1 else ()), r
    dist.barrier()
    if rank == 1:
        os.remove(os.path.join(run.local, "step-00000020", f1))
    dist.barrier()
    target = blank(rank, world)
    run.mgr.restore(target, 20)
    check(target, rank, world, 20)
    r = run.mgr.last_restore
    assert r.remote_files == ((f0, f1) if rank == 1 else (f0,)) and r.rejected == (f0,), r
    run.mgr.close()


def preemption(rank: int, world: int, run: Run) -> None:
    """SIGTERM on rank 1 at a moment of its own: both ranks save the same step, synchronously, then
    leave with SystemExit(128 + SIGTERM); the training loop runs a collective per step."""
    mgr = ckptfs.CheckpointManager(run.url2, ckptfs.ManagerOptions(save_interval_steps=1000), storage_options=run.opts)
    sd = state(rank, world, 0)
    saved = None
    try:
        for step in range(1, 200):
            sd = state(rank, world, step)
            grad = torch.ones(1)
            dist.all_reduce(grad)
            if rank == 1 and step == 5:
                threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM)).start()
            if mgr.should_save(step):
                saved = step
                mgr.save(step, sd)
                raise AssertionError("the preemption save returned instead of exiting")
            time.sleep(0.01)
        raise AssertionError("no preemption save in 200 steps")
    except SystemExit as e:
        assert e.code == 128 + signal.SIGTERM, e.code
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again
    both = [None, None]
    dist.all_gather_object(both, saved)
    assert both[0] == both[1] and both[0] >= 5, both
    check_mgr = ckptfs.CheckpointManager(run.url2, ckptfs.ManagerOptions(preemption=ckptfs.PreemptionPolicy(signals=())), storage_options=run.opts)
    assert check_mgr.steps() == [saved]  # committed before SystemExit was raised
    target = blank(rank, world)
    assert check_mgr.restore(target) == saved
    check(target, rank, world, saved)


#: the steps on the ranks, in order: ``local_restore`` and ``local_fallback`` use the manager
#: and the checkpoints of ``retention``
STEPS = (retention, local_restore, local_fallback, preemption)


def two_ranks(rank: int, world: int, url: str, local: str, opts: dict, url2: str, out: str) -> None:
    """Every step in turn (tests/scenarios.py)."""
    run_steps(STEPS, rank, out, rank, world, Run(url, local, opts, url2))


def one_process(url: str, local: str, opts: dict, proxy) -> None:
    """Another world size: one process (2 -> 1) takes the whole weight, then a block of rows
    that splits both saved shards (partial reads of local copies checked whole); every local
    copy but the two spoiled ones is intact: no GET of another data file."""
    proxy.reset()
    mgr = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=local), preemption=ckptfs.PreemptionPolicy(signals=())), storage_options=opts)
    full = torch.arange(2 * ROWS * 4, dtype=torch.float32).reshape(2 * ROWS, 4) + 20000
    target = {"w": torch.zeros(2 * ROWS, 4), "b": torch.zeros(3), "step": -1}
    assert mgr.restore(target) == 20
    assert torch.equal(target["w"], full) and target["step"] == 20
    r = mgr.last_restore
    gets = {rec.path.split("/step-00000020/")[1] for rec in proxy.log()
            if rec.method == "GET" and "/step-00000020/data/" in rec.path}
    assert gets == set(r.remote_files) and len(gets) == 2, (gets, r)
    part = {"w": ckptfs.ShardedTensor(torch.zeros(ROWS, 4), (2 * ROWS, 4), (ROWS // 2, 0))}
    assert mgr.restore(part, strict=False) == 20
    assert torch.equal(part["w"].local_tensor, full[ROWS // 2:ROWS // 2 + ROWS])
    f0, f1 = sorted(gets)  # rank 0's file (spoiled), rank 1's (gone)
    r = mgr.last_restore  # both weight chunks read in part: checked whole before the read
    assert r.remote_files == (f0, f1) and r.rejected == (f0,) and r.checked_bytes > 0, r
    mgr.close()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, moto_server, fault_proxy) -> dict[str, list[str | None]]:
    """One spawn of 2 ranks for every step, then the one-process restores of what they saved
    (a clean bucket, through the fault proxy, as the ``s3`` fixture gives): per step, each
    rank's traceback or None."""
    from tests.s3_fixtures import BUCKET, reset_bucket, s3_options

    reset_bucket(moto_server)
    fault_proxy.reset()
    root = tmp_path_factory.mktemp("manager")
    out = root / "out"
    out.mkdir()
    opts = s3_options(fault_proxy.url)
    url, url2, local = f"s3://{BUCKET}/run", f"s3://{BUCKET}/preempt", str(root / "local")
    try:
        run_ranks(2, two_ranks, url, local, opts, url2, str(out), timeout=240)
        got = outcomes_of(out, STEPS, 2)
        try:
            one_process(url, local, opts, fault_proxy)
            got["one_process"] = [None]
        except Exception:
            got["one_process"] = [traceback.format_exc()]
        return got
    finally:
        fault_proxy.reset()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_retention_over_20_steps(outcomes):
    passed(outcomes, retention)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_restore_from_the_local_tier_reads_nothing_remote(outcomes):
    passed(outcomes, local_restore)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_corrupt_or_missing_local_copy_falls_back_alone(outcomes):
    passed(outcomes, local_fallback)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_sigterm_on_one_rank_saves_the_same_step_on_both(outcomes):
    passed(outcomes, preemption)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_process_restores_the_whole_weight_and_a_block_of_rows(outcomes):
    passed(outcomes, one_process)


KILLED = """
import sys, time, torch, ckptfs
url, local, endpoint, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
opts = {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"}}
mgr = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=local),
                                                         retention=ckptfs.Retention(keep_last=2)),
                               storage_options=opts)
sd = lambda s: {"w": torch.arange(4096.0) + s, "step": s}
for s in range(1, step):
    mgr.save_sync(s, sd(s))
print("ready", flush=True)
sys.stdin.readline()
mgr.save(step, sd(step))
print("staged", flush=True)
time.sleep(600)
"""


LATENCY = 0.4  #: seconds the proxy holds each S3 request of the job to be killed


def run_killed(url: str, local: str, s3, step: int, wait_for_local: bool) -> None:
    """A job that saves steps 1..step-1, then is SIGKILLed while saving ``step``: right after
    the save returned (staging done, nothing at the URL yet), or once its local files are
    written and the upload to the URL is under way (every S3 request delayed)."""
    p = subprocess.Popen([sys.executable, "-c", KILLED, url, local, s3.endpoint, str(step)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        s3.proxy.configure(latency=LATENCY)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "staged"
        if wait_for_local:
            deadline = time.monotonic() + 60
            while not any(f.endswith(".safetensors") for f in local_files(local, step)):
                assert time.monotonic() < deadline, "the local tier was never written"
                time.sleep(0.05)
            time.sleep(0.3)
            uploads = [r for r in s3.proxy.log() if r.method == "PUT" and f"step-{step:08d}/" in r.path]
            assert not any(r.path.endswith("index.json") for r in uploads)
    finally:
        p.kill()
        p.wait()
        time.sleep(2 * LATENCY)  # requests the dead job had sent land now (as they may on S3)
        s3.proxy.configure()


@pytest.mark.timeout(200)
def test_killed_during_save_and_persistence_restarts_at_last_persisted(tmp_path, s3):
    for step, wait_for_local in ((3, False), (4, True)):
        url, local = f"{s3.url}/killed{step}", str(tmp_path / f"local{step}")
        run_killed(url, local, s3, step, wait_for_local)
        if wait_for_local:  # the killed save held the step's lock: the restart takes it over
            assert LOCK_FILE in _s3_list(s3, f"killed{step}/step-{step:08d}/")
        # another job's save in progress (a renewed lock) in an older and a newer step folder:
        # neither the dead-attempt cleanup nor retention touches it, and a save there is refused
        live = LockInfo.new("0" * 12, "safetensors_chunks-1").dumps()
        for other in (0, step + 1):
            for f, data in ((LOCK_FILE, live), ("data/x", b"x")):
                _s3_put(s3, f"killed{step}/step-{other:08d}/{f}", data)
        mgr = ckptfs.CheckpointManager(url, ckptfs.ManagerOptions(tiers=ckptfs.TierOptions(local_dir=local), retention=ckptfs.Retention(keep_last=2), preemption=ckptfs.PreemptionPolicy(signals=())), storage_options=s3.options)
        assert mgr.latest_step() == step - 1, mgr.steps()
        target = {"w": torch.zeros(4096), "step": -1}
        assert mgr.restore(target) == step - 1
        assert torch.equal(target["w"], torch.arange(4096.0) + step - 1)
        assert target["step"] == step - 1
        assert mgr.last_restore.remote_bytes == 0  # the persisted step's local copy is intact
        # the restarted job saves the killed step again; the dead attempt leaves nothing behind
        mgr.save_sync(step, {"w": torch.arange(4096.0) + step, "step": step})
        index = mgr.metadata(step)
        listed = _s3_list(s3, f"killed{step}/step-{step:08d}/")
        assert sorted(listed) == sorted([ckptfs.INDEX_FILE, *index.files]), listed
        assert mgr.steps() == [step - 1, step]  # keep_last=2
        assert local_files(local, step) == sorted(index.files)  # the dead attempt's are gone
        assert not os.path.exists(f"{local}/step-{step - 2:08d}")
        with pytest.raises(ckptfs.SaveInProgressError, match=f"step-{step + 1:08d}"):
            mgr.save_sync(step + 1, {"w": torch.zeros(4096), "step": step + 1})
        for other in (0, step + 1):
            assert sorted(_s3_list(s3, f"killed{step}/step-{other:08d}/")) == sorted([LOCK_FILE, "data/x"])
        mgr.close()


def _s3_put(s3, key: str, data: bytes) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3.direct, region_name="us-east-1").put_object(
        Bucket=s3.bucket, Key=key, Body=data)


def _s3_list(s3, prefix: str) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.direct, region_name="us-east-1")
    out = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return [o["Key"][len(prefix):] for o in out]


def test_a_lock_left_after_a_commit_is_removed_by_the_next_retention(tmp_path):
    """A save killed between its commit and the lock's release leaves a complete step with its
    lock: the next save's retention removes it (``verify`` reports it until then); a lock a
    save still renews stays."""
    mgr = ckptfs.CheckpointManager(str(tmp_path), ckptfs.ManagerOptions(
        retention=ckptfs.Retention(keep_last=3), preemption=ckptfs.PreemptionPolicy(signals=())))
    for s in (1, 2):
        mgr.save_sync(s, {"w": torch.arange(8.0) + s})
    now = time.time()
    dead = LockInfo("a" * 12, "safetensors_chunks-1", "other-host", 1, now - 900, now - 900)
    live = LockInfo("b" * 12, "safetensors_chunks-1", "other-host", 1, now, now)
    for step, info in ((1, dead), (2, live)):
        (tmp_path / f"step-{step:08d}" / LOCK_FILE).write_bytes(info.dumps())
    report = ckptfs.verify(str(tmp_path / "step-00000001"))
    assert [(p.kind, p.file) for p in report.problems] == [("extra-file", LOCK_FILE)]
    mgr.save_sync(3, {"w": torch.arange(8.0) + 3})
    assert not (tmp_path / "step-00000001" / LOCK_FILE).exists()
    assert (tmp_path / "step-00000002" / LOCK_FILE).read_bytes() == live.dumps()
    assert ckptfs.verify(str(tmp_path / "step-00000001")).ok
    mgr.close()


def test_steps_are_numbers_and_retention_settings_are_checked():
    from ckptfs.manager.steps import Retention, read_listing, step_dir

    paths = [f"{step_dir(100_000_000)}/{ckptfs.INDEX_FILE}", f"step-9/{ckptfs.INDEX_FILE}",
             "step-10/data/x", f"step-10/{ckptfs.INDEX_FILE}", "step-11/data/x", "notes/step-3",
             f"step-x/{ckptfs.INDEX_FILE}", ckptfs.INDEX_FILE]
    listing = read_listing(paths)
    assert listing.committed == (9, 10, 100_000_000) and 11 in listing.present
    assert listing.dirs[9] == "step-9" and step_dir(200) == "step-00000200"
    assert Retention(2, 4).to_delete([1, 2, 4, 5, 8, 9, 10]) == [1, 2, 5]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ckptfs.ConfigError, match="keep_last"):
            Retention(bad, None)


def readme_example() -> str:
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "guide", "manager.md")).read()
    m = re.search(r"```python\n(# train\.py.*?)```", text, re.S)
    assert m, "the manager page's example (a block starting with '# train.py') is gone"
    return m.group(1)


@pytest.mark.slow  # two processes as ranks
@pytest.mark.timeout(200)
def test_readme_training_loop_example(tmp_path, block_runners):
    """The manager page's example as written, twice with 2 ranks (torchrun's environment, on
    the run's block runners): the first run trains and saves, the second resumes from the last
    step and finds the same weights."""
    script = tmp_path / "train.py"
    script.write_text(readme_example())
    outs = []
    for _ in range(2):
        got = block_runners.run(script, torchrun_envs(block_env(), 2), 150)
        assert all(rc == 0 for rc, _ in got), got
        outs.append("".join(out for _, out in got))
    first = re.findall(r"rank 0: restored (\S+), weight sum (\S+), steps (\[.*\])", outs[0])
    second = re.findall(r"rank 0: restored (\S+), weight sum (\S+), steps (\[.*\])", outs[1])
    assert first and second, outs
    assert first[0][0] == "None" and first[0][2] == "[20, 30, 40]", first
    assert second[0][0] == "40" and second[0][1] == first[0][1], (first, second)
