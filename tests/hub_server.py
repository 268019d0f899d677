"""A loopback HTTP server (127.0.0.1 only) that speaks the part of the Hugging Face hub's
API that huggingface_hub uses to resolve and read files: ``HEAD``/``GET``
``/{repo}/resolve/{revision}/{file}`` with the commit and ETag headers, byte ranges, and
the hub's error codes. It counts the bytes it serves per file, so a test can prove that
planning by hub id read headers and not weights. (The real hub is unreachable from the
test machines, and tests must not depend on it anyway.)"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path]):
        self.repos = repos
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
                path = hub.repos[repo] / name
                if not path.is_file():
                    return self._error(404, "EntryNotFound")
                data = path.read_bytes()
                start, end = 0, len(data) - 1
                rng = self.headers.get("Range")
                if rng:
                    a, b = re.match(r"bytes=(\d+)-(\d*)", rng).groups()
                    start, end = int(a), min(int(b) if b else len(data) - 1, len(data) - 1)
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
                    self.wfile.write(chunk)
                    hub.served[f"{repo}/{name}"] += len(chunk)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
