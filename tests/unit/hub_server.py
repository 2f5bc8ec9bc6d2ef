"""A local HTTP server that serves checkpoint folders the way the Hugging Face hub does, recording each request.

Just what huggingface_hub's clients ask for: repository info (`GET /api/models/{repo}[/revision/{rev}]`), the
recursive file listing with each LFS file's SHA-256 (`GET /api/models/{repo}/tree/{rev}`), and files (`HEAD` then
`GET /{repo}/resolve/{rev}/{file}`, answered with `X-Repo-Commit`, `ETag` and `Content-Length`; a `Range: bytes=A-B`
or `bytes=A-` GET gets those bytes only, with status 206 and `Content-Range` as the hub's CDN answers, recorded as
method "RANGE"; `bytes_sent` counts the file bytes sent, `bytes_delivered` those the client took before hanging up).
Point `HF_ENDPOINT` at `.url`.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

FAKE_COMMIT = "c0ffee0000000000000000000000000000000001"
BYTE_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class FakeHub:
    """Repositories (id -> folder) served at `url`; `requests` lists (method, path) in arrival order."""

    repos: dict[str, Path] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    # File name -> bytes served instead of the file's own (a tampered mirror); the listing keeps the true hash.
    tampered: dict[str, bytes] = field(default_factory=dict)
    # File name -> bytes a GET sends after the file's own, with no Content-Length (a server sending past the listed
    # size); a HEAD still states the listed size.
    oversent: dict[str, int] = field(default_factory=dict)
    # When false, Range headers are ignored (the whole file is answered, status 200), as some mirrors do.
    serves_ranges: bool = True
    url: str = ""
    # File bytes sent in answers to resolve GETs, whole or ranged.
    bytes_sent: int = 0
    # Body bytes the client took before it closed the connection (every answer's).
    bytes_delivered: int = 0
    # When true, every listing page names more files and links a next page (a hub that pages without end).
    endless_listing: bool = False
    listing_pages: int = 0

    def downloaded(self, repo_id: str) -> set[str]:
        """Names of the files of `repo_id` whose bytes were sent (GET of a resolve URL)."""
        prefix = f"/{repo_id}/resolve/"
        return {path[len(prefix):].split("/", 1)[1] for method, path in self.requests
                if method == "GET" and path.startswith(prefix)}


def _listing_entry(file: Path) -> dict:
    data = file.read_bytes()
    entry = {"type": "file", "path": file.name, "size": len(data),
             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    if file.suffix in (".safetensors", ".gguf"):  # the hub stores both through LFS
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _handler_for(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _answer(self, *, send_body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            byte_range = BYTE_RANGE.match(self.headers.get("Range", "")) if self.command == "GET" else None
            byte_range = byte_range if hub.serves_ranges else None
            hub.requests.append(("RANGE" if byte_range else self.command, path))
            for repo_id, folder in hub.repos.items():
                if path in (f"/api/models/{repo_id}", f"/api/models/{repo_id}/revision/main",
                            f"/api/models/{repo_id}/revision/{FAKE_COMMIT}"):
                    siblings = [{"rfilename": file.name} for file in sorted(folder.iterdir()) if file.is_file()]
                    return self._json({"id": repo_id, "sha": FAKE_COMMIT, "siblings": siblings}, send_body)
                if path.rstrip("/") == f"/api/models/{repo_id}/tree/{FAKE_COMMIT}" and hub.endless_listing:
                    hub.listing_pages += 1
                    page = [{"type": "file", "path": f"extra-{hub.listing_pages}-{index}.json", "size": 1,
                             "oid": "0" * 40} for index in range(1000)]
                    return self._json(page, send_body, link=f"<{hub.url}/api/models/{repo_id}/tree/{FAKE_COMMIT}"
                                                            f"?cursor={hub.listing_pages}>; rel=\"next\"")
                if path.rstrip("/") == f"/api/models/{repo_id}/tree/{FAKE_COMMIT}":
                    listing = [_listing_entry(file) for file in sorted(folder.iterdir()) if file.is_file()]
                    return self._json(listing, send_body)
                for revision in ("main", FAKE_COMMIT):
                    prefix = f"/{repo_id}/resolve/{revision}/"
                    if path.startswith(prefix) and (folder / path[len(prefix):]).is_file():
                        name = path[len(prefix):]
                        data = hub.tampered.get(name, (folder / name).read_bytes())
                        etag = hashlib.sha256(data).hexdigest()
                        if byte_range:
                            first = int(byte_range.group(1))
                            last = min(int(byte_range.group(2) or len(data) - 1), len(data) - 1)
                            hub.bytes_sent += last + 1 - first
                            return self._bytes(data[first:last + 1], send_body, etag=etag, status=206,
                                               content_range=f"bytes {first}-{last}/{len(data)}")
                        if name in hub.oversent and send_body:
                            return self._endless(data, hub.oversent[name], etag)
                        hub.bytes_sent += len(data) if send_body else 0
                        return self._bytes(data, send_body, etag=etag)
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _json(self, value, send_body: bool, *, link: str | None = None) -> None:
            self._bytes(json.dumps(value).encode(), send_body, content_type="application/json", link=link)

        def _bytes(self, data: bytes, send_body: bool, *, etag: str | None = None,
                   content_type: str = "application/octet-stream", status: int = 200,
                   content_range: str | None = None, link: str | None = None) -> None:
            self.send_response(status)
            if link is not None:
                self.send_header("Link", link)
            if content_range is not None:
                self.send_header("Content-Range", content_range)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("X-Repo-Commit", FAKE_COMMIT)
            if etag is not None:
                self.send_header("ETag", f'"{etag}"')
            self.end_headers()
            if send_body:
                self._deliver(data)

        def _endless(self, data: bytes, extra: int, etag: str) -> None:
            # HTTP/1.0-style: the body ends when the connection closes, so only the client's count bounds it.
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("X-Repo-Commit", FAKE_COMMIT)
            self.send_header("ETag", f'"{etag}"')
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if self._deliver(data):
                self._deliver(b"\0" * extra)

        def _deliver(self, data: bytes) -> bool:
            try:
                for start in range(0, len(data), 64 << 10):
                    piece = data[start:start + (64 << 10)]
                    self.wfile.write(piece)
                    hub.bytes_delivered += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                return False
            return True

    return Handler


@pytest.fixture
def fake_hub(monkeypatch):
    """A FakeHub on a free local port, with HF_ENDPOINT pointing at it."""
    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def error_beside_a_stalled_twin(lock_path: Path, fetch, monkeypatch) -> BaseException | None:
    """What `fetch` raises, run on a thread while `lock_path` is held locked by a twin that never writes (a process
    downloading the same bytes, stopped or stuck), with the stall limit cut to 1 s; fails when it waits on."""
    import fcntl

    from hearth.inference import hub_download

    monkeypatch.setattr(hub_download, "TWIN_STALL_MIN_S", 1.0)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_DOWNLOAD_TIMEOUT", 0.1)
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fetch()
        except Exception as error:  # handed to the test's thread
            outcome.append(error)
        else:
            outcome.append(None)

    with open(lock_path, "ab") as twin:
        fcntl.flock(twin, fcntl.LOCK_EX)
        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        worker.join(timeout=30)
    assert not worker.is_alive(), "waited on the stalled twin without end"
    return outcome[0]
