"""Every route of the served app and every event of its page, called as an anonymous visitor and as the wrong user
(issue #28): a walk, so that a route Gradio adds or an event the app adds cannot forget the door. Over HTTP, against
a password server where alice has uploaded a file whose text only she knows; bob and the anonymous visitor try to
read it by every route and through every event (its path as a text, as a file object, as a URL to fetch)."""

from __future__ import annotations

import http.client
import http.server
import json
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import served_app
from test_app_guard import _multipart, _post

SECRET = "alice secret sentence two"
# What answers an anonymous visitor of a password server: the page's shell, the login form and Gradio's static files.
PUBLIC = {"/", "/login", "/login/", "/logout", "/favicon.ico", "/theme.css", "/robots.txt", "/manifest.json",
          "/pwa_icon", "/pwa_icon/{size}", "/static/{path:path}", "/assets/{path:path}", "/svelte/{path:path}",
          "/gradio_api/theme.css", "/gradio_api/startup-events", "/gradio_api/app_id", "/gradio_api/app_id/",
          "/gradio_api/deep_link", "/gradio_api/user", "/gradio_api/user/", "/gradio_api/login_check",
          "/gradio_api/login_check/", "/openapi.json", "/gradio_api/openapi.json",
          "/gradio_api/token", "/gradio_api/token/",  # the caller's own session token (none)
          "/gradio_api/heartbeat/{session_hash}"}  # keeps a session alive; says nothing


STREAM_PAUSE = 1.0  # seconds without a byte after which a stream's answer is read as complete


class _Recorder(http.server.BaseHTTPRequestHandler):
    fetched: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.fetched.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _routes() -> list[tuple[str, str]]:
    """(method, path) of every route of the app's FastAPI application, as Gradio builds it for this page."""
    import gradio as gr

    from app.door.access import Access
    from app.page import build

    app = build(Path("runs"), access=Access("password", accounts=(("alice", "a"), ("bob", "b"))))
    found = []

    def walk(routes) -> None:
        for route in routes:
            if hasattr(route, "original_router"):  # an included router (Gradio's /gradio_api routes)
                walk(route.original_router.routes)
            elif hasattr(route, "path"):
                found.extend((m, route.path) for m in sorted(getattr(route, "methods", None) or {"WS"}))

    walk(gr.routes.App.create_app(app.demo).routes)
    return sorted(set(found))


def _request(url: str, method: str, cookie: str | None, body: bytes | None = None, timeout: float = 5
             ) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Cookie": cookie} if cookie else {})}
    request = urllib.request.Request(url, data=body if method == "POST" else None, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, read = answer.status, answer
            if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
                # A stream that goes on (the heartbeat, dev/reload) sends what it has at once, then nothing for
                # 15 s (Gradio's heartbeat rate): a pause of 1 s reads all that 5 s did (15 s of the walk).
                answer.fp.raw._sock.settimeout(STREAM_PAUSE)
            return status, _read(read)
    except urllib.error.HTTPError as e:
        return e.code, _read(e)


def _read(answer) -> str:
    """What a route answers, up to 1 MB; of a stream that goes on (the heartbeat, the queue's events), what came
    before it paused."""
    chunks = []
    try:
        while sum(map(len, chunks)) < 1 << 20 and (chunk := answer.read1(65536)):
            chunks.append(chunk)
    except (http.client.IncompleteRead, TimeoutError) as e:
        chunks.append(getattr(e, "partial", b"") or b"")
    return b"".join(chunks).decode("utf-8", "replace")


def _sign_in(url: str, name: str, password: str) -> str:
    body = urllib.parse.urlencode({"username": name, "password": password}).encode()
    request = urllib.request.Request(url + "login", data=body, method="POST",
                                     headers={"Content-Type": "application/x-www-form-urlencoded"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        cookies = answer.headers.get_all("Set-Cookie")
    return "; ".join(c.split(";")[0] for c in cookies)


@pytest.mark.slow
def test_every_route_and_event_refuses_the_anonymous_visitor_and_shows_bob_nothing_of_alices(tmp_path,
                                                                                             monkeypatch):
    monkeypatch.chdir(tmp_path)
    routes = _routes()
    assert ("POST", "/gradio_api/queue/join") in routes and ("POST", "/gradio_api/upload") in routes
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    link = f"http://127.0.0.1:{server.server_address[1]}/secret.csv"
    try:
        (tmp_path / "served").mkdir()
        log = tmp_path / "app.log"
        with served_app(tmp_path / "served", log, FINETUNE_USERS="alice:a-secret,bob:b-secret") as (url, _):
            alice, bob = _sign_in(url, "alice", "a-secret"), _sign_in(url, "bob", "b-secret")
            body, headers = _multipart("secret.csv", ("text,label\n" + f"{SECRET},{SECRET}\n" * 4).encode())
            status, text = _post(url + "gradio_api/upload", body, {**headers, "Cookie": alice})
            assert status == 200
            upload = json.loads(text)[0]
            assert SECRET in _request(url + f"gradio_api/file={upload}", "GET", alice)[1]  # hers, to her

            def filled(path: str) -> str:
                values = {"path:path": upload, "path_or_url:path": upload, "url_path:path": link,
                          "size": "192", "api_name": "plan"}
                return re.sub(r"\{([^}]+)\}", lambda m: values.get(m.group(1), "x"), path)

            answered_anonymous = []
            for method, path in routes:
                if method not in ("GET", "POST"):
                    continue
                payload = json.dumps({"data": [upload, {"path": upload, "meta": {"_type": "gradio.FileData"}}],
                                      "fn_index": 0, "session_hash": "walk"}).encode()
                for who in (None, bob):
                    status, text = _request(url + filled(path).lstrip("/"), method, who, payload)
                    assert SECRET not in text and "uploads/alice" not in text, (method, path, who, text[:300])
                    if who is None and status < 300:
                        answered_anonymous.append(path)
            assert set(answered_anonymous) <= PUBLIC, set(answered_anonymous) - PUBLIC
            # Every event of the page, through Gradio's queue: refused to the anonymous visitor before it is
            # queued; bob's, given alice's file as a path, a file object or a URL, show nothing of it.
            bob = _sign_in(url, "bob", "b-secret")  # the walk went by /logout
            status, text = _request(url + "config", "GET", bob, timeout=30)
            config = json.loads(text)
            assert "dependencies" in config, (status, text[:300])
            events = [d for d in config["dependencies"] if d.get("backend_fn", True)]
            assert len(events) > 50
            session = "bob-walk"
            sent = 0
            for dependency in events:
                n = len(dependency["inputs"])
                for value in (upload, link, {"path": upload, "meta": {"_type": "gradio.FileData"}}):
                    body = json.dumps({"data": [value] * n, "fn_index": dependency["id"], "session_hash": session,
                                       "event_data": None, "trigger_id": None}).encode()
                    assert _request(url + "gradio_api/queue/join", "POST", None, body, timeout=60)[0] in (401, 403)
                    status, text = _request(url + "gradio_api/queue/join", "POST", bob, body, timeout=60)
                    if isinstance(value, dict) and n:
                        assert status == 403, (dependency["id"], text)  # not his upload: refused at the door
                    else:
                        assert status == 200, (dependency["id"], text)
                        sent += 1
            completed, stream = 0, ""
            request = urllib.request.Request(url + f"gradio_api/queue/data?session_hash={session}",
                                             headers={"Cookie": bob})
            deadline = time.time() + 240
            with urllib.request.urlopen(request, timeout=240) as answer:
                for line in answer:
                    text = line.decode("utf-8", "replace")
                    stream += text
                    completed += '"msg": "process_completed"' in text or '"msg":"process_completed"' in text
                    if completed >= sent or time.time() > deadline:
                        break
            assert completed == sent, f"{completed} of {sent} events answered"
            assert SECRET not in stream and "uploads/alice" not in stream
            assert _Recorder.fetched == []
        # A refusal is an answer, not a fault: none is logged with its traceback (the walk's refused choices wrote
        # 188 KB of them, from the event loop; into a pipe read slowly, each write stalled every request).
        assert "is not in the list of choices" not in log.read_text()
    finally:
        server.shutdown()
