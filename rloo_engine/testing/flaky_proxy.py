"""A TCP proxy in front of a real server that can cut its answers: what a tracking server dying mid-request looks like
to a client. Modes: `forward` (pass everything through), `cut` (answer each request with a chunked body that stops
after a few bytes, so `requests` raises ChunkedEncodingError), `refuse` (close each connection at once)."""

from __future__ import annotations

import socket
import threading

from rloo_engine.services import free_port

CUT_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"40\r\n{\"partial\": ")


class FlakyProxy:
    def __init__(self, upstream_port: int, host: str = "127.0.0.1"):
        self.upstream = (host, upstream_port)
        self.port = free_port(host)
        self.mode = "forward"
        self.cut_requests = 0
        self._server = socket.create_server((host, self.port))
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.upstream[0]}:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(client,), daemon=True).start()

    def _handle(self, client: socket.socket) -> None:
        mode = self.mode
        try:
            if mode == "refuse":
                return
            if mode == "cut":
                client.recv(65536)  # the request (or its start)
                self.cut_requests += 1
                client.sendall(CUT_RESPONSE)
                return
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                client.close()  # the server is down: the client sees its connection closed
                return
            upstream.settimeout(None)
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()
            self._requests(client, upstream)
        finally:
            if mode != "forward":
                client.close()

    def _requests(self, client: socket.socket, upstream: socket.socket) -> None:
        """Passes the client's bytes on while the mode is `forward`; a kept-alive connection sees a new mode at
        its next request."""
        try:
            while data := client.recv(65536):
                if self.mode == "cut":
                    self.cut_requests += 1
                    client.sendall(CUT_RESPONSE)
                    break
                if self.mode == "refuse":
                    break
                upstream.sendall(data)
        except OSError:
            pass
        for s in (client, upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self._server.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (source, sink):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
