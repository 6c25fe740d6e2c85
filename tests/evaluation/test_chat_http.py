"""The live judge's HTTP client reports each way a request fails as its own error, against real sockets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from rloo_engine.evaluation.judges.chat_http import (
    ChatHTTPClient,
    ConnectFailed,
    ConnectionBroken,
    HTTPStatusFailure,
    RequestTimedOut,
    auth_headers,
)


async def _serve(handler) -> tuple[asyncio.AbstractServer, str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}/v1/chat/completions"


async def _read_request(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    return head, await reader.readexactly(length)


def _reply(writer: asyncio.StreamWriter, status: str, body: bytes, content_type: str = "application/json") -> None:
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nRetry-After: 2\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


def _post(handler, timeout_s: float = 5.0):
    async def go():
        server, url = await _serve(handler)
        client = ChatHTTPClient(url, auth_headers("sk-test"), timeout_s, max_connections=2)
        try:
            return await client.post_json({"model": "m", "messages": [{"role": "user", "content": "hé"}]})
        finally:
            await client.aclose()
            server.close()

    return asyncio.run(go())


def test_a_reply_is_decoded_and_the_request_carries_key_and_json_body():
    seen = {}

    async def handler(reader, writer):
        seen["head"], seen["body"] = await _read_request(reader)
        _reply(writer, "200 OK", b'{"choices": [{"message": {"content": "Preferred: A"}}]}')
        await writer.drain()
        writer.close()

    assert _post(handler) == {"choices": [{"message": {"content": "Preferred: A"}}]}
    assert b"authorization: bearer sk-test" in seen["head"].lower()
    assert seen["body"].decode("utf-8") == '{"model": "m", "messages": [{"role": "user", "content": "hé"}]}'


def test_an_error_status_carries_code_message_and_headers_even_with_a_non_json_body():
    async def handler(reader, writer):
        await _read_request(reader)
        _reply(writer, "502 Bad Gateway", b"<html>upstream down</html>", "text/html")
        await writer.drain()
        writer.close()

    with pytest.raises(HTTPStatusFailure) as err:
        _post(handler)
    assert err.value.status_code == 502 and "upstream down" in err.value.message
    assert err.value.headers.get("retry-after") == "2"


def test_an_openai_error_body_gives_its_message():
    async def handler(reader, writer):
        await _read_request(reader)
        _reply(writer, "401 Unauthorized", b'{"error": {"message": "Incorrect API key provided"}}')
        await writer.drain()
        writer.close()

    with pytest.raises(HTTPStatusFailure) as err:
        _post(handler)
    assert (err.value.status_code, err.value.message) == (401, "Incorrect API key provided")


def test_a_server_that_hangs_up_without_answering_is_a_broken_connection():
    async def handler(reader, writer):
        await _read_request(reader)
        writer.close()

    with pytest.raises(ConnectionBroken):
        _post(handler)


def test_a_server_slower_than_the_timeout_is_a_timeout():
    async def handler(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(2)
        writer.close()

    with pytest.raises(RequestTimedOut):
        _post(handler, timeout_s=0.2)


def test_a_refused_connection_is_a_connect_failure():
    with socket.socket() as probe:  # a port nobody listens on: bound, then closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def go():
        client = ChatHTTPClient(f"http://127.0.0.1:{port}/v1/chat/completions", auth_headers("k"), 5.0, 1)
        try:
            await client.post_json({})
        finally:
            await client.aclose()

    with pytest.raises(ConnectFailed):
        asyncio.run(go())
