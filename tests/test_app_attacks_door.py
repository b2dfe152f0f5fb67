"""Issue 41, row 1: nothing of a visitor's file data is decoded, fetched or written before the door has said yes.
Gradio prepares an event's inputs (it decodes an image sent as a `data:` URL and writes it to its cache) before any
handler of the app asks who is calling: on a simulated Space, every input of the page that Gradio reads as a file
is sent each shape of file data by an anonymous visitor, through the route the page uses."""

from __future__ import annotations

import base64
import http.server
import json
import os
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import gradio as gr
import pytest
from conftest import served_app
from test_app_attacks_reads import SIDE, _png
from test_app_guard import _join, _post, _Recorder, _session_cookie

from app.door.guard import NOT_YOUR_FILE

SECRET = "oauth-secret"
SPACE = {"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
         "FINETUNE_ALLOWED_USERS": "alice", "OAUTH_CLIENT_ID": "x", "OAUTH_CLIENT_SECRET": SECRET,
         "OAUTH_SCOPES": "openid profile", "OPENID_PROVIDER_URL": "https://huggingface.co", "HF_HUB_OFFLINE": "1"}


def _reads_files(kind: str) -> bool:
    """Whether Gradio reads a component of this kind (as /config names it) as file data: its data model has a path."""
    def classes(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *classes(sub))]

    cls = next((c for c in classes(gr.components.Component) if c.__name__.lower() == kind), None)
    try:
        model = getattr(cls(), "data_model", None) if cls else None
    except TypeError:  # an abstract component
        return False
    return model is not None and '"path"' in json.dumps(model.model_json_schema())


def _peak_rss(port: int) -> int:
    """The peak resident memory (VmHWM) of the app served on `port`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if b"app" in args and str(port).encode() in args:
            return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM"))) * 1024
    raise AssertionError(f"no app process on port {port}")


def _files(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


@pytest.mark.slow
@pytest.mark.parametrize(("env", "refusal"), [(SPACE, "Sign in with Hugging Face to train."),
                                              ({"FINETUNE_USERS": "alice:a-secret"}, "Sign in to train.")],
                         ids=["space", "password"])
def test_no_file_data_of_a_visitor_is_decoded_fetched_or_written_in_any_shape(tmp_path, env, refusal):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bomb = "data:image/png;base64," + base64.b64encode(_png(SIDE)).decode()  # 169 million pixels in 27 KB
    link = f"http://127.0.0.1:{server.server_address[1]}/x.png"
    meta = {"_type": "gradio.FileData"}
    shapes = {"path": {"path": "/etc/hostname", "orig_name": "x.png", "meta": meta},
              "url": {"url": link, "orig_name": "x.png", "meta": meta},
              "url as path": {"path": link, "meta": meta},
              "data: URL": {"url": bomb, "orig_name": "x.png", "meta": meta},
              "bytes": bomb,
              "in a message": [{"role": "user", "content": [{"file": {"url": bomb, "meta": meta}}]}]}
    try:
        with served_app(tmp_path, **env) as (url, _):
            opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor())
            if env is not SPACE:  # a password server shows its page, and its config, only after a sign-in
                opener.open(url + "login", urllib.parse.urlencode({"username": "alice", "password": "a-secret"})
                            .encode(), timeout=30)
            config = json.loads(opener.open(url + "config", timeout=30).read())
            kinds = {c["id"]: c["type"] for c in config["components"]}
            file_kinds = {k for k in set(kinds.values()) if _reads_files(k)}
            inputs = [(d["id"], i, len(d["inputs"]), kinds[c]) for d in config["dependencies"]
                      for i, c in enumerate(d["inputs"]) if kinds.get(c) in file_kinds]
            assert {"file", "uploadbutton", "image", "chatbot"} <= {kind for *_, kind in inputs}
            port = int(url.rstrip("/").rsplit(":", 1)[1])
            cached, peak = _files(tmp_path / "gradio"), _peak_rss(port)
            slowest = 0.0
            for fn_index, at, count, _ in inputs:
                for name, shape in shapes.items():
                    data = [None] * count
                    data[at] = shape
                    start = time.perf_counter()
                    status, text = _join(url, fn_index, data)
                    slowest = max(slowest, time.perf_counter() - start)
                    assert status == 401 and refusal in text, (fn_index, name, text)
            time.sleep(1.0)  # anything Gradio had queued would be working by now
            grown = _peak_rss(port) - peak
            print(f"row 1: {len(inputs)} file inputs × {len(shapes)} shapes refused, slowest {slowest:.2f} s, the "
                  f"app's peak memory +{grown / 1e6:.0f} MB")
            assert slowest < 2.0 and grown < 200 * 1024**2
            assert _files(tmp_path / "gradio") == cached and _Recorder.fetched == []
            if env is not SPACE:
                return
            # One who may train sends their own uploads only, never inline bytes: Gradio would decode those before
            # the handler could check the image's size.
            alice = _session_cookie(SECRET, "alice")
            fn_index, at, count, _ = next(i for i in inputs if i[3] == "image")
            for name in ("data: URL", "url", "in a message"):
                data = [None] * count
                data[at] = shapes[name]
                status, text = _join(url, fn_index, data, alice)
                assert status == 403 and NOT_YOUR_FILE in text, name
            assert _files(tmp_path / "gradio") == cached
            # Gradio's recording route writes and converts a posted video: no input of the page records.
            status, _ = _post(url + "gradio_api/process_recording", b"x", {"Content-Type": "multipart/form-data"})
            assert status == 404
    finally:
        server.shutdown()
