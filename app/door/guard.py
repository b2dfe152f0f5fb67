"""The door of the app's HTTP routes, in front of Gradio's own handling: its upload route (on a Space anyone could
post files to it, signed in or not), its login form (which answers wrong passwords at once, as fast as they come)
and the routes that run events (whose file inputs Gradio would fetch from a URL, or copy from a server path, while
it prepares the inputs, before any handler of the app asks who is calling).

An ASGI middleware (`Guard`), put inside Gradio's own (its session middleware has run, so a Space's signed-in user
is known).

- Uploads: on a Space only users who may train may upload at all; on any shared server each user may post at most
  the upload quota within the time Gradio's copies are kept (`cleanup.GRADIO_KEEP_S`). The paths Gradio answers an
  upload with are remembered for the user who posted it (`UploadedFiles`).
- Events: a request that runs an event names files only by the paths of the caller's own uploads; a file object
  in any other shape (a URL, a `data:` URL Gradio would decode and write to its cache, no path, a file of the
  server's, someone else's upload) is refused before Gradio reads it. On a shared server a visitor who may not
  train sends no file data at all (nor a `data:` text): the answer is the sign-in refusal, before Gradio decodes,
  parses or writes anything of it. Gradio's recording route (a video it writes and converts) is closed: no input of
  the page records.
- Sign-in (`Throttle`), keyed on what a client cannot choose: the account Gradio checks (a form that names two is
  refused) and the address of the connection (a forwarded address only from `FINETUNE_TRUSTED_PROXIES`, read from
  the one header `FINETUNE_PROXY_HEADER` names). One
  account guessed from one address waits after a few failures; an account guessed from many addresses makes every
  address that has failed wait too, but never a fresh one or one the account signed in from: the owner gets in.
"""

from __future__ import annotations

import ipaddress
import json
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from app.door.access import Access
from app.door.cleanup import GRADIO_KEEP_S

FREE_FAILURES = 3  # failed sign-ins of one account from one address answered without delay (a typo or two)
ACCOUNT_FREE_FAILURES = 10  # failures of one account, from any addresses, before its own delay starts
MAX_DELAY_S = 300.0
FORGET_S = 3600.0  # failures older than this (past the longest delay) are forgotten
MAX_LOGIN_BODY = 16 * 1024  # a login form is a name and a password
MAX_EVENT_BODY = 1 << 20  # an event's request: its inputs are text (at most 256 K characters) and file references
UPLOADS_KEPT = 1000  # upload paths remembered per user (the newest)
TRUSTED_PROXIES_VAR = "FINETUNE_TRUSTED_PROXIES"
PROXY_HEADER_VAR = "FINETUNE_PROXY_HEADER"
PROXY_HEADERS = ("x-forwarded-for", "forwarded")  # the one a proxy appends to is read; the other is ignored
EVENT_ROUTES = ("/queue/join", "/run/", "/api/", "/call/", "/stream/")  # under Gradio's /gradio_api prefix
NOT_YOUR_FILE = ("A file input takes only a file you uploaded to this app (not a URL or a path on the server): "
                 "upload the file.")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def delay(count: int, free: int = FREE_FAILURES) -> float:
    """Seconds to wait after `count` failures: none for the first `free`, then 1, 2, 4, … up to `MAX_DELAY_S`."""
    return 0.0 if count < free else min(2.0 ** min(count - free, 32), MAX_DELAY_S)


@dataclass
class Throttle:
    """Failed sign-ins by account and address; thread-safe, and its memory bounded by `FORGET_S`.

    - per (account, address): `FREE_FAILURES` free, then 1, 2, 4, … s (one address guessing one account);
    - per account, from any address: after `ACCOUNT_FREE_FAILURES`, the account's delay applies to each address
      that has failed a sign-in (of any account) and has not signed in to this account before; a fresh address,
      such as the owner's, is checked at once.

    An attempt counts as a failure from the moment it is admitted (`admit`) until it succeeds, so that many
    guesses sent at once are counted as they arrive, not after their answers."""

    clock: Callable[[], float] = time.monotonic
    pairs: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    accounts: dict[str, tuple[int, float]] = field(default_factory=dict)
    failed_from: dict[str, float] = field(default_factory=dict)  # address → its latest failure, of any account
    known: dict[str, dict[str, float]] = field(default_factory=dict)  # account → address → latest sign-in
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_s(self, account: str, address: str) -> float:
        """How long until a sign-in of `account` from `address` may be checked (0: now)."""
        now = self.clock()
        with self.lock:
            return self._wait(account, address, now)

    def _wait(self, account: str, address: str, now: float) -> float:
        count, last = self.pairs.get((account, address), (0, 0.0))
        wait = last + delay(count) - now if count else 0.0
        total, last_any = self.accounts.get(account, (0, 0.0))
        if total and address in self.failed_from and address not in self.known.get(account, {}):
            wait = max(wait, last_any + delay(total, ACCOUNT_FREE_FAILURES) - now)
        return max(0.0, wait)

    def admit(self, account: str, address: str) -> float:
        """0 when a sign-in of `account` from `address` may be checked now, and it is counted as failed (until
        `succeeded`); otherwise the seconds to wait, and nothing is counted."""
        now = self.clock()
        with self.lock:
            self._forget(now)
            if (wait := self._wait(account, address, now)) > 0:
                return wait
            pair = self.pairs.get((account, address), (0, 0.0))
            self.pairs[(account, address)] = (pair[0] + 1, now)
            total = self.accounts.get(account, (0, 0.0))
            self.accounts[account] = (total[0] + 1, now)
            self.failed_from[address] = now
            return 0.0

    def succeeded(self, account: str, address: str) -> None:
        """The sign-in admitted last was right: it is no failure, the pair starts again, and the address is one
        this account signs in from."""
        with self.lock:
            self.pairs.pop((account, address), None)
            count, last = self.accounts.get(account, (0, 0.0))
            if count <= 1:
                self.accounts.pop(account, None)
            else:
                self.accounts[account] = (count - 1, last)
            self.known.setdefault(account, {})[address] = self.clock()

    def _forget(self, now: float) -> None:
        for table in (self.pairs, self.accounts):
            for key in [k for k, (_, last) in table.items() if now - last > FORGET_S]:
                del table[key]
        for key in [k for k, last in self.failed_from.items() if now - last > FORGET_S]:
            del self.failed_from[key]
        for account, addresses in list(self.known.items()):
            for key in [k for k, last in addresses.items() if now - last > 30 * 24 * 3600]:
                del addresses[key]
            if not addresses:
                del self.known[account]


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


@dataclass
class UploadedFiles:
    """The paths Gradio answered each user's uploads with (the newest `UPLOADS_KEPT`): the only files an event's
    file input may name."""

    paths: dict[str, dict[str, None]] = field(default_factory=dict)  # user → paths, oldest first
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, user: str, paths: Iterable[str]) -> None:
        """Remember `paths` as `user`'s uploads."""
        with self.lock:
            mine = self.paths.setdefault(user, {})
            for path in paths:
                mine.pop(path, None)
                mine[path] = None
            while len(mine) > UPLOADS_KEPT:
                mine.pop(next(iter(mine)))

    def owner_of(self, path: str) -> str | None:
        """Whose upload `path` is (None: nobody's)."""
        with self.lock:
            return next((user for user, paths in self.paths.items() if path in paths), None)

    def owns(self, user: str, path: str) -> bool:
        """Whether `path` is one of `user`'s uploads."""
        with self.lock:
            return path in self.paths.get(user, {})


def trusted_networks(text: str | None) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """The proxies named by `FINETUNE_TRUSTED_PROXIES` (addresses or CIDR networks, comma-separated); raises
    `ValueError` with a sentence for one that is neither."""
    networks = []
    for item in (text or "").split(","):
        if item.strip():
            try:
                networks.append(ipaddress.ip_network(item.strip(), strict=False))
            except ValueError:
                raise ValueError(f"{TRUSTED_PROXIES_VAR} lists {item.strip()!r}, which is neither an address nor a "
                                 "network (such as 10.0.0.0/8): list the addresses of your reverse proxies.") from None
    return tuple(networks)


def _is_in(host: str, networks: tuple[Any, ...]) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in n for n in networks)


def forwarded_header(text: str | None) -> bytes:
    """The one header `FINETUNE_PROXY_HEADER` names for the proxies' forwarded addresses (`X-Forwarded-For`, the
    default, or `Forwarded`), lower-case; raises `ValueError` with a sentence for any other."""
    name = (text or "").strip().lower() or "x-forwarded-for"
    if name not in PROXY_HEADERS:
        raise ValueError(f"{PROXY_HEADER_VAR} is {text.strip()!r}: name the header your reverse proxy adds the "
                         "client's address to, X-Forwarded-For or Forwarded.")
    return name.encode()


def _forwarded_hosts(headers: list[tuple[bytes, bytes]], header: bytes = b"x-forwarded-for") -> list[str]:
    """The addresses of the one forwarding `header` (`x-forwarded-for`, or `forwarded`'s `for=`), its lines joined
    in order: each proxy appends what it saw, so the right-most entries are the nearest proxies' words."""
    hosts: list[str] = []
    for name, value in headers:
        if name != header:
            continue
        text = value.decode("latin-1")
        if header == b"x-forwarded-for":
            hosts += [h.strip() for h in text.split(",")]
        else:
            for element in text.split(","):
                for pair in element.split(";"):
                    key, _, val = pair.strip().partition("=")
                    if key.lower() == "for":
                        hosts.append(val.strip().strip('"'))
    return [_host_only(h) for h in hosts if h]


def _host_only(value: str) -> str:
    """`1.2.3.4:80` → `1.2.3.4`, `[::1]:80` → `::1`; anything else as it is."""
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def client_address(scope: Scope, trusted: tuple[Any, ...] = (), header: bytes = b"x-forwarded-for") -> str:
    """The address a request comes from: its connection's, or, when that is one of the `trusted` proxies, the
    address the nearest trusted proxy saw: the right-most entry of the one forwarding `header` that is not itself
    a trusted proxy. (What a client sends in the other header, or left of that entry, never chooses it.)"""
    address = (scope.get("client") or ("?",))[0] or "?"
    if not _is_in(address, trusted):
        return address
    for host in reversed(_forwarded_hosts(scope.get("headers") or [], header)):
        if not _is_in(host, trusted):
            return host
    return address


async def _answer(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def _read_body(receive: Receive, limit: int) -> tuple[list[dict[str, Any]], bytes | None]:
    """The request's body messages, and its bytes (None when it is longer than `limit`)."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        chunks.append(message)
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
        if size > limit:
            return chunks, None
    return chunks, b"".join(m.get("body", b"") for m in chunks)


def _replay(chunks: list[dict[str, Any]], receive: Receive) -> Receive:
    pending = iter(chunks)

    async def replayed() -> dict[str, Any]:
        return next(pending, None) or await receive()

    return replayed


def _is_file_data(item: dict[str, Any]) -> bool:
    """Whether Gradio would read a mapping as a file: one with a `path` or a `url` (an image's may come as a `data:`
    URL alone, which Gradio decodes), or marked as file data."""
    meta = item.get("meta")
    return "path" in item or "url" in item or (isinstance(meta, dict) and meta.get("_type") == "gradio.FileData")


def file_data(value: Any) -> Iterator[Any]:
    """Every file a request's JSON sends, in any shape: each mapping Gradio would read as a file (`_is_file_data`),
    and each `data:` text (a file's bytes written inline), walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if _is_file_data(item):
                yield item
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item[:5].lower() == "data:":
            yield item


def _inline(item: dict[str, Any]) -> bool:
    """Whether a file object carries its bytes as a `data:` URL (Gradio decodes it and writes it to its cache)."""
    return isinstance(item.get("url"), str) and item["url"][:5].lower() == "data:"


class Guard:
    """ASGI middleware: sign-in and a quota for Gradio's upload route, the caller's own uploads only for the event
    routes' file inputs, a throttle for its login form."""

    def __init__(self, app: Callable[..., Awaitable[None]], access: Access, upload_quota: int | None = None,
                 throttle: Throttle | None = None, ledger: UploadLedger | None = None,
                 uploads: UploadedFiles | None = None, trusted: str | None = None, proxy_header: str | None = None):
        self.app, self.access, self.upload_quota = app, access, upload_quota
        self.throttle = throttle or Throttle()
        self.ledger = ledger or UploadLedger()
        self.uploads = uploads or UploadedFiles()
        self.trusted = trusted_networks(trusted)
        self.proxy_header = forwarded_header(proxy_header)

    def _user(self, scope: Scope) -> str | None:
        return self.access.identify(SimpleNamespace(scope=scope, username=_password_user(scope)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        served = re.split(r"/gradio_api/file[=/]", scope.get("path", ""), maxsplit=1)
        if scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and len(served) == 2:
            # Gradio serves its upload folder to anyone signed in: an upload is its uploader's alone. (The path is
            # decoded by the server, as Gradio reads it.)
            if self.uploads.owner_of(served[1]) not in (None, self._user(scope) or ""):
                return await _answer(send, 404, "File not found.")
        if scope["type"] == "http" and scope.get("method") == "POST":
            path = scope.get("path", "").rstrip("/")
            if path.endswith("/upload"):
                return await self._upload(scope, receive, send)
            if path.endswith("/process_recording"):  # no input of the page records: nothing for Gradio to write
                return await _answer(send, 404, "Not found.")
            if path.endswith("/login") and self.access.mode == "password":
                return await self._login(scope, receive, send)
            if "/gradio_api/" in path + "/" and any(r in path + "/" for r in EVENT_ROUTES):
                return await self._event(scope, receive, send)
        await self.app(scope, receive, send)

    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        user = self._user(scope)
        if self.access.shared and self.access.mode == "space" and not self.access.may_run(user):
            # Refused before a byte of the file is read: on a Space, signing in is what lets anyone upload.
            return await _answer(send, 401, self.access.refusal(user).replace("to train", "to upload"))
        if self.access.shared and self.upload_quota is not None:
            headers = dict(scope.get("headers") or [])
            try:
                size = int(headers.get(b"content-length", b""))
            except ValueError:
                return await _answer(send, 411, "An upload must say its size (Content-Length).")
            if not self.ledger.admit(user or "", size, self.upload_quota):
                return await _answer(send, 429, "You have uploaded as much as this server keeps for one user "
                                                "today: try again later, or use a file you uploaded before.")
        status: list[int] = []
        body: list[bytes] = []

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            elif message["type"] == "http.response.body" and sum(map(len, body)) < MAX_EVENT_BODY:
                body.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, watched)
        if status and status[0] == 200:
            try:
                answer = json.loads(b"".join(body) or b"[]")
            except ValueError:
                answer = []
            self.uploads.add(user or "", [p for p in answer if isinstance(p, str)] if isinstance(answer, list)
                             else [])

    async def _event(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks, raw = await _read_body(receive, MAX_EVENT_BODY)
        if raw is None:
            return await _answer(send, 413, f"A request to the app is at most {MAX_EVENT_BODY >> 20} MB (a config "
                                            "is a few hundred bytes; a dataset goes in as an upload).")
        try:
            payload = json.loads(raw) if raw.strip() else None
        except (ValueError, RecursionError):
            payload = None  # Gradio answers a body it cannot read itself
        user = self._user(scope)
        files = list(file_data(payload))
        if files and self.access.shared and not self.access.may_run(user):
            # Gradio prepares an event's inputs (decodes an image, writes it to its cache) before the app's door
            # asks who is calling: a visitor's file data goes no further than here.
            return await _answer(send, 401, self.access.refusal(user))
        if any(isinstance(f, dict) and (_inline(f) or not isinstance(f.get("path"), str)
                                        or not self.uploads.owns(user or "", f["path"])) for f in files):
            return await _answer(send, 403, NOT_YOUR_FILE)
        await self.app(scope, _replay(chunks, receive), send)

    async def _login(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks, raw = await _read_body(receive, MAX_LOGIN_BODY)
        if raw is None:
            return await _answer(send, 413, "A sign-in is a name and a password.")
        form = await _form(scope, raw)
        if form is None or len(form.get("username", [])) != 1 or len(form.get("password", [])) != 1:
            # Gradio would check one of several names (the last) while a throttle might count another.
            return await _answer(send, 400, "A sign-in has one username and one password.")
        # Names that are no account share one key per address: guessing them opens nothing, and made-up names
        # cannot fill the throttle's memory.
        name = form["username"][0].strip()
        name = name if name in {n for n, _ in self.access.accounts} else ""
        address = client_address(scope, self.trusted, self.proxy_header)
        if (wait := self.throttle.admit(name, address)) > 0:
            return await _answer(send, 429, f"Too many failed sign-ins for this account from this address: try "
                                            f"again in {wait:.0f} s.")
        status: list[int] = []

        async def watched(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        await self.app(scope, _replay(chunks, receive), watched)
        if status and status[0] == 200:
            self.throttle.succeeded(name, address)


async def _form(scope: Scope, raw: bytes) -> dict[str, list[str]] | None:
    """The text fields of a form body, each with all its values, parsed as Gradio's login route parses it
    (Starlette's form parser: URL-encoded or multipart); None for a body that is not a form."""
    from starlette.requests import Request

    sent = False

    async def body() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    try:
        form = await Request(dict(scope), body).form()
    except Exception:  # noqa: BLE001 (python-multipart's parse errors are of several kinds): not a form
        return None
    fields: dict[str, list[str]] = {}
    for key, value in form.multi_items():
        fields.setdefault(key, []).append(value if isinstance(value, str) else "")
    await form.close()
    return fields


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
