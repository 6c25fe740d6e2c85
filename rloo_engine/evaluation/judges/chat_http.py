"""The live judge's HTTP client: one aiohttp session that POSTs JSON chat-completion requests.

Why not the openai client for live requests: with 32 requests in flight, the client's CPU per
request is what bounds throughput, and openai's request path (option deep copies, httpx URL and
header models, then its aiohttp transport underneath) cost about 2.5 ms of CPU per request in a
profile of bench/judge_throughput.py, against about 0.3 ms for aiohttp alone. That kept the bench at
1.27x the ideal time. This client sends what an OpenAI-compatible server needs (bearer key, JSON
body), keeps connections alive, and reports failures as the five cases the judge tells apart. The
Batch API path (`openai_batch.py`) still uses the openai client: it makes a handful of calls per
batch, not one per judgment.

Like the openai client, it goes through the proxy that `HTTP_PROXY` / `HTTPS_PROXY` / `ALL_PROXY`
name, unless `NO_PROXY` lists the host. The proxy is looked up once, here, rather than by aiohttp's
`trust_env`: that costs two thread hops per request and also reads `~/.netrc`, whose entry for the
judge's host would clash with the bearer header.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from rloo_engine.config_base import ConfigError


class HTTPStatusFailure(Exception):
    """The server answered with a status >= 400. `body` is the parsed JSON body, or its text; `code` is its
    OpenAI-style `error.code` (else `error.type`), e.g. `insufficient_quota`, or None."""

    def __init__(self, status_code: int, body: Any, headers: Mapping[str, str]):
        self.status_code = status_code
        self.body = body
        self.headers = headers
        self.message = _error_message(body)
        self.code = _error_code(body)
        super().__init__(f"HTTP {status_code}: {self.message}")


class RequestTimedOut(Exception):
    """No complete answer within the timeout."""


class ConnectFailed(Exception):
    """No connection could be made (refused, unknown host, unreachable): the request never reached a server."""


class ConnectionBroken(Exception):
    """The connection broke after it was made (server disconnected, truncated body)."""


class ResponseTooLarge(Exception):
    """The reply was longer than `max_response_bytes`; it was not read to its end."""


DEFAULT_MAX_RESPONSE_BYTES = 10 << 20  # a judgment is a few KiB; 10 MiB is a server gone wrong, not a long verdict
_READ_CHUNK = 64 << 10


class ChatHTTPClient:
    """POSTs JSON to one URL. The session is made on first use, inside the running event loop."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        timeout_s: float,
        max_connections: int,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
    ):
        self.url = url
        self.max_response_bytes = max_response_bytes
        self._headers = {**headers, "Content-Type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        proxy = env_proxy_for(url)
        self._proxy = URL(proxy).with_user(None) if proxy else None
        self._proxy_headers: dict[str, str] | None = None
        # Credentials in the proxy URL (http://user:pass@proxy:3128) go in Proxy-Authorization, as with httpx:
        # on the tunnel's CONNECT for an https judge, on the request itself (which the proxy reads) for http.
        proxy_auth = aiohttp.BasicAuth.from_url(URL(proxy)) if proxy else None
        if proxy_auth is not None and url.startswith("https://"):
            self._proxy_headers = {"Proxy-Authorization": proxy_auth.encode()}
        elif proxy_auth is not None:
            self._headers["Proxy-Authorization"] = proxy_auth.encode()

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections)
            # Headers go with each request, not as session defaults: aiohttp copies a session's default headers
            # into the proxy's, which would hand the key to the proxy as Proxy-Authorization.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def post_json(self, body: dict[str, Any]) -> Any:
        """The decoded JSON reply (None when the 2xx body is not JSON); raises one of this module's errors."""
        data = json.dumps(body, ensure_ascii=False).encode("utf-8")
        try:
            async with self._open().post(
                self.url, data=data, headers=self._headers, proxy=self._proxy, proxy_headers=self._proxy_headers
            ) as response:
                raw = await self._read_capped(response)
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

    async def _read_capped(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, refused as soon as its declared or received length passes `max_response_bytes`."""
        limit = self.max_response_bytes
        declared = response.content_length
        if declared is not None and declared > limit:
            response.close()  # drops the connection instead of draining the body into the pool
            raise ResponseTooLarge(f"the reply declares {declared} bytes, more than max_response_bytes {limit}")
        parts, size = [], 0
        async for chunk in response.content.iter_chunked(_READ_CHUNK):
            size += len(chunk)
            if size > limit:
                response.close()
                raise ResponseTooLarge(f"the reply passed max_response_bytes {limit} and was cut off unread")
            parts.append(chunk)
        return b"".join(parts)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def chat_completions_url(base_url: str) -> str:
    """`base_url` + `/chat/completions`, joined to the path so that a query (Azure's `?api-version=`) stays last."""
    parts = urlsplit(base_url)
    return parts._replace(path=f"{parts.path.rstrip('/')}/chat/completions").geturl()


def auth_headers(
    api_key: str | None, key_header: str = "authorization", organization: str | None = None, project: str | None = None
) -> dict[str, str]:
    """The key (as a bearer token or an Azure-style `api-key`) and the OpenAI account headers that are set."""
    # "EMPTY": servers without auth still get a well-formed bearer header, as the openai client sends.
    key = api_key or "EMPTY"
    headers = {"api-key": key} if key_header == "api-key" else {"Authorization": f"Bearer {key}"}
    if organization:
        headers["OpenAI-Organization"] = organization
    if project:
        headers["OpenAI-Project"] = project
    return headers


def env_proxy_for(url: str) -> str | None:
    """The proxy URL the environment names for `url`'s scheme (then `ALL_PROXY`), or None if NO_PROXY lists its host."""
    proxies = urllib.request.getproxies_environment()
    parts = urlsplit(url)
    if parts.hostname and urllib.request.proxy_bypass_environment(parts.hostname, proxies):
        return None
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy:
        return None
    if "://" not in proxy:  # `proxy:3128`, read as http:// the way httpx and curl read it
        proxy = f"http://{proxy}"
    if not proxy.startswith(("http://", "https://")):
        raise ConfigError(
            f"{parts.scheme.upper()}_PROXY / ALL_PROXY: {proxy!r}; the live judge speaks to http:// or https:// "
            "proxies only (unset it, or list the judge's host in NO_PROXY)"
        )
    return proxy


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


def _error_code(body: Any) -> str | None:
    inner = body.get("error") if isinstance(body, dict) else None
    if not isinstance(inner, dict):
        return None
    code = inner.get("code") or inner.get("type")
    return code if isinstance(code, str) else None
