"""Every index the test suite writes goes through the independent reader (tests/spec_reader.py).

``install()`` (run by tests/__init__.py, so in the pytest process and in every spawned rank whose
function lives in tests/) wraps two things while ``$CKPTFS_TEST_SPEC_AUDIT`` names a directory
(tests/conftest.py sets it for the session; spawned ranks inherit it):

- ``Index.dumps``: each index ckptfs produces is parsed and checked by ``spec_reader.audit_index``
  right away, before any test can edit it (keys, JSON rules, tree, order, tiling, paths).
- ``ckptfs.save``: on the coordinator, after a save to a local directory returns, every chunk is
  read back as the backend's spec says and checked (metadata, placement, crc32c), and for a
  single-process save the rebuilt tree is compared with the state dict that was saved: dict
  order, container kinds, values, tensor bytes.

Each process appends one JSON line per check to ``<dir>/audit-<pid>.jsonl``; the session fixture
in conftest.py reads them at the end and fails the session if any check found a problem.
``CKPTFS_TEST_SPEC_AUDIT=off`` turns the audit off (to time the suite without it).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ENV = "CKPTFS_TEST_SPEC_AUDIT"
#: data checks read every chunk back; larger checkpoints get the index checks only
MAX_DATA_BYTES = 64 << 20

_installed = False


def enabled() -> bool:
    return os.environ.get(ENV, "off") != "off"


def install() -> None:
    global _installed
    if _installed:
        return
    import ckptfs
    from ckptfs.layout import index as index_mod

    real_dumps = index_mod.Index.dumps

    @functools.wraps(real_dumps)
    def dumps(self: Any) -> bytes:
        data = real_dumps(self)
        if enabled():
            _check("index", None, lambda: _audit_index(data))
        return data

    real_save = ckptfs.save

    @functools.wraps(real_save)
    def save(state_dict: Any, url: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_save(state_dict, url, *args, **kwargs)
        if enabled():
            root = _local_root(url)
            world = _world(kwargs.get("process_group"))
            if root is not None and world[0] == 0:
                _check("data", str(url), lambda: _audit_save(root, state_dict if world[1] == 1 else None))
        return result

    index_mod.Index.dumps = dumps  # type: ignore[method-assign]
    ckptfs.save = save
    _installed = True


def _world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _local_root(url: Any) -> str | None:
    s = os.fspath(url)
    if s.startswith("file://"):
        s = s[len("file://"):]
    elif "://" in s:
        return None
    return s


def _check(what: str, url: str | None, fn: Any) -> None:
    t0 = time.perf_counter()
    try:
        problem, detail = None, fn()
    except AssertionError as e:
        problem, detail = str(e), None
    except Exception:  # the reader itself failed: as much a finding as a spec violation
        problem, detail = "the independent reader crashed:\n" + traceback.format_exc(), None
    line = {"what": what, "url": url, "pid": os.getpid(), "test": os.environ.get("PYTEST_CURRENT_TEST", "?"),
            "problem": problem, "detail": detail, "seconds": round(time.perf_counter() - t0, 4)}
    path = Path(os.environ[ENV]) / f"audit-{os.getpid()}.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line, ensure_ascii=True) + "\n")


def _audit_index(data: bytes) -> str:
    from tests import spec_reader

    idx = spec_reader.audit_index(bytes(data))
    spec_reader.check_writer_spelling(data, idx)
    spec_reader.read_tree(idx)
    return "ok"


def _audit_save(root: str, saved: Mapping[str, Any] | None) -> str:
    from tests import spec_reader

    idx = spec_reader.audit_index(Path(root, "ckptfs.index.json").read_bytes(),
                                  spec_reader.local_reader(root))
    if sum(idx.norm.get("files", {}).values()) > MAX_DATA_BYTES:
        return "index only (large)"
    data = spec_reader.audit_data(root, idx)
    tree = spec_reader.read_tree(idx, data)
    if saved is not None and "order" in idx.doc:
        _compare(saved, tree, "")
    return "ok" if data or not idx.norm["tensors"] else "index only (backend not built in)"


def _compare(saved: Any, got: Any, where: str) -> None:
    """The tree the spec reader rebuilt is the state dict that was saved, dict order included."""
    import torch

    from tests.spec_reader import SpecError, TensorLeaf

    at = where or "/"
    if isinstance(got, TensorLeaf):
        if saved is None or isinstance(saved, Mapping | list | tuple | bool | int | float | str):
            raise SpecError(f"{at}: saved a {type(saved).__name__}, read a tensor")
        if isinstance(saved, torch.Tensor) and not hasattr(saved, "placements") \
                and saved.device.type == "cpu" and got.data is not None:
            raw = saved.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            if tuple(saved.shape) != got.shape or raw != got.data:
                raise SpecError(f"{at}: tensor bytes differ from the saved tensor")
        return
    if isinstance(saved, Mapping):
        if not isinstance(got, dict) or list(saved) != list(got):
            raise SpecError(f"{at}: saved dict keys {list(saved)[:8]}, read "
                            f"{list(got)[:8] if isinstance(got, dict) else type(got).__name__}")
        for k in saved:
            _compare(saved[k], got[k], f"{where}/{k!r}")
        return
    if isinstance(saved, list | tuple):
        kind = list if isinstance(saved, list) else tuple
        if type(got) is not kind or len(got) != len(saved):
            raise SpecError(f"{at}: saved a {kind.__name__} of {len(saved)}, read {got!r:.80}")
        for i, (a, b) in enumerate(zip(saved, got)):
            _compare(a, b, f"{where}/{i}")
        return
    base = next((t for t in (bool, int, float, str) if isinstance(saved, t)), type(saved))
    if base is float:
        same = type(got) is float and (
            (math.isnan(saved) and math.isnan(got))
            or (saved == got and math.copysign(1, saved) == math.copysign(1, got)))
    else:
        same = type(got) is base and saved == got
    if not same:
        raise SpecError(f"{at}: saved {saved!r:.80}, read {got!r:.80}")


def collect(directory: str | Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every check recorded under ``directory``, and those that found a problem."""
    lines = []
    for p in sorted(Path(directory).glob("audit-*.jsonl")):
        # whole lines only: under pytest-xdist another worker's process may be appending one
        lines += [json.loads(s) for s in p.read_text(encoding="utf-8").split("\n")[:-1] if s]
    return lines, [x for x in lines if x["problem"]]
