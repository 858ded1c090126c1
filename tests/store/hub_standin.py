"""A Hugging Face hub stand-in on loopback, for `servelm fetch` tests (never the internet).

It answers what huggingface_hub 2.x asks for `snapshot_download` and `HfApi`, read from its
source (file_download.py, _snapshot_download.py, hf_api.py, utils/_http.py):

    GET  /api/models/{repo}[/revision/{rev}]    model info: sha (the commit) and siblings
    GET  /api/models/{repo}/tree/{rev}          the files: path, size, git blob id, LFS sha256
    HEAD /{repo}/resolve/{rev}/{file}           X-Repo-Commit, ETag (X-Linked-Etag/-Size for LFS)
    GET  /{repo}/resolve/{rev}/{file}           the bytes, whole or from a `Range: bytes=N-`

Errors carry the X-Error-Code huggingface_hub maps to its exceptions (RepoNotFound,
RevisionNotFound, EntryNotFound, GatedRepo). Every request is recorded (method, path, Range,
Authorization), so a test can count what a fetch asked for. Two faults can be armed: `cut_once`
sends half of a file and closes the connection, once per file; `hold` stops sending a file after
some bytes until `release()`, so a test can kill the client mid-file.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_CHUNK = 1 << 16
_RANGE_RE = re.compile(r"bytes=(\d+)-(\d*)")


@dataclass
class RepoFile:
    path: str
    data: bytes | None  # in memory, or read from `source`
    source: Path | None
    size: int
    lfs: bool
    sha256: str
    blob_id: str  # git sha1 of the file, or of its LFS pointer

    def read(self, start: int, end: int):
        """The bytes [start, end) in chunks."""
        if self.data is not None:
            for at in range(start, end, _CHUNK):
                yield self.data[at : min(at + _CHUNK, end)]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                chunk = f.read(min(_CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
                yield chunk


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_file(path: str, *, source: Path | None = None, data: bytes | None = None) -> RepoFile:
    """A repo file; weights (`*.safetensors`) are in LFS, as the hub's default .gitattributes has
    it, so both kinds of checksum (LFS sha256, git blob id) are exercised."""
    digest = hashlib.sha256()
    if data is None:
        with open(source, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
        size = source.stat().st_size
    else:
        digest.update(data)
        size = len(data)
    sha256 = digest.hexdigest()
    lfs = path.endswith(".safetensors")
    if lfs:
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
        blob_id = _git_sha1(pointer.encode())
    else:
        blob_id = _git_sha1(data if data is not None else source.read_bytes())
    return RepoFile(path, data, source, size, lfs, sha256, blob_id)


@dataclass
class Repo:
    commit: str
    files: dict[str, RepoFile]
    branches: tuple[str, ...] = ("main",)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class HubStandIn:
    repos: dict[str, Repo]
    token: str | None = None  # when set, a request without "Bearer <token>" gets 401 GatedRepo
    requests: list[Request] = field(default_factory=list)
    cut_once: set[str] = field(default_factory=set)  # file paths to cut mid-body, once each
    cuts: dict[str, int] = field(default_factory=dict)  # file path -> bytes sent before the cut
    bytes_sent: Counter = field(default_factory=Counter)
    hold: tuple[str, int] | None = None  # (file path, bytes) to send before waiting for release
    held: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def release(self) -> None:
        self._released.set()

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_sent.clear()

    def downloads(self, name: str | None = None) -> list[Request]:
        """GET /resolve requests (of file `name`, if given)."""
        return [
            r
            for r in list(self.requests)
            if r.method == "GET"
            and "/resolve/" in r.path
            and (name is None or r.path.endswith("/" + name))
        ]


def _handler(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        # -- helpers ---------------------------------------------------------------------
        def _send(self, status: int, headers: dict[str, str], payload: bytes = b"") -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

        def _json(self, obj, headers: dict[str, str] | None = None) -> None:
            self._send(
                200,
                {"Content-Type": "application/json", **(headers or {})},
                json.dumps(obj).encode(),
            )

        def _error(self, status: int, code: str, extra: dict[str, str] | None = None) -> None:
            body = json.dumps({"error": code}).encode()
            self._send(
                status, {"X-Error-Code": code, "X-Error-Message": code, **(extra or {})}, body
            )

        def _commit(self, repo: Repo, rev: str) -> str | None:
            return repo.commit if rev in (repo.commit, *repo.branches) else None

        # -- routes ----------------------------------------------------------------------
        def _answer(self, body: bool) -> None:
            path = urlsplit(self.path).path
            with hub._lock:
                hub.requests.append(
                    Request(
                        self.command,
                        path,
                        self.headers.get("Range"),
                        self.headers.get("Authorization"),
                    )
                )
            m = re.fullmatch(r"/api/models/(.+?)(?:/revision/([^/]+)|/tree/([^/]+)(/.*)?)?", path)
            if m:
                return self._api(unquote(m[1]), m[2] or m[3], tree=m[3] is not None)
            m = re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(m[1], unquote(m[2]), unquote(m[3]), body)
            self._error(404, "NotFound")

        def _repo(self, repo_id: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound")
                return None
            if hub.token is not None and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._error(401, "GatedRepo")
                return None
            return repo

        def _api(self, repo_id: str, rev: str | None, tree: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = self._commit(repo, unquote(rev or "main"))
            if commit is None:
                return self._error(404, "RevisionNotFound")
            if not tree:
                siblings = [{"rfilename": f.path} for f in repo.files.values()]
                return self._json({"id": repo_id, "sha": commit, "siblings": siblings})
            entries = []
            for f in repo.files.values():
                entry = {"type": "file", "oid": f.blob_id, "size": f.size, "path": f.path}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 128}
                entries.append(entry)
            self._json(entries)

        def _resolve(self, repo_id: str, rev: str, name: str, body: bool) -> None:
            repo = self._repo(repo_id)
            if repo is None:
                return
            commit = self._commit(repo, rev)
            if commit is None:
                return self._error(404, "RevisionNotFound")
            f = repo.files.get(name)
            if f is None:
                return self._error(404, "EntryNotFound", {"X-Repo-Commit": commit})
            etag = f.sha256 if f.lfs else f.blob_id
            headers = {"X-Repo-Commit": commit, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
            if f.lfs:
                headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(f.size)}
            start, status = 0, 200
            m = _RANGE_RE.fullmatch(self.headers.get("Range") or "")
            if m and body:
                start, status = int(m[1]), 206
                headers["Content-Range"] = f"bytes {start}-{f.size - 1}/{f.size}"
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(f.size - start))
            self.end_headers()
            if not body:
                return
            cut = None
            with hub._lock:
                if name in hub.cut_once and status == 200:
                    hub.cut_once.discard(name)
                    cut = f.size // 2
            sent = start
            try:
                for chunk in f.read(start, f.size if cut is None else cut):
                    if hub.hold and hub.hold[0] == name and sent >= hub.hold[1]:
                        hub.held.set()
                        hub._released.wait(60)
                    self.wfile.write(chunk)
                    sent += len(chunk)
                    with hub._lock:
                        hub.bytes_sent[name] += len(chunk)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
                return
            if cut is not None:
                self.wfile.flush()
                hub.cuts[name] = cut
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

    return Handler
