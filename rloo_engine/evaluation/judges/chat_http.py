"""The live judge's HTTP client: one aiohttp session that POSTs JSON chat-completion requests.

Why not the openai client for live requests: with 32 requests in flight, the client's CPU per
request is what bounds throughput, and openai's request path (option deep copies, httpx URL and
header models, then its aiohttp transport underneath) cost about 2.5 ms of CPU per request in a
profile of bench/judge_throughput.py, against about 0.3 ms for aiohttp alone. That kept the bench at
1.27x the ideal time. This client sends what an OpenAI-compatible server needs (bearer key, JSON
body), keeps connections alive, and reports failures as the four cases the judge tells apart. The
Batch API path (`openai_batch.py`) still uses the openai client: it makes a handful of calls per
batch, not one per judgment.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import aiohttp


class HTTPStatusFailure(Exception):
    """The server answered with a status >= 400. `body` is the parsed JSON body, or its text."""

    def __init__(self, status_code: int, body: Any, headers: Mapping[str, str]):
        self.status_code = status_code
        self.body = body
        self.headers = headers
        self.message = _error_message(body)
        super().__init__(f"HTTP {status_code}: {self.message}")


class RequestTimedOut(Exception):
    """No complete answer within the timeout."""


class ConnectFailed(Exception):
    """No connection could be made (refused, unknown host, unreachable): the request never reached a server."""


class ConnectionBroken(Exception):
    """The connection broke after it was made (server disconnected, truncated body)."""


class ChatHTTPClient:
    """POSTs JSON to one URL. The session is made on first use, inside the running event loop."""

    def __init__(self, url: str, api_key: str, timeout_s: float, max_connections: int):
        self.url = url
        self._headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers, timeout=self._timeout)
        return self._session

    async def post_json(self, body: dict[str, Any]) -> Any:
        """The decoded JSON reply (None when the 2xx body is not JSON); raises one of this module's errors."""
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            async with self._open().post(self.url, data=data) as response:
                raw = await response.read()
                status, headers = response.status, response.headers
        except TimeoutError as err:  # aiohttp's connect and read timeouts are TimeoutError subclasses
            raise RequestTimedOut(str(err) or "timed out") from err
        except aiohttp.ClientConnectorError as err:
            raise ConnectFailed(str(err)) from err
        except aiohttp.ClientError as err:
            raise ConnectionBroken(f"{type(err).__name__}: {err}") from err
        parsed = _decode(raw)
        if status >= 400:
            raise HTTPStatusFailure(status, parsed if parsed is not None else raw.decode("utf-8", "replace"), headers)
        return parsed

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _error_message(body: Any) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("message", inner))
        return str(inner)
    return str(body)
