"""The HTTP routes Gradio leaves open on a shared server (issue #18, items 5 and 6), through real requests to a
served app: on a Space its upload route takes files only from a signed-in user who may train, and only up to the
upload quota; the login form of a password server slows down a run of wrong passwords, per account and address."""

from __future__ import annotations

import base64
import hashlib
import http.client
import http.server
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from conftest import served_app

from app.door.guard import (
    FORGET_S,
    FREE_FAILURES,
    MAX_DELAY_S,
    NOT_YOUR_FILE,
    Throttle,
    UploadLedger,
    client_address,
    forwarded_header,
    trusted_networks,
)


def _post(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=data, headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _multipart(name: str, content: bytes) -> tuple[bytes, dict[str, str]]:
    boundary = "finetune-test-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"files\"; filename=\"{name}\"\r\n"
            "Content-Type: text/csv\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def _session_cookie(secret: str, user: str) -> str:
    """The cookie Gradio's OAuth session middleware (Starlette's) would set after a Hugging Face sign-in."""
    import itsdangerous

    key = hashlib.sha256(f"{secret}-v4".encode()).hexdigest()
    session = {"oauth_info": {"userinfo": {"preferred_username": user}, "expires_at": time.time() + 3600}}
    signed = itsdangerous.TimestampSigner(key).sign(base64.b64encode(json.dumps(session).encode()))
    return f"session={signed.decode()}"


def test_one_address_guessing_one_account_waits_and_nobody_else_does():
    now = [1000.0]
    throttle = Throttle(clock=lambda: now[0])
    for _ in range(FREE_FAILURES):
        assert throttle.admit("alice", "6.6.6.6") == 0
    assert throttle.admit("alice", "6.6.6.6") == 1.0  # refused: not counted
    now[0] += 1.0
    assert throttle.admit("alice", "6.6.6.6") == 0 and throttle.wait_s("alice", "6.6.6.6") == 2.0
    # The owner from their own address, and another account from the guesser's (users behind one proxy), at once.
    assert throttle.admit("alice", "1.1.1.1") == 0
    throttle.succeeded("alice", "1.1.1.1")
    assert throttle.admit("bob", "6.6.6.6") == 0
    throttle.succeeded("bob", "6.6.6.6")
    now[0] += 2.0
    throttle.admit("alice", "6.6.6.6")
    throttle.succeeded("alice", "6.6.6.6")
    assert throttle.wait_s("alice", "6.6.6.6") == 0  # a success starts the pair again


def test_many_addresses_guessing_one_account_wait_but_a_fresh_or_known_address_does_not():
    now = [1000.0]
    throttle = Throttle(clock=lambda: now[0])
    throttle.admit("bob", "9.9.9.9")
    throttle.succeeded("bob", "9.9.9.9")  # bob's own address
    guessers = [f"10.0.{i // 250}.{i % 250}" for i in range(40)]
    for address in guessers:  # one guess each: no pair waits, but the account has failed 40 times
        assert throttle.admit("bob", address) == 0
    assert throttle.wait_s("bob", guessers[0]) == MAX_DELAY_S  # a failed address waits for the account's delay
    assert throttle.wait_s("bob", "10.9.9.9") == 0  # a fresh one is checked (one guess an address)
    throttle.admit("bob", "9.9.9.9")  # bob mistypes once from his own address: it is still his
    assert throttle.wait_s("bob", "9.9.9.9") == 0
    assert throttle.wait_s("alice", guessers[0]) == 0  # the account's delay is its own
    now[0] += FORGET_S + 1
    throttle.admit("carol", "1.2.3.4")  # any admission forgets what is over an hour old
    assert throttle.wait_s("bob", guessers[0]) == 0 and len(throttle.pairs) == 1


def test_the_client_address_is_the_connections_unless_a_trusted_proxy_forwards_it():
    headers = [(b"x-forwarded-for", b"6.6.6.6, 10.1.1.1"), (b"forwarded", b'for="[2001:db8::1]:80";proto=https')]
    scope = {"client": ("127.0.0.1", 5000), "headers": headers}
    assert client_address(scope) == "127.0.0.1"  # nobody trusted: the header is the client's own words
    assert client_address(scope, trusted_networks("127.0.0.1")) == "10.1.1.1"  # X-Forwarded-For only, by default
    assert client_address(scope, trusted_networks("127.0.0.0/8, 10.0.0.0/8")) == "6.6.6.6"
    assert client_address(scope, trusted_networks("127.0.0.1"), forwarded_header("Forwarded")) == "2001:db8::1"
    assert client_address({"client": ("5.5.5.5", 1), "headers": headers}, trusted_networks("127.0.0.1")) == "5.5.5.5"
    with pytest.raises(ValueError, match="FINETUNE_TRUSTED_PROXIES lists 'proxy.local', which is neither"):
        trusted_networks("10.0.0.1,proxy.local")


def test_the_upload_ledger_counts_a_users_bytes_within_its_window():
    now = [0.0]
    ledger = UploadLedger(window_s=100, clock=lambda: now[0])
    assert ledger.admit("alice", 600, 1000) and not ledger.admit("alice", 600, 1000)
    assert ledger.admit("bob", 600, 1000)
    now[0] = 101
    assert ledger.admit("alice", 600, 1000)


def _login(url: str, fields: list[tuple[str, str]], source: str = "127.0.0.1",
           headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST the login form from the loopback address `source` (127.0.0.0/8: a client of its own address)."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30, source_address=(source, 0))
    connection.request("POST", "/login", urllib.parse.urlencode(fields),
                       {"Content-Type": "application/x-www-form-urlencoded", **(headers or {})})
    answer = connection.getresponse()
    out = answer.status, answer.read().decode()
    connection.close()
    return out


@pytest.mark.slow
def test_the_three_sign_in_attacks_of_issue_28_are_refused_or_bounded(tmp_path):
    with served_app(tmp_path, FINETUNE_USERS="alice:a-secret,bob:b-secret") as (url, _):
        # 1. Two usernames in one form (Gradio checks the last) and a new X-Forwarded-For each time.
        start = time.perf_counter()
        answers = [_login(url, [("username", f"decoy{i}"), ("username", "alice"), ("password", f"guess{i}")],
                          headers={"X-Forwarded-For": f"203.0.113.{i}"}) for i in range(20)]
        assert {a for a, _ in answers} == {400} and "one username and one password" in answers[0][1]
        answers = [_login(url, [("username", "alice"), ("password", f"guess{i}")],
                          headers={"X-Forwarded-For": f"203.0.113.{i}"})[0] for i in range(20)]
        seconds = time.perf_counter() - start
        assert answers[:FREE_FAILURES] == [400] * FREE_FAILURES and set(answers[FREE_FAILURES:]) == {429}
        status, text = _login(url, [("username", "alice"), ("password", "a-secret")])
        assert status == 429 and "try again in" in text  # from the guessing address the right one waits too
        print(f"attack 1: 40 guesses answered in {seconds:.2f} s, {FREE_FAILURES} of them checked")
        # 2. Four wrong passwords for bob from another address, each with a new header: bob gets in at once.
        for i in range(4):
            _login(url, [("username", "bob"), ("password", f"guess{i}")], source="127.0.0.2",
                   headers={"X-Forwarded-For": f"198.51.100.{i}"})
        start = time.perf_counter()
        assert _login(url, [("username", "bob"), ("password", "b-secret")], source="127.0.0.3")[0] == 200
        print(f"attack 2: bob signed in after 4 failures elsewhere in {time.perf_counter() - start:.2f} s")
        # 3. Seven failures under made-up names from the address everyone shares: alice from it gets in.
        for i in range(7):
            _login(url, [("username", f"nobody{i}"), ("password", "x")], source="127.0.0.4")
        assert _login(url, [("username", "alice"), ("password", "a-secret")], source="127.0.0.4")[0] == 200


@pytest.mark.slow
def test_forwarded_addresses_count_only_from_a_trusted_proxy(tmp_path):
    with served_app(tmp_path, FINETUNE_USERS="alice:a-secret", FINETUNE_TRUSTED_PROXIES="127.0.0.5") as (url, _):
        via_proxy = {"source": "127.0.0.5"}
        for i in range(FREE_FAILURES + 1):  # one client behind the proxy guesses
            _login(url, [("username", "alice"), ("password", f"g{i}")], headers={"X-Forwarded-For": "6.6.6.6"},
                   **via_proxy)
        assert _login(url, [("username", "alice"), ("password", "a-secret")],
                      headers={"X-Forwarded-For": "6.6.6.6"}, **via_proxy)[0] == 429
        # alice behind the same proxy is another client; a client not behind it cannot pretend to be her.
        assert _login(url, [("username", "alice"), ("password", "a-secret")],
                      headers={"X-Forwarded-For": "7.7.7.7"}, **via_proxy)[0] == 200
        for i in range(FREE_FAILURES + 1):
            _login(url, [("username", "alice"), ("password", f"g{i}")], source="127.0.0.6",
                   headers={"X-Forwarded-For": f"8.8.8.{i}"})
        assert _login(url, [("username", "alice"), ("password", "a-secret")], source="127.0.0.6")[0] == 429


@pytest.mark.slow
def test_a_space_takes_uploads_only_from_signed_in_users_and_up_to_the_quota(tmp_path):
    secret = "oauth-secret"
    env = {"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
           "FINETUNE_ALLOWED_USERS": "alice", "OAUTH_CLIENT_ID": "x", "OAUTH_CLIENT_SECRET": secret,
           "OAUTH_SCOPES": "openid profile", "OPENID_PROVIDER_URL": "https://huggingface.co",
           "FINETUNE_UPLOAD_QUOTA": "10kb", "HF_HUB_OFFLINE": "1"}
    with served_app(tmp_path, **env) as (url, runs):
        body, headers = _multipart("train.csv", b"text,label\n" + b"a,b\n" * 1000)  # 4 KB
        status, text = _post(url + "gradio_api/upload", body, headers)
        assert status == 401 and "Sign in with Hugging Face to upload." in text
        stranger = {**headers, "Cookie": _session_cookie(secret, "mallory")}
        status, text = _post(url + "gradio_api/upload", body, stranger)
        assert status == 401 and "@mallory is not allowed to upload on this Space" in text
        assert not any(p.is_file() for p in (tmp_path / "gradio").rglob("train.csv"))
        alice = {**headers, "Cookie": _session_cookie(secret, "alice")}
        assert [_post(url + "gradio_api/upload", body, alice)[0] for _ in range(3)] == [200, 200, 429]


class _Recorder(http.server.BaseHTTPRequestHandler):
    """A web server on 127.0.0.1 that notes every path asked of it (the URL a visitor hands Gradio as a file)."""

    fetched: list[str] = []

    def do_GET(self) -> None:  # noqa: N802 (the name http.server calls)
        self.fetched.append(self.path)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"text,label\nstolen,1\n")

    do_HEAD = do_GET

    def log_message(self, *args) -> None:
        pass


def _join(url: str, fn_index: int, data: list, cookie: str | None = None) -> tuple[int, str]:
    body = json.dumps({"data": data, "fn_index": fn_index, "session_hash": "s3cr3t", "event_data": None,
                       "trigger_id": None}).encode()
    headers = {"Content-Type": "application/json", **({"Cookie": cookie} if cookie else {})}
    return _post(url + "gradio_api/queue/join", body, headers)


@pytest.mark.slow
def test_a_file_input_takes_only_the_callers_own_uploads_never_a_url_or_a_server_path(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    secret = "oauth-secret"
    env = {"SPACE_ID": "owner/finetune", "SYSTEM": "spaces", "SPACE_AUTHOR_NAME": "owner",
           "FINETUNE_ALLOWED_USERS": "alice,bob", "OAUTH_CLIENT_ID": "x", "OAUTH_CLIENT_SECRET": secret,
           "OAUTH_SCOPES": "openid profile", "OPENID_PROVIDER_URL": "https://huggingface.co", "HF_HUB_OFFLINE": "1"}
    try:
        with served_app(tmp_path, **env) as (url, _):
            config = json.loads(urllib.request.urlopen(url + "config", timeout=30).read())
            upload_id = next(c["id"] for c in config["components"] if c.get("props", {}).get("elem_id") ==
                             "upload-dataset")
            dependency = next(d for d in config["dependencies"] if [upload_id, "upload"] in d["targets"])
            inputs = len(dependency["inputs"])

            def file(path: str) -> dict:
                return {"path": path, "orig_name": "x.csv", "meta": {"_type": "gradio.FileData"}}

            link = f"http://127.0.0.1:{server.server_address[1]}/data.csv"
            alice, bob = (_session_cookie(secret, name) for name in ("alice", "bob"))
            for who in (None, alice):  # the anonymous visitor (asked to sign in), and a user allowed to train
                for path in (link, "/etc/hostname", str(tmp_path / "runs" / "current.json")):
                    start = time.perf_counter()
                    status, text = _join(url, dependency["id"], [file(path), *[None] * (inputs - 1)], who)
                    said = NOT_YOUR_FILE if who else "Sign in with Hugging Face to train."
                    assert status == (403 if who else 401) and said in text and time.perf_counter() - start < 2
            assert _Recorder.fetched == []
            # alice's own upload passes the door (and goes on to her handler); bob may not name it.
            body, headers = _multipart("train.csv", b"text,label\n" + b"a,b\n" * 10)
            status, text = _post(url + "gradio_api/upload", body, {**headers, "Cookie": alice})
            assert status == 200
            path = json.loads(text)[0]
            assert _join(url, dependency["id"], [file(path), *[None] * (inputs - 1)], alice)[0] == 200
            status, text = _join(url, dependency["id"], [file(path), *[None] * (inputs - 1)], bob)
            assert status == 403 and NOT_YOUR_FILE in text
    finally:
        server.shutdown()


def test_the_server_finds_the_bundled_preset_from_any_folder(tmp_path, monkeypatch):
    """Run from elsewhere (an editable install), `python -m app` still opens on the sample data beside the package:
    the path is counted from the server's own file, which moved into app/door/."""
    from conftest import ROOT

    from app.door.server import PRESET, _preset

    monkeypatch.chdir(tmp_path)
    assert _preset(None) == (ROOT / PRESET, ROOT)
