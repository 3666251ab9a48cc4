"""The ``ckptfs`` command's surface: global flags in either place, help for every argument, one
wording for overwriting, no hint that points back at the command that printed it, the exit
codes the module docstring lists, progress that leaves one summary line in a log, and
``key_mapping`` names checked against the model."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptfs
from ckptfs.cli import EXIT_FAILED, EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "c"
    ckptfs.save({"w": torch.arange(12.0).reshape(3, 4), "step": 5}, path)
    return path


def test_global_flags_before_or_after_the_subcommand(ckpt, capsys, tmp_path):
    for args in (["-q", "convert", ckpt, tmp_path / "a", "--backend", "torch_dist"],
                 ["convert", ckpt, tmp_path / "b", "--backend", "torch_dist", "-q"]):
        rc, out, err = cli(capsys, *args)
        assert rc == EXIT_OK and out == "" and err == "", (args, out, err)
    # storage options in both places merge; the subcommand's win
    parser = build_parser()
    ns = parser.parse_args(["--storage-option", "a=1", "--storage-option", "b=2", "inspect", "x",
                            "--storage-option", "b=3"])
    from ckptfs.cli import storage_options

    assert storage_options(ns) == {"a": 1, "b": 3} and ns.quiet is False
    assert parser.parse_args(["-q", "inspect", "x"]).quiet is True
    assert parser.parse_args(["inspect", "x", "-q"]).quiet is True


def test_every_argument_has_help_and_defaults_are_shown():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"ckptfs {name}: {action.dest} has no help"
        assert p.formatter_class is argparse.ArgumentDefaultsHelpFormatter, name
    text = sub.choices["unshard"].format_help()
    assert "(default: safetensors)" in text and "(default: one_file)" in text
    assert "the directory to write the files into" in text


def test_overwrite_has_one_wording(ckpt, capsys, tmp_path):
    dst = tmp_path / "d"
    assert cli(capsys, "convert", ckpt, dst, "--backend", "torch_dist", "-q")[0] == EXIT_OK
    rc, _, err = cli(capsys, "convert", ckpt, dst, "--backend", "torch_dist")
    assert rc == EXIT_FAILED and "--overwrite" in err and "overwrite=True" not in err
    assert cli(capsys, "convert", ckpt, dst, "--backend", "torch_dist", "--overwrite", "-q")[0] == EXIT_OK
    out = tmp_path / "u"
    assert cli(capsys, "unshard", ckpt, out, "--format", "torch", "-q")[0] == EXIT_OK
    rc, _, err = cli(capsys, "unshard", ckpt, out, "--format", "torch")
    assert rc == EXIT_FAILED and "--overwrite" in err and "overwrite=True" not in err


def test_verify_of_a_missing_checkpoint_does_not_point_at_itself(capsys, tmp_path):
    rc, out, _ = cli(capsys, "verify", tmp_path / "nothing", "-q")
    assert rc == EXIT_PROBLEMS and "no committed ckptfs checkpoint" in out
    assert "ckptfs verify" not in out


def test_exit_codes(ckpt, capsys, tmp_path):
    assert cli(capsys, "verify", ckpt, "-q")[0] == EXIT_OK
    assert cli(capsys, "inspect", "--no-such-flag", ckpt)[0] == EXIT_USAGE
    rc, _, err = cli(capsys, "convert", ckpt, tmp_path / "x", "--backend", "no_such_backend")
    assert rc == EXIT_USAGE and "no_such_backend" in err  # unknown: a configuration error
    rc, _, err = cli(capsys, "convert", ckpt, tmp_path / "y", "--backend", "hf_safetensors")
    assert rc == EXIT_USAGE and "read-only" in err  # read-only: the same code
    rc, _, err = cli(capsys, "inspect", tmp_path / "nothing")
    assert rc == EXIT_FAILED and "CheckpointNotFoundError" in err
    (ckpt / next(iter(ckptfs.load_metadata(ckpt).files))).write_bytes(b"damaged")
    assert cli(capsys, "verify", ckpt, "-q")[0] == EXIT_PROBLEMS


#: one program runs the commands one after another (one interpreter start, not three), each
#: command's stderr ended by this line with its exit status
_COMMANDS = """import sys
from ckptfs.cli import main
for args in {commands!r}:
    rc = main(args)
    print(f"-- exit {{rc}}", file=sys.stderr, flush=True)
"""


@pytest.mark.slow
def test_progress_in_a_log_is_one_summary_line(ckpt, tmp_path):
    """stderr is a pipe here, as in a CI log: no bar frames, one line with bytes, seconds, GB/s."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    commands = [["verify", str(ckpt)], ["convert", str(ckpt), str(tmp_path / "t"), "--backend", "torch_dist"],
                ["unshard", str(ckpt), str(tmp_path / "u"), "--format", "torch"]]
    res = subprocess.run([sys.executable, "-c", _COMMANDS.format(commands=commands)], capture_output=True,
                         text=True, env=env, timeout=240)
    assert res.returncode == 0, res.stderr
    outputs = re.split(r"^-- exit (\d+)\n", res.stderr, flags=re.MULTILINE)
    assert len(outputs) == 2 * len(commands) + 1 and outputs[-1] == "", res.stderr
    for args, err, rc in zip(commands, outputs[0::2], outputs[1::2]):
        assert rc == "0", (args, err)
        lines = [line for line in err.splitlines() if line.strip()]
        summaries = [line for line in lines if re.search(r": \d+(\.\d\d [kMG]B| B) in \d+\.\d\d s \(\d+\.\d\d GB/s\)$", line)]
        assert len(summaries) == 1 and "%|" not in err and "\r" not in err, (args, err)


def test_key_mapping_naming_a_key_the_model_lacks(tmp_path):
    model = torch.nn.Linear(3, 2)
    ckptfs.save_model_and_optim_state(tmp_path / "m", model)
    with pytest.raises(ckptfs.MissingKeysError, match="'encoder.weight'") as e:
        ckptfs.load_model_and_optim_state(tmp_path / "m", torch.nn.Linear(3, 2),
                                          key_mapping={"encoder.weight": "weight"})
    assert e.value.keys == ["encoder.weight"]
    target = torch.nn.Linear(3, 2)
    ckptfs.load_model_and_optim_state(tmp_path / "m", target, key_mapping={"encoder.weight": "weight"},
                                      strict=False)
    assert torch.equal(target.weight, model.weight)


@pytest.mark.parametrize("backend", ["safetensors_chunks", "torch_dist", "zarr"])
def test_verify_reads_each_byte_once_and_its_progress_counts_it(backend, tmp_path, monkeypatch):
    from ckptfs.io import progress

    closed = []
    monkeypatch.setattr(progress.ByteProgress, "close",
                        lambda self: closed.append((self.done, self.total)))
    state = {f"t{i}": torch.arange(1000.0 * (i + 1)).reshape(-1, 10) for i in range(4)}
    path = tmp_path / backend
    ckptfs.save(state, path, backend=backend)
    report = ckptfs.verify(path, progress=True)
    assert report.ok, report.problems
    assert report.chunks_checksummed == sum(len(t.chunks) for t in ckptfs.load_metadata(path).tensors.values())
    files = sum(ckptfs.load_metadata(path).all_files.values())
    if backend != "zarr":  # chunks stored raw: checked from the bytes of the file pass alone
        assert report.bytes_read == files
    assert closed == [(report.bytes_read, report.bytes_read)]


def test_verify_reports_a_damaged_raw_chunk_once_per_kind(tmp_path):
    path = tmp_path / "c"
    ckptfs.save({"a": torch.zeros(1000), "b": torch.ones(1000)}, path)
    meta = ckptfs.load_metadata(path)
    chunk = meta.tensors["b"].chunks[0]
    f = path / chunk.file
    data = bytearray(f.read_bytes())
    data[chunk.byte_offset + 5] ^= 1
    f.write_bytes(bytes(data))
    report = ckptfs.verify(path)
    kinds = sorted(p.kind for p in report.problems)
    assert kinds == ["checksum", "file-checksum"], report.problems
    assert next(p for p in report.problems if p.kind == "checksum").key == "b"
    assert report.chunks_checksummed == 1


def test_delete_refuses_a_base_a_delta_beside_it_references_unless_forced(tmp_path, capsys):
    frozen = torch.randn(64, 16)
    base, delta, lone = tmp_path / "step_1", tmp_path / "step_2", tmp_path / "other"
    ckptfs.save({"frozen": frozen, "a": torch.zeros(4)}, base,
                options=ckptfs.SaveOptions(hashes=True))
    ckptfs.save({"frozen": frozen, "a": torch.ones(4)}, delta, base=base)
    ckptfs.save({"w": torch.ones(2)}, lone)
    rc, out, err = cli(capsys, "delete", base)
    assert rc == EXIT_FAILED and "ReferencedCheckpointError" in err and "step_2" in err
    assert "--force" in err and "force=True" not in err
    assert (base / ckptfs.INDEX_FILE).exists()  # nothing removed
    rc, out, err = cli(capsys, "delete", lone, "--json")
    assert rc == EXIT_OK and '"removed": ' in out
    assert not [p for p in lone.rglob("*") if p.is_file()]
    rc, out, err = cli(capsys, "delete", lone)
    assert rc == EXIT_FAILED and "other" in err
    assert cli(capsys, "delete", lone, "--missing-ok")[0] == EXIT_OK
    rc, out, err = cli(capsys, "delete", base, "--force")
    assert rc == EXIT_OK and "deleted" in out
    assert not [p for p in base.rglob("*") if p.is_file()]
    with pytest.raises(ckptfs.IntegrityError, match="step_1"):
        ckptfs.load_keys(delta)
