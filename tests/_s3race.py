"""An S3 whose conditional puts race as real S3's do, for testing claims: moto behind a proxy.

moto's S3 checks `If-None-Match: *` and then writes, two steps another request can come
between, so against moto alone two racing claimers may both win: it cannot show that a claim
is exactly-once. This proxy, on 127.0.0.1 in front of moto's server, passes every request
through unchanged except conditional puts, which it decides as S3 does: one conditional put
of a name at a time is let through (held `hold` seconds, as a real upload takes time); one
that arrives while another of the same name is in flight is answered 409
ConditionalRequestConflict ("try again"), and moto, which then only ever sees one at a time
per name, answers the rest (200, or 412 once the name exists). `conflicts` answers the next
so many conditional puts 409 without passing them on, and `land` lets a write of another
client's bytes land first (the 409 was its write in flight).
"""

from __future__ import annotations

import collections
import http.client
import http.server
import threading
import time
from urllib.parse import urlsplit

_CONFLICT = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ConditionalRequestConflict</Code>'
    b"<Message>A conflicting conditional operation is currently in progress against this "
    b"resource. Please try again.</Message><RequestId>proxy</RequestId></Error>"
)


def _about_the_body(header: str) -> bool:
    """Headers that describe the body of the request they came with (or its condition)."""
    name = header.lower()
    return name in ("if-none-match", "content-md5", "x-amz-trailer") or name.startswith(
        ("x-amz-checksum", "x-amz-sdk-checksum")
    )


class RacingS3:
    """A proxy in front of the S3 server at `upstream` (an http:// URL on 127.0.0.1)."""

    def __init__(self, upstream: str, hold: float = 0.0) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.hold = hold
        self.conflicts = 0
        self.land: bytes | None = None
        self.answered: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._flying: set[str] = set()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> RacingS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def _forward(self, method: str, path: str, headers: list, body: bytes) -> tuple:
        conn = http.client.HTTPConnection(*self.upstream, timeout=30)
        try:
            conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
            for key, value in headers:
                if key.lower() not in ("transfer-encoding", "content-length"):
                    conn.putheader(key, value)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            answer = conn.getresponse()
            return answer.status, answer.getheaders(), answer.read()
        finally:
            conn.close()

    def _conditional(self, path: str, headers: list, body: bytes) -> tuple:
        with self._lock:
            if self.conflicts > 0 or path in self._flying:
                self.conflicts = max(0, self.conflicts - 1)
                if self.land is not None:  # the write in flight was another client's: it lands
                    plain = [(k, v) for k, v in headers if not _about_the_body(k)]
                    self._forward("PUT", path, plain, self.land)
                    self.land = None
                return 409, [("Content-Type", "application/xml")], _CONFLICT
            self._flying.add(path)
        try:
            time.sleep(self.hold)
            return self._forward("PUT", path, headers, body)
        finally:
            with self._lock:
                self._flying.discard(path)

    def _handler(self) -> type:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _any(self) -> None:
                body = self._body()
                headers = list(self.headers.items())
                if self.command == "PUT" and self.headers.get("If-None-Match") == "*":
                    status, out_headers, out = proxy._conditional(self.path, headers, body)
                    with proxy._lock:
                        proxy.answered[status] += 1
                else:
                    status, out_headers, out = proxy._forward(
                        self.command, self.path, headers, body
                    )
                self.send_response(status)
                length = str(len(out))
                for key, value in out_headers:
                    if key.lower() == "content-length" and self.command == "HEAD":
                        length = value  # a HEAD's length is the object's, and no body follows
                    elif key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(out)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _any

        return Handler
