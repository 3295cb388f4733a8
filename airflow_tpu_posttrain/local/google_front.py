"""HTTPS on port 443 in front of a local stand-in, for clients whose Google endpoint cannot be changed.

TSL's GCS client (in jaxlib, and in TensorFlow) calls ``https://www.googleapis.com/storage/v1/`` with no
emulator setting. A local VM resolves that host to this front (its /etc/hosts), trusts its CA
(``CURL_CA_BUNDLE``), and the front relays each request to the local server over HTTP. It also does what
Google's frontends do and fake-gcs-server (Go's net/http) does not: it accepts a request body sent with
``Transfer-Encoding: identity`` (TSL's uploads; Go answers 501 "Unsupported transfer encoding"). Upload session
URLs the server hands out (``Location``, http on the server's address or on the host asked) are rewritten to https
on the host asked, as Google's are, so the upload's next requests come back here.
The ``Host`` header is relayed as sent: TSL reads objects through the XML API's path-style URL
(``https://storage.googleapis.com/BUCKET/OBJECT``, slashes in the name percent-encoded), which the server behind
serves only to requests for that host.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

# Hop-by-hop headers, and those the relay sets itself.
_NOT_RELAYED = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "te"})
UPSTREAM_TIMEOUT_S = 300.0


class _Relay(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _FrontServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        """Quiet: the server behind keeps its own log."""

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass  # trailers
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _relay(self) -> None:
        body = self._body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_RELAYED}
        upstream = http.client.HTTPConnection(self.server.upstream.hostname, self.server.upstream.port,
                                              timeout=UPSTREAM_TIMEOUT_S)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            answer = upstream.getresponse()
            payload = b"" if self.command == "HEAD" else answer.read()
            self.send_response_only(answer.status, answer.reason)
            for name, value in answer.getheaders():
                if name.lower() in _NOT_RELAYED:
                    continue
                if name.lower() == "location":
                    value = self._through_front(value)
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            self.send_error(502, "the local server behind the front did not answer")
        finally:
            upstream.close()

    def _through_front(self, location: str) -> str:
        """An upload session's URL as Google hands it out: https on the host asked, not the server's HTTP."""
        host = self.headers.get("Host")
        url = urlsplit(location)
        if url.netloc not in (self.server.upstream.netloc, host):
            return location
        return url._replace(scheme="https", netloc=host).geturl()

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _relay


class _FrontServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: str, upstream_url: str, cert: Path, key: Path) -> None:
        super().__init__((address, 443), _Relay)
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(cert, key)
        self.upstream_url = upstream_url
        self.upstream = urlsplit(upstream_url)

    def finish_request(self, request, client_address) -> None:
        """The TLS handshake in the request's own thread: a slow client never holds up the others."""
        try:
            request = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        super().finish_request(request, client_address)


class TlsFront:
    """``TlsFront(address, upstream_url, cert, key)``: HTTPS on ``address:443`` relayed to ``upstream_url``."""

    def __init__(self, address: str, upstream_url: str, cert: Path, key: Path) -> None:
        self._server = _FrontServer(address, upstream_url, cert, key)
        self._thread = threading.Thread(target=self._server.serve_forever, name="tls-front", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
