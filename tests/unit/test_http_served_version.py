"""`HTTPEngine(served_version=True)` (engine.weight_sync = "distributed" with engine.type =
"http", issue 44): the trainer pushes weights to the server behind the client's back, so the
client's `version` is what the server says it serves (`/get_model_info` weight_version), which
is what a rollout worker's weight sync and staleness accounting go by."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from slipstream.engine.http_client import HTTPEngine, served_weight_version


class _InfoServer:
    """A loopback HTTP server answering GET /get_model_info with `info`."""

    def __init__(self) -> None:
        self.info: dict[str, Any] = {"weight_version": "0"}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = json.dumps(outer.info).encode()
                self.send_response(200 if self.path == "/get_model_info" else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_served_weight_version_parses_decimal_labels_only() -> None:
    assert served_weight_version({"weight_version": "12"}) == 12
    assert served_weight_version({"weight_version": " 7 "}) == 7
    for label in ("default", "disk_update_v2.0.0", "-3", "", "١٢", None):  # SGLang's free-form
        assert served_weight_version({"weight_version": label}) == -1, label
    assert served_weight_version({}) == -1


def test_a_pushed_servers_client_reports_what_the_server_serves() -> None:
    server = _InfoServer()
    pushed = HTTPEngine(server.url, version=-1, served_version=True, max_retries=0)
    loaded = HTTPEngine(server.url, version=-1, max_retries=0)
    try:
        assert pushed.version == 0 and loaded.version == -1
        server.info = {"weight_version": "5"}  # the trainer pushed version 5
        assert pushed.version == 5 and loaded.version == -1  # only the pushed client follows
        server.info = {"weight_version": "default"}  # a label names no trainer version
        assert pushed.version == -1
        server.info = {"weight_version": "6"}
        assert pushed.version == 6
    finally:
        server.close()
    assert pushed.version == 6  # the server is gone: the last answer stands
    pushed.close()
    loaded.close()
