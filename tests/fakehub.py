"""A small local stand-in for the Hugging Face Hub's HTTP API, for huggingface_hub's real client (HF_ENDPOINT).

It answers what a push uses: whoami-v2 (token → user, orgs and role), repos/create, model info (404: no card to read
a license from), validate-yaml (the card's front matter must be a mapping of known keys), preupload (every file
"regular", so the commit carries the files inline: the LFS/Xet transfer path is not served) and commit (NDJSON:
a header, then one base64 file per line), for model and dataset repositories, and a dataset's info (its privacy).
What it received is kept in `repos`. Jobs and storage buckets are served by tests/fakejobs.py (`hub.jobs`).

`loopback_only` and `loopback_site` make a test fail on any connection that is not to 127.0.0.1, in the test's own
process and in the processes it starts.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml
from fakejobs import FakeJobs
from fakejobs import handle as jobs_route

TOKENS = {"hf_write": ("alice", "write"), "hf_read": ("alice", "read")}
ORGS = ["team"]


@dataclass
class FakeHub:
    """The server's state: repositories created (with their privacy) and the files committed to each."""

    url: str = ""
    repos: dict[str, dict[str, Any]] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, token
    fail_commits: bool = False
    jobs: FakeJobs = field(default_factory=FakeJobs)


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _token(self) -> str | None:
            auth = self.headers.get("authorization") or ""
            return auth[len("Bearer "):] if auth.startswith("Bearer ") else None

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            if status >= 400:
                self.send_header("x-error-message", body.get("error", ""))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("content-length") or 0))

        def _user(self) -> tuple[str, str] | None:
            return TOKENS.get(self._token() or "")

        @property
        def hub_url(self) -> str:
            return hub.url

        def do_HEAD(self) -> None:  # noqa: N802
            hub.requests.append(("HEAD", self.path, self._token()))
            if not jobs_route(self, hub, "HEAD"):
                self._send(404, {"error": f"not served: {self.path}"})

        def do_GET(self) -> None:  # noqa: N802
            hub.requests.append(("GET", self.path, self._token()))
            if jobs_route(self, hub, "GET"):
                return
            parts = self.path.split("?")[0].split("/")  # /api/datasets/<ns>/<name>: its info
            if len(parts) == 5 and parts[:3] == ["", "api", "datasets"] and f"{parts[3]}/{parts[4]}" in hub.repos:
                repo = hub.repos[f"{parts[3]}/{parts[4]}"]
                return self._send(200, {"id": f"{parts[3]}/{parts[4]}", "private": repo["visibility"] == "private",
                                        "sha": f"{len(repo['commits']):040x}", "siblings": []})
            if self.path == "/api/whoami-v2":
                user = self._user()
                if user is None:
                    return self._send(401, {"error": "Invalid credentials in Authorization header"})
                return self._send(200, {"type": "user", "name": user[0], "orgs": [{"name": o} for o in ORGS],
                                        "auth": {"type": "access_token", "accessToken": {"role": user[1]}}})
            return self._send(404, {"error": "Repository not found"})

        def do_POST(self) -> None:  # noqa: N802
            hub.requests.append(("POST", self.path, self._token()))
            if jobs_route(self, hub, "POST"):
                return
            body = self._body()
            user = self._user()
            if user is None or user[1] != "write":
                return self._send(401, {"error": "Invalid credentials in Authorization header"})
            if self.path == "/api/repos/create":
                payload = json.loads(body)
                repo_id = f"{payload.get('organization') or user[0]}/{payload['name']}"
                if repo_id.split("/")[0] not in (user[0], *ORGS):
                    return self._send(403, {"error": "You don't have the rights to create a model under this "
                                                     "namespace"})
                if repo_id in hub.repos:
                    return self._send(409, {"error": "You already created this model repo", "url":
                                            f"{hub.url}/{repo_id}"})
                hub.repos[repo_id] = {"visibility": payload.get("visibility"), "files": {}, "commits": []}
                return self._send(200, {"url": f"{hub.url}/{repo_id}", "name": repo_id})
            if self.path == "/api/validate-yaml":
                errors = _card_errors(json.loads(body)["content"])
                return self._send(400 if errors else 200, {"errors": [{"message": e} for e in errors],
                                                           "warnings": []})
            parts = self.path.split("/")  # /api/<models|datasets>/<ns>/<name>/<preupload|commit>/<revision>
            if len(parts) == 7 and parts[:2] == ["", "api"] and parts[2] in ("models", "datasets"):
                repo_id, action = f"{parts[3]}/{parts[4]}", parts[5]
                if repo_id not in hub.repos:
                    return self._send(404, {"error": "Repository not found"})
                if action == "preupload":
                    files = json.loads(body)["files"]
                    return self._send(200, {"files": [{"path": f["path"], "uploadMode": "regular",
                                                       "shouldIgnore": False} for f in files]})
                if action == "commit":
                    if hub.fail_commits:
                        return self._send(500, {"error": "Internal Error - We're working hard to fix this"})
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    header = next(x["value"] for x in lines if x["key"] == "header")
                    for x in lines:
                        if x["key"] == "file":
                            value = x["value"]
                            hub.repos[repo_id]["files"][value["path"]] = base64.b64decode(value["content"])
                    oid = f"{len(hub.repos[repo_id]['commits']) + 1:040x}"
                    hub.repos[repo_id]["commits"].append(header["summary"])
                    return self._send(200, {"commitUrl": f"{hub.url}/{repo_id}/commit/{oid}", "commitOid": oid,
                                            "pullRequestUrl": None})
            return self._send(404, {"error": f"not served: {self.path}"})

    return Handler


CARD_KEYS = {"library_name": str, "license": str, "base_model": str, "base_model_relation": str, "datasets": list,
             "pipeline_tag": str, "tags": list, "model-index": list}


def _card_errors(content: str) -> list[str]:
    """What the Hub would refuse in a README's front matter (a subset: known keys and their types)."""
    match = re.match(r"---\n(.*?)\n---\n", content, re.S)
    if not match:
        return ["no YAML front matter"]
    meta = yaml.safe_load(match.group(1))
    if not isinstance(meta, dict):
        return ["the front matter is not a mapping"]
    return [f"{k}: expected {t.__name__}" for k, t in CARD_KEYS.items() if k in meta and not isinstance(meta[k], t)]


LOOPBACK_SITE = """import socket

_connect = socket.socket.connect


def _loopback_only(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
        raise OSError(f"test guard: a connection to {host!r} is not allowed (loopback only)")
    return _connect(self, address)


socket.socket.connect = _loopback_only
"""


def loopback_site(folder: Path) -> str:
    """A folder with a `sitecustomize.py` that refuses every connection not to the loopback interface: put it first
    on PYTHONPATH of a process a test starts."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(LOOPBACK_SITE, encoding="utf-8")
    return str(folder)


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Within the block, this process may connect to 127.0.0.1 only."""
    namespace: dict[str, Any] = {}
    real = socket.socket.connect
    exec(LOOPBACK_SITE, namespace)  # installs the guard
    try:
        yield
    finally:
        socket.socket.connect = real


@contextlib.contextmanager
def fake_hub() -> Iterator[FakeHub]:
    """Serve a `FakeHub` on a free local port for the duration of the block."""
    hub = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
