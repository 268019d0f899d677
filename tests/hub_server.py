"""A loopback HTTP server (127.0.0.1 only) that speaks the part of the Hugging Face hub's
API that huggingface_hub uses to resolve and read files: ``HEAD``/``GET``
``/{repo}/resolve/{revision}/{file}`` with the commit and ETag headers, byte ranges, and
the hub's error codes. It counts the bytes it serves per file, so a test can prove that
planning by hub id read headers and not weights. (The real hub is unreachable from the
test machines, and tests must not depend on it anyway.)

A repository is a directory, or a ``{file: bytes}`` dict served from memory (a test may
change it between requests: hostile headers and indexes made per example). Two modes play
a hostile or broken server: ``ignore_range`` answers every request ``200`` with the whole
file, as a server that does not honour ranges does; ``drip`` (``{file: seconds}``) sends
that file's body one byte every so many seconds, as a stalled server does;
``range_from_start`` answers ``206`` but always from the file's first byte (saying so in its
``Content-Range``), as a broken proxy may. Bodies go out in small chunks and
``served`` counts only what was written, so a client that stops reading early shows as
the bytes it took (plus what the sockets buffer), not as the whole file."""

from __future__ import annotations

import hashlib
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


#: Bytes per write of a body; the socket's send buffer is kept near this too, so what a
#: client that stopped reading leaves unread stays small.
CHUNK = 16 * 1024


class FakeHub:
    def __init__(self, repos: dict[str, Path | dict[str, bytes]], *, ignore_range: bool = False,
                 drip: dict[str, float] | None = None, range_from_start: bool = False):
        self.repos = repos
        self.ignore_range, self.drip = ignore_range, drip or {}
        self.range_from_start = range_from_start
        self.served: Counter[str] = Counter()  # "repo/file" -> body bytes sent
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.authorization: set[str] = set()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _error(self, status, code):
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _serve(self, body):
                hub.requests.append((self.command, self.path, self.headers.get("Range")))
                if self.headers.get("Authorization"):
                    hub.authorization.add(self.headers["Authorization"])
                m = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", self.path.split("?")[0])
                if m is None or m.group(1) not in hub.repos:
                    return self._error(401 if m else 404, "RepoNotFound")
                repo, revision, name = m.groups()
                if revision not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                files = hub.repos[repo]
                if isinstance(files, dict):
                    data = files.get(name)
                else:
                    data = (files / name).read_bytes() if (files / name).is_file() else None
                if data is None:
                    return self._error(404, "EntryNotFound")
                start, end = 0, len(data) - 1
                rng = None if hub.ignore_range else self.headers.get("Range")
                if rng:
                    a, b = re.match(r"bytes=(\d+)-(\d*)", rng).groups()
                    start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
                    if hub.range_from_start:  # a broken proxy: 206, but always from byte 0
                        start, end = 0, end - start
                chunk = data[start:end + 1]
                self.send_response(206 if rng else 200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Accept-Ranges", "bytes")
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
                self.send_header("Content-Length", str(len(chunk) if body or rng else len(data)))
                self.end_headers()
                if body:
                    drip = hub.drip.get(name)
                    step = 1 if drip else CHUNK
                    try:
                        for at in range(0, len(chunk), step):
                            if drip:
                                time.sleep(drip)
                            self.wfile.write(chunk[at:at + step])
                            self.wfile.flush()
                            hub.served[f"{repo}/{name}"] += len(chunk[at:at + step])
                    except (BrokenPipeError, ConnectionResetError):
                        pass  # the client stopped reading, as it may

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def get_request(self):
                conn, addr = super().get_request()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, CHUNK)
                return conn, addr

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # A short poll: shutting the server down waits for one (the default is half a second).
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
