"""A real S3 endpoint for tests: moto's threaded server on 127.0.0.1 (free port, one per session,
state reset per test), and a loopback fault-injecting HTTP proxy in front of it.

The proxy forwards each request to moto and can answer a share of them with 503 SlowDown, drop
the connection before or after forwarding, add latency, or deny paths with 403; ``mix`` draws
each faulty request's fault from a list that also has 500, a connection reset in the middle of
an upload's body or a download's body, a body cut short under its full Content-Length, a body
with one byte changed, and a stall past the client's timeout; ``script`` gives
chosen requests a chosen fault (deterministic: the first N matching requests), and ``gate`` holds
requests until a number of them are in flight at once (concurrency proven by construction, not
by timing). It logs every request (method, path, status, start and end times, body size, the keys
of a bulk delete) for tests that count GETs or check how uploads overlap. Spawned ranks reach its
log and settings through ``/__proxy__/...``. An ``adapter`` (tests/gcs_fixtures.py) may rewrite
what is forwarded, for an emulator that serves a request in another form than the client sends.
"""

from __future__ import annotations

import contextlib
import html
import http.client
import http.server
import json
import logging
import os
import random
import re
import socket
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from ckptfs.testing.ranks import free_port

BUCKET = "ckpt"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


def start_moto() -> tuple[object, str]:
    """A ThreadedMotoServer on a free loopback port, and its URL."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    for k, v in CREDENTIALS.items():
        os.environ.setdefault(k, v)
    os.environ.pop("AWS_PROFILE", None)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    return server, f"http://127.0.0.1:{port}"


def reset_bucket(endpoint: str, bucket: str = BUCKET) -> str:
    """Wipe moto's state and create an empty bucket."""
    import boto3

    urllib.request.urlopen(urllib.request.Request(f"{endpoint}/moto-api/reset", method="POST"),
                           timeout=30).read()
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def s3_options(endpoint: str) -> dict:
    """storage_options for ckptfs (both engines accept these)."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing",
            "client_kwargs": {"region_name": "us-east-1"}}


@dataclass
class Faults:
    """What the proxy does to each request (shares are probabilities per request)."""

    fail_share: float = 0.0  #: answer 503 SlowDown without forwarding
    drop_share: float = 0.0  #: close the connection without forwarding
    drop_after_share: float = 0.0  #: forward, then close without answering (lost response)
    latency: float = 0.0  #: seconds to wait before forwarding
    deny: list[str] = field(default_factory=list)  #: path substrings answered 403 AccessDenied
    seed: int = 0
    #: a share of requests get a fault drawn (seeded) from ``mix``: any of FAULTS; a download
    #: fault drawn for a request without a response body becomes "drop_after", an upload fault
    #: for one without a request body "drop"
    mix_share: float = 0.0
    mix: list[str] = field(default_factory=list)
    stall: float = 0.0  #: seconds a "stall" holds the request before forwarding it
    #: deterministic faults: {"path": substring, "method": "PUT" (optional), "query": substring
    #: (optional), "fault": "503" | "drop" | "drop_after" | "deny", "skip": K (default 0),
    #: "times": N (default 1)}: requests K+1 .. K+N that match a rule get its fault (any of FAULTS)
    script: list[dict] = field(default_factory=list)
    #: hold requests whose path contains ``gate_path`` (and query ``gate_query``) until ``gate``
    #: of them are in flight at once (then the gate stays open); ``gate_timeout`` seconds at
    #: most, then they go on
    gate: int = 0
    gate_path: str = ""
    gate_query: str = ""
    gate_timeout: float = 30.0


#: every fault the proxy injects: answered without forwarding (503 SlowDown, 500 InternalError,
#: 403 deny), a dropped connection before forwarding ("drop") or after it ("drop_after"), a
#: connection reset halfway through the request body ("reset_upload") or the response body
#: ("reset_download"), a response body cut short under its full Content-Length ("truncate"),
#: a response body with one byte changed ("corrupt"), a wait of ``stall`` seconds ("stall")
FAULTS = ("503", "500", "deny", "drop", "drop_after", "reset_upload", "reset_download",
          "truncate", "corrupt", "stall")
_DOWNLOAD = frozenset({"reset_download", "truncate", "corrupt"})
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


@dataclass
class Record:
    method: str
    path: str  #: without the query
    query: str
    status: int  #: 0 for a dropped connection
    t0: float
    t1: float
    fault: str  #: "" or one of FAULTS
    range: str = ""  #: the Range header
    if_none_match: str = ""  #: the If-None-Match header (create-if-absent)
    copy_source: str = ""  #: x-amz-copy-source (a server-side copy: a "rename")
    length: int = 0  #: bytes of the request body
    keys: list[str] = field(default_factory=list)  #: object keys of a bulk delete (POST ?delete)


class Adapter(Protocol):
    """Rewrites a forwarded request and its answer (after faults are drawn, before logging)."""

    def request(self, method: str, target: str, headers: dict[str, str],
                body: bytes) -> tuple[str, str, dict[str, str], bytes, bool]:
        """(method, target, headers, body, rewritten) to send upstream."""
        ...

    def response(self, status: int, headers: list[tuple[str, str]],
                 payload: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """The answer to give the client of a rewritten request."""
        ...


class FaultProxy:
    """A threading HTTP/1.1 proxy on 127.0.0.1 in front of ``upstream``."""

    def __init__(self, upstream: str, adapter: Adapter | None = None) -> None:
        u = urlsplit(upstream)
        self.upstream = (u.hostname, u.port)
        self.adapter = adapter
        self.faults = Faults()
        self.records: list[Record] = []
        self._lock = threading.Lock()
        self._rng = random.Random(0)
        self._script_seen: list[int] = []
        self._gate = threading.Condition(self._lock)
        self._gate_waiting = 0
        self._gate_open = False
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in separate writes

            def log_message(self, *args) -> None:
                pass

            def _any(self) -> None:
                proxy._handle(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request, client_address) -> None:
                pass  # clients hang up on purpose (drops, aborted uploads): not worth a traceback

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="fault-proxy")

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def configure(self, **kwargs) -> None:
        with self._lock:
            self.faults = Faults(**kwargs)
            self._rng = random.Random(self.faults.seed)
            self._reset_rules()

    def reset(self) -> None:
        with self._lock:
            self.faults = Faults()
            self.records = []
            self._rng = random.Random(0)
            self._reset_rules()

    def _reset_rules(self) -> None:
        self._script_seen = [0] * len(self.faults.script)
        self._gate_waiting = 0
        self._gate_open = False
        self._gate.notify_all()

    def _scripted(self, method: str, path: str, query: str) -> str:
        """The fault of the first script rule this request matches and has uses left (lock held)."""
        for i, rule in enumerate(self.faults.script):
            if (rule.get("path", "") in path and rule.get("method", method) == method
                    and rule.get("query", "") in query):
                self._script_seen[i] += 1
                skip = rule.get("skip", 0)
                if skip < self._script_seen[i] <= skip + rule.get("times", 1):
                    return rule["fault"]
        return ""

    def _wait_at_gate(self, path: str, query: str) -> None:
        with self._gate:
            f = self.faults
            if not f.gate or self._gate_open or f.gate_path not in path or f.gate_query not in query:
                return
            self._gate_waiting += 1
            if self._gate_waiting >= f.gate:
                self._gate_open = True
                self._gate.notify_all()
            else:
                self._gate.wait_for(lambda: self._gate_open, timeout=f.gate_timeout)

    def log(self) -> list[Record]:
        with self._lock:
            return list(self.records)

    # -- request handling --------------------------------------------------------------------
    def _handle(self, h: http.server.BaseHTTPRequestHandler) -> None:
        path, _, query = h.path.partition("?")
        if path.startswith("/__proxy__/"):
            return self._control(h, path, _read_body(h) or b"")
        t0 = time.monotonic()
        with self._lock:
            f = self.faults
            roll = self._rng.random()
            fault = self._scripted(h.command, path, query)
            drawn = self._rng.choice(f.mix) if f.mix else ""
        if not fault:
            fault = self._rolled(f, roll, path, drawn)
        if fault == "reset_upload":
            return self._reset_upload(h, path, query, t0)
        body = _read_body(h)
        if body is None:  # the client went away mid-body: a server stores nothing of it
            self._record(h, path, query, 0, t0, "client_gone")
            h.close_connection = True
            return
        self._wait_at_gate(path, query)
        if f.latency:
            time.sleep(f.latency)
        if fault == "stall":
            time.sleep(f.stall)
        if fault == "drop":
            self._record(h, path, query, 0, t0, fault, body)
            h.close_connection = True
            return
        if fault in ("503", "500", "deny"):
            status = {"503": 503, "500": 500, "deny": 403}[fault]
            self._record(h, path, query, status, t0, fault, body)
            _reply(h, status, [("Content-Type", "application/xml")],
                   b"" if h.command == "HEAD" else
                   {503: _SLOWDOWN, 500: _INTERNAL, 403: _DENIED}[status])
            return
        try:
            status, headers, payload = self._forward(h, body)
        except OSError:
            self._record(h, path, query, 0, t0, "upstream", body)
            raise
        if fault in _DOWNLOAD and (h.command == "HEAD" or not payload):
            fault = "drop_after"
        if fault == "drop_after":
            self._record(h, path, query, 0, t0, fault, body)
            h.close_connection = True
            return
        # logged before answering: a client that got its answer finds its request in the log
        self._record(h, path, query, status, t0, fault, body)
        if fault in _DOWNLOAD:
            return self._damaged_reply(h, fault, status, headers, payload)
        _reply(h, status, headers, payload, head=h.command == "HEAD")

    def _rolled(self, f: Faults, roll: float, path: str, drawn: str) -> str:
        """The fault the shares give a request (``roll`` uniform in [0, 1))."""
        if any(d in path for d in f.deny):
            return "deny"
        edges = (("503", f.fail_share), ("drop", f.drop_share),
                 ("drop_after", f.drop_after_share), (drawn, f.mix_share))
        for fault, share in edges:
            if roll < share:
                return fault
            roll -= share
        return ""

    def _reset_upload(self, h, path: str, query: str, t0: float) -> None:
        """Read half the request body, then reset the connection (a body of 0 bytes: a drop)."""
        n = int(h.headers.get("Content-Length") or 0)
        h.rfile.read(n // 2)
        self._record(h, path, query, 0, t0, "reset_upload" if n else "drop")
        _reset(h)

    def _damaged_reply(self, h, fault: str, status: int, headers, payload: bytes) -> None:
        """The answer with its full Content-Length and a damaged body: the first half then a
        reset ("reset_download") or a close ("truncate"), or one byte changed ("corrupt")."""
        if fault == "corrupt":
            b = bytearray(payload)
            b[len(b) // 2] ^= 0x5A
            _reply(h, status, headers, bytes(b))
            return
        h.send_response_only(status)
        for k, v in headers:
            if k.lower() != "content-length":
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload[: len(payload) // 2])
        h.wfile.flush()
        if fault == "reset_download":
            _reset(h)
        h.close_connection = True

    def _record(self, h, path: str, query: str, status: int, t0: float, fault: str,
                body: bytes = b"") -> None:
        keys = []
        if h.command == "POST" and "delete" in query.split("&"):
            keys = [html.unescape(k) for k in re.findall(r"<Key>(.*?)</Key>", body.decode("utf-8", "replace"))]
        with self._lock:
            self.records.append(Record(
                h.command, path, query, status, t0, time.monotonic(), fault,
                h.headers.get("Range", ""), h.headers.get("If-None-Match", ""),
                h.headers.get("x-amz-copy-source", ""), len(body), keys))

    def _forward(self, h, body: bytes):
        conn = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            method, target, rewritten = h.command, h.path, False
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            if self.adapter is not None:
                method, target, headers, body, rewritten = self.adapter.request(
                    method, target, headers, body)
            if body or method in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(method, target, body=body, headers=headers)
            r = conn.getresponse()
            payload = r.read()
            out = [(k, v) for k, v in r.getheaders() if k.lower() not in _HOP]
            if rewritten and self.adapter is not None:
                return self.adapter.response(r.status, out, payload)
            return r.status, out, payload
        finally:
            conn.close()

    def _control(self, h, path: str, body: bytes) -> None:
        if path == "/__proxy__/log":
            data = json.dumps([asdict(r) for r in self.log()]).encode()
        elif path == "/__proxy__/upstream":
            data = json.dumps({"url": f"http://{self.upstream[0]}:{self.upstream[1]}"}).encode()
        elif path == "/__proxy__/reset":
            self.reset()
            data = b"{}"
        elif path == "/__proxy__/configure":
            self.configure(**json.loads(body or b"{}"))
            data = b"{}"
        else:
            _reply(h, 404, [], b"")
            return
        _reply(h, 200, [("Content-Type", "application/json")], data)


def _reset(h) -> None:
    """Abort the client's connection with a TCP reset (SO_LINGER 0, then close)."""
    import struct

    h.close_connection = True
    with contextlib.suppress(OSError):
        h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # the handler's file objects keep the socket open past close(): close its descriptor
        # (detached, so no later close can hit a reused one)
        os.close(h.connection.detach())


def _read_body(h) -> bytes | None:
    """The request's whole body, or None when the connection ended before all of it came (a
    client killed mid-request: its request never reaches the upstream, as with a real server)."""
    if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
        out = bytearray()
        while True:
            line = h.rfile.readline()
            if not line:
                return None
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while h.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass
                return bytes(out)
            data = h.rfile.read(size)
            if len(data) < size:
                return None
            out += data
            h.rfile.readline()
    n = int(h.headers.get("Content-Length") or 0)
    data = h.rfile.read(n) if n else b""
    return data if len(data) == n else None


def _reply(h, status: int, headers, payload: bytes, head: bool = False) -> None:
    h.send_response_only(status)
    have_length = False
    for k, v in headers:
        if k.lower() == "content-length":
            if not head:
                continue
            have_length = True
        h.send_header(k, v)
    if not head:
        h.send_header("Content-Length", str(len(payload)))
    elif not have_length:
        h.send_header("Content-Length", "0")
    h.end_headers()
    if not head and payload:
        h.wfile.write(payload)


# -- helpers for spawned ranks (talk to the proxy over HTTP) ---------------------------------
def proxy_call(proxy_url: str, what: str, payload: dict | None = None):
    data = json.dumps(payload or {}).encode()
    req = urllib.request.Request(f"{proxy_url}/__proxy__/{what}", data=data, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def proxy_log(proxy_url: str) -> list[Record]:
    return [Record(**r) for r in proxy_call(proxy_url, "log")]
