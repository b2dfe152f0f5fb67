"""The HTTP routes Gradio leaves open on a shared server (issue #18, items 5 and 6), through real requests to a
served app: on a Space its upload route takes files only from a signed-in user who may train, and only up to the
upload quota; the login form of a password server slows down a run of wrong passwords, per account and address."""

from __future__ import annotations

import base64
import hashlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from conftest import served_app

from app.guard import FREE_FAILURES, Throttle, UploadLedger


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


def test_the_throttle_doubles_the_wait_after_a_few_failures_and_forgets_on_success():
    now = [1000.0]
    throttle = Throttle(clock=lambda: now[0])
    keys = ["account:alice", "address:1.2.3.4"]
    for _ in range(FREE_FAILURES):
        assert throttle.wait_s(keys) == 0
        throttle.failed(keys)
    assert throttle.wait_s(keys) == 1.0
    throttle.failed(keys)
    assert throttle.wait_s(keys) == 2.0 and throttle.wait_s(["account:bob", "address:1.2.3.4"]) == 2.0
    assert throttle.wait_s(["account:bob", "address:5.6.7.8"]) == 0
    now[0] += 2.0
    assert throttle.wait_s(keys) == 0
    throttle.succeeded(keys)
    throttle.failed(keys)
    assert throttle.wait_s(keys) == 0  # counting starts again


def test_the_upload_ledger_counts_a_users_bytes_within_its_window():
    now = [0.0]
    ledger = UploadLedger(window_s=100, clock=lambda: now[0])
    assert ledger.admit("alice", 600, 1000) and not ledger.admit("alice", 600, 1000)
    assert ledger.admit("bob", 600, 1000)
    now[0] = 101
    assert ledger.admit("alice", 600, 1000)


@pytest.mark.slow
def test_wrong_passwords_are_slowed_per_account_and_address(tmp_path):
    with served_app(tmp_path, FINETUNE_USERS="alice:a-secret,bob:b-secret") as (url, _):
        def login(name: str, password: str) -> tuple[int, str]:
            return _post(url + "login", urllib.parse.urlencode({"username": name, "password": password}).encode(),
                         {"Content-Type": "application/x-www-form-urlencoded"})

        answers = [login("alice", f"guess-{i}")[0] for i in range(FREE_FAILURES + 3)]
        assert answers[:FREE_FAILURES] == [400] * FREE_FAILURES and set(answers[FREE_FAILURES:]) == {429}
        status, text = login("alice", "a-secret")  # even the right password waits: it is not checked
        assert status == 429 and "Too many failed sign-ins for this account or address: try again in" in text
        time.sleep(1.2)
        assert login("alice", "a-secret")[0] == 200


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
