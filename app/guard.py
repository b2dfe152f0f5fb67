"""The door of the app's HTTP routes that Gradio does not guard the way a shared server needs: its upload route (on a
Space anyone could post files to it, signed in or not) and its login form (which answers wrong passwords at once,
as fast as they come).

An ASGI middleware (`Guard`), put inside Gradio's own (its session middleware has run, so a Space's signed-in user
is known). Uploads: on a Space only users who may train may upload at all; on any shared server each user may post
at most the upload quota within the time Gradio's copies are kept (`cleanup.GRADIO_KEEP_S`). Sign-in: after
`FREE_FAILURES` failed sign-ins of one account, or from one address, the next is refused for a delay that doubles
with each further failure (up to `MAX_DELAY_S`), without checking the password; a success clears the account's and
the address's count.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from app.access import Access
from app.cleanup import GRADIO_KEEP_S

FREE_FAILURES = 3  # failed sign-ins answered without delay (a typo or two)
MAX_DELAY_S = 300.0
MAX_LOGIN_BODY = 16 * 1024  # a login form is a name and a password

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Throttle:
    """Failed sign-ins per key (an account, an address) and when the last one was; thread-safe."""

    clock: Callable[[], float] = time.monotonic
    failures: dict[str, tuple[int, float]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @staticmethod
    def delay(count: int) -> float:
        """Seconds a key must wait after `count` failures: none for the first `FREE_FAILURES`, then 1, 2, 4, …"""
        return 0.0 if count < FREE_FAILURES else min(2.0 ** (count - FREE_FAILURES), MAX_DELAY_S)

    def wait_s(self, keys: list[str]) -> float:
        """How long until the next sign-in of `keys` may be checked (0 when it may now)."""
        now = self.clock()
        with self.lock:
            return max([0.0, *(last + self.delay(n) - now for n, last in (self.failures.get(k, (0, 0.0))
                                                                            for k in keys))])

    def failed(self, keys: list[str]) -> None:
        """Count a failed sign-in of each of `keys`."""
        now = self.clock()
        with self.lock:
            for k in keys:
                self.failures[k] = (self.failures.get(k, (0, 0.0))[0] + 1, now)

    def succeeded(self, keys: list[str]) -> None:
        """Forget the failures of `keys`."""
        with self.lock:
            for k in keys:
                self.failures.pop(k, None)


@dataclass
class UploadLedger:
    """Bytes each user posted to the upload route within the last `window_s` seconds."""

    window_s: float = GRADIO_KEEP_S
    clock: Callable[[], float] = time.time
    posted: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, user: str, size: int, quota: int) -> bool:
        """Whether `user` may post `size` more bytes under `quota`; if so they are counted."""
        now = self.clock()
        with self.lock:
            recent = [(t, n) for t, n in self.posted.get(user, []) if now - t < self.window_s]
            if sum(n for _, n in recent) + size > quota:
                self.posted[user] = recent
                return False
            self.posted[user] = [*recent, (now, size)]
            return True


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    """ASGI middleware: sign-in and a quota for Gradio's upload route, a throttle for its login form."""

    def __init__(self, app: Callable[..., Awaitable[None]], access: Access, upload_quota: int | None = None,
                 throttle: Throttle | None = None, ledger: UploadLedger | None = None):
        self.app, self.access, self.upload_quota = app, access, upload_quota
        self.throttle = throttle or Throttle()
        self.ledger = ledger or UploadLedger()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") == "POST" and self.access.shared:
            path = scope.get("path", "").rstrip("/")
            if path.endswith("/upload"):
                return await self._upload(scope, receive, send)
            if path.endswith("/login") and self.access.mode == "password":
                return await self._login(scope, receive, send)
        await self.app(scope, receive, send)

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = self.access.identify(SimpleNamespace(scope=scope, username=_password_user(scope)))
        if self.access.mode == "space" and not self.access.may_run(user):
            # Refused before a byte of the file is read: on a Space, signing in is what lets anyone upload.
            return await _answer(send, 401, self.access.refusal(user).replace("to train", "to upload"))
        if self.upload_quota is not None:
            headers = dict(scope.get("headers") or [])
            try:
                size = int(headers.get(b"content-length", b""))
            except ValueError:
                return await _answer(send, 411, "An upload must say its size (Content-Length).")
            if not self.ledger.admit(user or "", size, self.upload_quota):
                return await _answer(send, 429, "You have uploaded as much as this server keeps for one user "
                                                "today: try again later, or use a file you uploaded before.")
        await self.app(scope, receive, send)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            chunks.append(message)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > MAX_LOGIN_BODY:
                return await _answer(send, 413, "A sign-in is a name and a password.")
        form = urllib.parse.parse_qs(b"".join(m.get("body", b"") for m in chunks).decode("utf-8", "replace"))
        name = (form.get("username") or [""])[0].strip()
        address = (scope.get("client") or ("?",))[0]
        keys = [f"account:{name}", f"address:{address}"]
        if (wait := self.throttle.wait_s(keys)) > 0:
            return await _answer(send, 429, f"Too many failed sign-ins for this account or address: try again in "
                                            f"{wait:.0f} s.")
        replay = iter(chunks)

        async def replayed() -> dict[str, Any]:
            return next(replay, None) or await receive()

        status: list[int] = []

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, replayed, watched)
        if status and status[0] == 200:
            self.throttle.succeeded(keys)
        elif status and status[0] in (400, 401):
            self.throttle.failed(keys)


def _password_user(scope: Scope) -> str | None:
    """The account behind a password-mode request: Gradio's login cookie names a token it keeps in its app."""
    app = scope.get("app")
    tokens = getattr(app, "tokens", None) or {}
    for key, value in dict(scope.get("headers") or []).items():
        if key == b"cookie":
            for part in value.decode("latin-1").split(";"):
                name, _, token = part.strip().partition("=")
                if name.startswith("access-token") and token in tokens:
                    return tokens[token]
    return None
