"""The live judge's HTTP client behaves as openai-client users expect: proxies from the environment, and
bounded replies. Real sockets throughout: a forwarding proxy and servers written here, and the fake judge."""

from __future__ import annotations

import asyncio

import pytest

from rloo_engine.config_base import ConfigError
from rloo_engine.evaluation.judges.chat_http import (
    ChatHTTPClient,
    ConnectFailed,
    ConnectionBroken,
    ResponseTooLarge,
    auth_headers,
    chat_completions_url,
    env_proxy_for,
)
from rloo_engine.testing.fake_openai_server import FakeOpenAIServer

_PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


@pytest.fixture
def clean_proxy_env(monkeypatch):
    """No proxy settings but the test's own (lower-case variables win over upper-case ones in urllib)."""
    for name in _PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


class RecordingProxy:
    """A forwarding HTTP proxy on 127.0.0.1 that records each request line it gets.

    Plain-HTTP requests (`POST http://host:port/path`) are forwarded to their origin with
    `Connection: close` and the reply is piped back; `CONNECT` (how a client tunnels HTTPS) is
    recorded and refused, since no TLS server stands behind it.
    """

    def __init__(self) -> None:
        self.request_lines: list[str] = []
        self.proxy_authorizations: list[str | None] = []
        self.heads: list[bytes] = []
        self._server: asyncio.AbstractServer | None = None

    async def __aenter__(self) -> RecordingProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        self.request_lines.append(request_line)
        self.heads.append(head)
        self.proxy_authorizations.append(
            next((h.split(":", 1)[1].strip() for h in header_lines if h.lower().startswith("proxy-authorization")), None)
        )
        method, target, version = request_line.split(" ")
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n")
            await writer.drain()
            writer.close()
            return
        headers = [h for h in header_lines if h and not h.lower().startswith(("connection", "proxy-"))]
        length = next((int(h.split(":")[1]) for h in headers if h.lower().startswith("content-length")), 0)
        body = await reader.readexactly(length)
        origin, _, path = target.removeprefix("http://").partition("/")
        host, _, port = origin.partition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port or 80))
        up_writer.write(
            "\r\n".join([f"{method} /{path} {version}", *headers, "Connection: close", "", ""]).encode("latin-1") + body
        )
        await up_writer.drain()
        writer.write(await up_reader.read())  # the origin closes after its reply (Connection: close)
        up_writer.close()
        await writer.drain()
        writer.close()


def _chat_body() -> dict:
    return {"model": "fake-judge", "messages": [{"role": "user", "content": "Summary A:\nx\n\nSummary B:\ny\n\nFIRST"}]}


async def _post_once(url: str) -> dict:
    client = ChatHTTPClient(url, auth_headers("sk-test"), 5.0, max_connections=2)
    try:
        return await client.post_json(_chat_body())
    finally:
        await client.aclose()


def test_http_proxy_from_the_environment_carries_the_request(clean_proxy_env):
    with FakeOpenAIServer("sensible") as judge:
        url = f"{judge.base_url}/chat/completions"

        async def go():
            async with RecordingProxy() as proxy:
                clean_proxy_env.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://user:pw@"))
                # Set explicitly: a machine's NO_PROXY often lists 127.0.0.1, which would bypass the proxy.
                clean_proxy_env.setenv("NO_PROXY", "example.invalid")
                reply = await _post_once(url)
            return proxy, reply

        proxy, reply = asyncio.run(go())
    assert proxy.request_lines == [f"POST {url} HTTP/1.1"]  # the absolute URL: a proxied request, not a direct one
    # user:pw from the proxy URL; not the API key (aiohttp copies a session's default headers to the proxy)
    assert proxy.proxy_authorizations == ["Basic dXNlcjpwdw=="]
    assert reply["choices"][0]["message"]["content"].endswith("Preferred: A")
    assert judge.request_count == 1  # and the proxy delivered it


def test_no_proxy_sends_a_listed_host_directly(clean_proxy_env):
    with FakeOpenAIServer("sensible") as judge:

        async def go():
            async with RecordingProxy() as proxy:
                clean_proxy_env.setenv("HTTP_PROXY", proxy.url)
                clean_proxy_env.setenv("NO_PROXY", "example.invalid,127.0.0.1")
                await _post_once(f"{judge.base_url}/chat/completions")
            return proxy.request_lines

        assert asyncio.run(go()) == []
        assert judge.request_count == 1


def test_https_proxy_from_the_environment_tunnels_an_https_judge(clean_proxy_env):
    async def go():
        async with RecordingProxy() as proxy:
            clean_proxy_env.setenv("HTTPS_PROXY", proxy.url.replace("http://", "http://user:pw@"))
            clean_proxy_env.setenv("NO_PROXY", "localhost")
            # The host need not resolve: the proxy is asked to connect to it, and refuses.
            with pytest.raises((ConnectFailed, ConnectionBroken)):
                await _post_once("https://judge.example.invalid/v1/chat/completions")
        return proxy

    proxy = asyncio.run(go())
    assert proxy.request_lines == ["CONNECT judge.example.invalid:443 HTTP/1.1"]
    assert proxy.proxy_authorizations == ["Basic dXNlcjpwdw=="]
    assert b"sk-test" not in proxy.heads[0]  # the proxy of an HTTPS judge never sees the key


def test_the_proxy_lookup_reads_scheme_then_all_proxy_and_refuses_socks(clean_proxy_env):
    clean_proxy_env.setenv("ALL_PROXY", "proxy.internal:3128")
    assert env_proxy_for("https://api.openai.com/v1/chat/completions") == "http://proxy.internal:3128"
    clean_proxy_env.setenv("HTTPS_PROXY", "http://user:pw@tls-proxy:8080")
    assert env_proxy_for("https://api.openai.com/v1/chat/completions") == "http://user:pw@tls-proxy:8080"
    clean_proxy_env.setenv("NO_PROXY", ".openai.com")
    assert env_proxy_for("https://api.openai.com/v1/chat/completions") is None
    clean_proxy_env.setenv("ALL_PROXY", "socks5://127.0.0.1:1080")
    with pytest.raises(ConfigError, match="http:// or https:// proxies only"):
        env_proxy_for("http://judge.internal:8000/v1/chat/completions")


@pytest.mark.parametrize(
    ("base_url", "expected"),
    [
        ("https://api.openai.com/v1", "https://api.openai.com/v1/chat/completions"),
        ("http://localhost:8000/v1/", "http://localhost:8000/v1/chat/completions"),
        (
            "https://x.openai.azure.com/openai/deployments/gpt4o?api-version=2024-06-01",
            "https://x.openai.azure.com/openai/deployments/gpt4o/chat/completions?api-version=2024-06-01",
        ),
    ],
)
def test_the_chat_completions_path_is_joined_before_the_query(base_url, expected):
    assert chat_completions_url(base_url) == expected


def _streaming_server(total_bytes: int, declare_length: bool):
    """A handler that answers 200 with `total_bytes` of JSON-ish filler, recording how many bytes it got out."""
    sent = {"bytes": 0}

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        framing = f"Content-Length: {total_bytes}" if declare_length else "Transfer-Encoding: chunked"
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{framing}\r\n\r\n".encode())
        chunk = b" " * 65536
        try:
            while sent["bytes"] < total_bytes:
                writer.write(chunk if declare_length else b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
                sent["bytes"] += len(chunk)
        except ConnectionError:
            pass  # the client hung up: what we want
        finally:
            writer.close()

    return handler, sent


@pytest.mark.parametrize("declare_length", [True, False], ids=["content-length", "chunked"])
def test_a_reply_larger_than_the_limit_is_refused_without_reading_it_all(declare_length):
    limit, body_size = 1 << 20, 64 << 20
    handler, sent = _streaming_server(body_size, declare_length)

    async def go():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/chat/completions"
        client = ChatHTTPClient(url, auth_headers("k"), 30.0, 1, max_response_bytes=limit)
        try:
            with pytest.raises(ResponseTooLarge, match="1048576"):
                await client.post_json(_chat_body())
        finally:
            await client.aclose()
            await asyncio.sleep(0.05)  # let the handler see the hang-up
            server.close()

    asyncio.run(go())
    assert sent["bytes"] < 16 << 20  # far from the 64 MiB offered (the rest is socket buffers)
