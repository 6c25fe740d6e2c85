"""The trainer's HTTP client for a vLLM server: every call bounded by a timeout, every failure naming the URL.

A call is two halves, `send` and `receive`, so that generation can put all of a batch's requests on the wire
from the caller's thread and read the replies on another: a request handed to a background thread waits for
the GIL, which the trainer's main thread holds while it scores and updates (bench/README.md measured ~7 ms a
step of async generation lost that way on the demo task). Connections are kept alive and reused; one the
server has closed meanwhile (its keep-alive timeout is 5 s) is noticed before reuse, or on the first failed
exchange, and replaced by a fresh one once.

Standard library only (`http.client`): no environment proxy ever sits between a trainer and its server.
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse


class VLLMServerError(RuntimeError):
    """The vLLM server is down, died, hung or refused a request; the message names its URL."""


# A kept-alive connection that fails with one of these before a reply began may only have been closed by the
# server while idle: the request is sent again, once, on a fresh connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept-alive connection was closed by the server (an idle socket is readable only then).
    `poll`, not `select`: a training process may hold more than select's 1024 file descriptors."""
    if conn.sock is None:
        return True
    poller = select.poll()
    poller.register(conn.sock, select.POLLIN)
    return bool(poller.poll(0))


@dataclass
class Pending:
    """A request on the wire: `receive` reads its reply."""

    conn: http.client.HTTPConnection
    method: str
    path: str
    data: bytes | None
    reused: bool


class VLLMServerClient:
    """The HTTP routes the trainer uses, each bounded by `timeout` seconds."""

    def __init__(self, base_url: str, timeout: float):
        self.base_url, self.timeout = base_url.rstrip("/"), timeout
        url = urlparse(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise VLLMServerError(f"vLLM server {base_url}: not an http(s) URL (expected e.g. http://host:8000)")
        self._connection_class = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        self._host, self._port, self._prefix = url.hostname, url.port, url.path.rstrip("/")
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()  # `send` runs in the caller's thread, `receive` may run in another
        self.next_weight_version: str | None = None  # what the next `finish_weight_update` sets

    # ------------------------------------------------------------------ the two halves of a call
    def _connection(self, timeout: float, fresh: bool) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            while self._idle and not fresh:
                conn = self._idle.pop()
                if not _dropped(conn):
                    conn.timeout = timeout
                    conn.sock.settimeout(timeout)
                    return conn, True
                conn.close()
        return self._connection_class(self._host, self._port, timeout=timeout), False

    def _failed(self, path: str, err: BaseException, timeout: float) -> VLLMServerError:
        url = f"{self.base_url}{path}"
        if isinstance(err, (socket.timeout, TimeoutError)):
            return VLLMServerError(f"vLLM server {url}: no answer within vllm_server_timeout ({timeout:g} s)")
        if isinstance(err, (ConnectionRefusedError, socket.gaierror)):
            return VLLMServerError(f"vLLM server {url}: cannot connect ({type(err).__name__}); is it running? "
                                   "(`rloo-engine vllm-serve --model ...`)")
        return VLLMServerError(f"vLLM server {url}: connection lost ({type(err).__name__}: {err})")

    def send(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Pending:
        """Puts the request on the wire and returns at once; `receive` waits for the reply."""
        return self._send(method, path, None if body is None else json.dumps(body).encode(), timeout or self.timeout)

    def _send(self, method: str, path: str, data: bytes | None, timeout: float, fresh: bool = False) -> Pending:
        conn, reused = self._connection(timeout, fresh)
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, f"{self._prefix}{path}", body=data, headers=headers)
        except _STALE as err:
            conn.close()
            if reused:
                return self._send(method, path, data, timeout, fresh=True)
            raise self._failed(path, err, timeout) from None
        except OSError as err:
            conn.close()
            raise self._failed(path, err, timeout) from None
        return Pending(conn, method, path, data, reused)

    def receive(self, pending: Pending) -> Any:
        """The reply's JSON (None if empty); a status >= 400 raises with the server's own message."""
        try:
            reply = pending.conn.getresponse()
            text = reply.read()
        except _STALE as err:
            pending.conn.close()
            if pending.reused:  # closed while idle, just as we sent: once more on a fresh connection
                return self.receive(self._send(pending.method, pending.path, pending.data, pending.conn.timeout,
                                               fresh=True))
            raise self._failed(pending.path, err, pending.conn.timeout) from None
        except (OSError, http.client.HTTPException) as err:
            pending.conn.close()
            raise self._failed(pending.path, err, pending.conn.timeout) from None
        if reply.will_close:
            pending.conn.close()
        else:
            with self._lock:
                self._idle.append(pending.conn)
        if reply.status >= 400:
            raise VLLMServerError(f"vLLM server {self.base_url}{pending.path}: HTTP {reply.status}: "
                                  f"{text[:500].decode(errors='replace')}")
        return json.loads(text) if text else None

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        return self.receive(self.send(method, path, body, timeout))

    def close(self) -> None:
        with self._lock:
            for conn in self._idle:
                conn.close()
            self._idle.clear()

    # ------------------------------------------------------------------ routes
    def wait_until_healthy(self) -> None:
        deadline, last = time.monotonic() + self.timeout, None
        while time.monotonic() < deadline:
            try:
                self._call("GET", "/health")
                return
            except VLLMServerError as err:
                last = err
                time.sleep(1.0)
        raise VLLMServerError(f"vLLM server {self.base_url} did not become healthy within vllm_server_timeout "
                              f"({self.timeout:g} s): {last}")

    def post(self, path: str, body: dict | None = None, timeout: float | None = None) -> Any:
        return self._call("POST", path, body, timeout)

    def get(self, path: str) -> Any:
        return self._call("GET", path)

    def reset_prefix_cache(self, attempts: int = 20) -> None:
        """Drops the server's cached prompt KV. vLLM refuses (`success: false`) while running requests hold blocks,
        which clears within a moment; a cache it will not drop is an error, never sampled from."""
        for _ in range(attempts):
            if self.post("/reset_prefix_cache").get("success", False):
                return
            time.sleep(0.1)
        raise VLLMServerError(f"vLLM server {self.base_url}: /reset_prefix_cache refused {attempts} times; its "
                              "cached prompts were computed by the previous weights")

    # vLLM's `VLLMWeightSyncClient` protocol, so that its trainer engines drive the handshake through this client.
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self.post("/start_weight_update")

    def update_weights(self, update_info) -> None:
        self.post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # vLLM's trainer-side engines call this without a version; the route sets one after the update, so the
        # version rides on this call instead of a separate `/update_weight_version` (one round trip less a sync).
        version = self.next_weight_version if weight_version is None else weight_version
        self.post("/finish_weight_update", None if version is None else {"weight_version": version})
