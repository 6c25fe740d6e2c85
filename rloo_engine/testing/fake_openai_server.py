"""A scripted OpenAI-compatible chat-completions server on 127.0.0.1, for tests and the throughput bench.

Not for production: it judges by a toy rule. It speaks enough of `POST /v1/chat/completions` for
the official `openai` client, records every request (answers, re-ask or not, time, status, path,
headers) and answers through a *behaviour*: a function from the parsed request to a
`FakeReply` (status, text, headers, extra delay, the model id it reports). Any path ending in
`/chat/completions` is served, whatever comes before it or in its query string (Azure-style
deployment URLs). Built-in behaviours:

    sensible        prefer the better answer by `answer_quality` (more "good", then longer); asked for
                    `logprobs`, answer the letter alone with P(better) = SENSIBLE_CONFIDENCE in its first
                    token's `top_logprobs`
    always_a        always "Preferred: A" (a maximally position-biased judge)
    rate_limited    429 with Retry-After on the first sight of each request, then sensible
    server_error    500, always
    slow_first      first sight of each request is slower than any sane timeout, then sensible
    malformed       a reply with no verdict line, always (re-asks included)
    malformed_then_ok   no verdict line, then a valid one when re-asked
    unauthorized    401 with an OpenAI-style body echoing the key (to test redaction)

Use in-process (`with FakeOpenAIServer("sensible") as server: server.base_url`), or as a separate
process, `python -m rloo_engine.testing.fake_openai_server --latency 0.1`, which prints
`PORT <n>` and serves until stdin closes; the bench uses that so the server does not share the
client's interpreter lock.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from rloo_engine.testing.fake_batch_api import FakeBatchAPI

# The answers of the built-in templates: a verdict-line template goes on with "FIRST", a one-letter one with "Which".
_ANSWERS_RE = re.compile(
    r"(?:Summary|Response) A:\n(.*?)\n\n(?:Summary|Response) B:\n(.*?)\n\n(?:FIRST|Which)", re.DOTALL
)
SENSIBLE_CONFIDENCE = 0.9  # the sensible judge's P(better answer's letter) when asked for logprobs


@dataclass
class ChatRequest:
    """What a behaviour sees: the request body, the two answers, and how often this exact request came before."""

    body: dict[str, Any]
    answer_a: str | None
    answer_b: str | None
    is_reask: bool
    seen_before: int
    authorization: str


@dataclass
class FakeReply:
    status: int = 200
    text: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0
    error_body: dict[str, Any] | None = None
    body: dict[str, Any] | None = None  # a 200 reply with this body instead of a chat completion
    served_model: str | None = None  # the reply's `model` field; None = the model the request named
    logprobs: dict[str, Any] | None = None  # the choice's `logprobs` (see `letter_logprobs`); None = left out


@dataclass
class RecordedRequest:
    time: float  # arrival, time.monotonic()
    answer_a: str | None
    answer_b: str | None
    is_reask: bool
    status: int
    authorization: str
    path: str = ""  # the request target as sent, query string included
    headers: dict[str, str] = field(default_factory=dict)  # names lower-cased


def answer_quality(text: str) -> tuple[int, int]:
    """The toy rule of the sensible judge: more occurrences of "good", then more characters."""
    return text.lower().count("good"), len(text)


def verdict_text(slot: str) -> str:
    return f"Comparison: Answer {slot} covers the important points more precisely.\nPreferred: {slot}"


def letter_logprobs(probabilities: dict[str, float]) -> dict[str, Any]:
    """A chat completion's `logprobs` for a one-token reply: its first token the likeliest of `probabilities`
    ({token: probability}), which are also its `top_logprobs`, likeliest first."""
    ranked = sorted(probabilities.items(), key=lambda item: -item[1])
    top = [{"token": t, "logprob": math.log(p) if p > 0 else -9999.0, "bytes": list(t.encode())} for t, p in ranked]
    return {"content": [{**top[0], "top_logprobs": top}], "refusal": None}


def sensible(req: ChatRequest) -> FakeReply:
    if req.answer_a is None or req.answer_b is None:
        return FakeReply(
            400, error_body={"error": {"message": "could not find the two answers", "type": "invalid_request_error"}}
        )
    slot = "A" if answer_quality(req.answer_a) >= answer_quality(req.answer_b) else "B"
    if req.body.get("logprobs"):
        other = "B" if slot == "A" else "A"
        confidence = {slot: SENSIBLE_CONFIDENCE, other: 1.0 - SENSIBLE_CONFIDENCE}
        return FakeReply(text=slot, logprobs=letter_logprobs(confidence))
    return FakeReply(text=verdict_text(slot))


def always_a(req: ChatRequest) -> FakeReply:
    return FakeReply(text=verdict_text("A"))


def rate_limited(req: ChatRequest, retry_after_s: float = 0.3) -> FakeReply:
    if req.seen_before == 0:
        return FakeReply(
            429,
            headers={"Retry-After": f"{retry_after_s:g}"},
            error_body={"error": {"message": "Rate limit reached", "type": "rate_limit_error"}},
        )
    return sensible(req)


def server_error(req: ChatRequest) -> FakeReply:
    return FakeReply(500, error_body={"error": {"message": "internal error", "type": "server_error"}})


def slow_first(req: ChatRequest, delay_s: float = 2.0) -> FakeReply:
    reply = sensible(req)
    if req.seen_before == 0:
        reply.delay_s = delay_s
    return reply


def malformed(req: ChatRequest) -> FakeReply:
    return FakeReply(text="Both answers have merits and I would not want to choose.")


def malformed_then_ok(req: ChatRequest) -> FakeReply:
    return FakeReply(text="Preferred: A") if req.is_reask else malformed(req)


def unauthorized(req: ChatRequest) -> FakeReply:
    key = req.authorization.removeprefix("Bearer ")
    return FakeReply(
        401,
        error_body={
            "error": {
                "message": f"Incorrect API key provided: {key}. You can find your API key in your account settings.",
                "type": "invalid_request_error",
                "code": "invalid_api_key",
            }
        },
    )


BEHAVIOURS: dict[str, Callable[[ChatRequest], FakeReply]] = {
    "sensible": sensible,
    "always_a": always_a,
    "rate_limited": rate_limited,
    "server_error": server_error,
    "slow_first": slow_first,
    "malformed": malformed,
    "malformed_then_ok": malformed_then_ok,
    "unauthorized": unauthorized,
}


def _token_count(text: str) -> int:
    return max(1, len(text.split()))


class FakeOpenAIServer:
    """An asyncio HTTP/1.1 server in a background thread, answering chat completions by `behaviour`.

    asyncio rather than a thread per connection: 32 keep-alive connections each sleeping out the
    latency cost nothing, and the replies leave on time instead of queueing for the interpreter lock.
    """

    def __init__(
        self,
        behaviour: str | Callable[[ChatRequest], FakeReply] = "sensible",
        latency_s: float = 0.0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.behaviour = BEHAVIOURS[behaviour] if isinstance(behaviour, str) else behaviour
        self.latency_s = latency_s
        self.requests: list[RecordedRequest] = []
        self.max_in_flight = 0
        self._in_flight = 0
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()  # the test thread reads what the server thread records
        self._host, self._port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self.batch_api = FakeBatchAPI(self._batch_row_reply)  # the Files + Batches endpoints

    @property
    def port(self) -> int:
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self._host}:{self.port}/v1"

    @property
    def request_count(self) -> int:
        with self._lock:
            return len(self.requests)

    def count_for(self, answer_a: str, answer_b: str, reask: bool = False) -> int:
        """Requests judging this slot pair (first asks only, unless `reask`)."""
        with self._lock:
            return sum(r.answer_a == answer_a and r.answer_b == answer_b and r.is_reask == reask for r in self.requests)

    def first_ask_counts(self) -> Counter[tuple[str | None, str | None]]:
        with self._lock:
            return Counter((r.answer_a, r.answer_b) for r in self.requests if not r.is_reask)

    def start(self) -> FakeOpenAIServer:
        self._thread = threading.Thread(target=self._serve, name="fake-openai-server", daemon=True)
        self._thread.start()
        self._ready.wait(timeout=30)
        if self._startup_error is not None:
            raise RuntimeError(f"fake OpenAI server could not start: {self._startup_error}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _serve(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(
                asyncio.start_server(self._connection, self._host, self._port, backlog=512)
            )
        except OSError as err:
            self._startup_error = err
            self._ready.set()
            return
        self._port = server.sockets[0].getsockname()[1]
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for task in asyncio.all_tasks(loop):
                task.cancel()
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serves one keep-alive connection: request after request until the client closes it."""
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method, path, _ = request_line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                raw = await reader.readexactly(int(headers.get("content-length", 0)))
                if self.batch_api.handles(path):
                    await asyncio.sleep(self.batch_api.delay_s(method, path))
                    status, payload, extra = self.batch_api.respond(method, path, raw, headers)
                else:
                    status, payload, extra = await self._respond(path, raw, headers)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                content_type = "application/octet-stream" if isinstance(payload, bytes) else "application/json"
                head = [
                    f"HTTP/1.1 {status} {HTTPStatus(status).phrase}",
                    f"Content-Type: {content_type}",
                    f"Content-Length: {len(data)}",
                    *(f"{k}: {v}" for k, v in extra.items()),
                ]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + data)
                await writer.drain()
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return  # the client went away (e.g. it timed out) or sent something we do not speak
        except asyncio.CancelledError:
            return  # the server is stopping; returning (not re-raising) keeps Python 3.11's stream callback quiet
        finally:
            writer.close()

    async def _respond(self, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, Any, dict[str, str]]:
        if not path.partition("?")[0].rstrip("/").endswith("/chat/completions"):
            return 404, {"error": {"message": f"no route {path}"}}, {}
        authorization = headers.get("authorization", "")
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            return 400, {"error": {"message": "body is not JSON"}}, {}
        arrived = time.monotonic()
        request, reply = self.chat_reply(body, authorization)
        with self._lock:
            self.requests.append(
                RecordedRequest(
                    arrived,
                    request.answer_a,
                    request.answer_b,
                    request.is_reask,
                    reply.status,
                    authorization,
                    path,
                    headers,
                )
            )
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            await asyncio.sleep(self.latency_s + reply.delay_s)
        finally:
            with self._lock:
                self._in_flight -= 1
        return self.reply_payload(body, reply)

    def chat_reply(self, body: dict[str, Any], authorization: str) -> tuple[ChatRequest, FakeReply]:
        """The behaviour's reply to one chat-completions body (live, or a row of a batch)."""
        messages = body.get("messages") or []
        first_user = next((m.get("content", "") for m in messages if m.get("role") == "user"), "")
        match = _ANSWERS_RE.search(first_user or "")
        is_reask = any(m.get("role") == "assistant" for m in messages)
        fingerprint = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        with self._lock:
            seen = self._seen[fingerprint]
            self._seen[fingerprint] += 1
        request = ChatRequest(
            body, match.group(1) if match else None, match.group(2) if match else None, is_reask, seen, authorization
        )
        return request, self.behaviour(request)

    def _batch_row_reply(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, payload, _ = self.reply_payload(body, self.chat_reply(body, "")[1])
        return status, payload

    def reply_payload(self, body: dict[str, Any], reply: FakeReply) -> tuple[int, Any, dict[str, str]]:
        messages = body.get("messages") or []
        fingerprint = hashlib.sha256(json.dumps(messages, sort_keys=True).encode()).hexdigest()
        if reply.status != 200:
            return reply.status, reply.error_body or {"error": {"message": f"HTTP {reply.status}"}}, reply.headers
        if reply.body is not None:
            return 200, reply.body, reply.headers
        prompt_tokens = sum(_token_count(str(m.get("content", ""))) for m in messages)
        completion_tokens = _token_count(reply.text)
        return (
            200,
            {
                "id": f"chatcmpl-{fingerprint[:12]}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": reply.served_model or body.get("model", "fake-judge"),
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.text},
                        "finish_reason": "stop",
                        **({"logprobs": reply.logprobs} if reply.logprobs is not None else {}),
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
            reply.headers,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--behaviour", default="sensible", choices=sorted(BEHAVIOURS))
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every request")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    with FakeOpenAIServer(args.behaviour, args.latency, port=args.port) as server:
        print(f"PORT {server.port}", flush=True)
        sys.stdin.read()  # serve until the parent closes our stdin (or kills us)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
