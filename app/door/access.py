"""Who may do what when the app is shared (a Space, a host beyond loopback, or configured accounts), and which files
the app may read and write for them. Pure: built from the environment and the host, tested without a browser.

Modes: `local` (loopback, no accounts: one user, everything as on the command line), `space` (Hugging Face OAuth:
the Space's owner and `FINETUNE_ALLOWED_USERS` may train), `password` (`FINETUNE_USERS` / `FINETUNE_PASSWORD`
accounts behind Gradio's login form), `open` (`--no-auth` on a public host: everyone is one anonymous user). All but
`local` are shared: no remote code, no local paths but the user's own uploads, a child without the app's secrets.

Pushing to the Hub uses the token of whoever runs the app (`HF_TOKEN`), in the app's process: locally that is the
one user; on a Space, its owner and the users in `FINETUNE_PUSH_USERS`; with accounts, only the accounts in
`FINETUNE_PUSH_USERS`; on an `open` server nobody. The token never reaches a page, an answer or a training child.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import DEFAULT_MODEL, Config, sources
from finetune.errors import summary
from finetune.kinds.rewards import parse_all

ANYONE = "anyone"  # the one user of an `open` server
USERS_VAR, PASSWORD_VAR, ALLOWED_VAR = "FINETUNE_USERS", "FINETUNE_PASSWORD", "FINETUNE_ALLOWED_USERS"
PUSHERS_VAR = "FINETUNE_PUSH_USERS"  # who, besides a Space's owner, may push with the server's Hugging Face token
PASSWORD_USER = "admin"  # the account FINETUNE_PASSWORD sets
# A shared server's runs never run kernel code fetched from the Hub at run time unless its owner sets this to 1.
HUB_KERNELS_VAR = "FINETUNE_HUB_KERNELS"
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED = {"uploads"}  # folder names under runs/ that are not a user's
MAX_OUTPUT_DIR_CHARS = 100  # a run folder's name typed in the app (a file system takes 255 bytes a name)
# What a training child needs from the app's environment; everything else (HF_TOKEN, cloud keys, OAuth secrets) stays
# in the app on a shared server.
CHILD_ENV = {"PATH", "HOME", "USER", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP", "PYTHONPATH",
             "PYTHONUNBUFFERED", "PYTHONHASHSEED", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "HF_HOME", "HF_HUB_CACHE",
             "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT",
             "TRANSFORMERS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR", "CUDA_VISIBLE_DEVICES",
             "CUDA_HOME", "NVIDIA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "TOKENIZERS_PARALLELISM", "WORLD_SIZE"}
NO_REMOTE_CODE = "trust_remote_code is disabled on a shared server."
NO_HUB_KERNELS = ("Hub kernels (code transformers fetches from the Hugging Face Hub at run time) are off on this "
                  f"shared server: set Kernels to auto or off (its owner can allow them with {HUB_KERNELS_VAR}=1).")
NO_PUSH_IN_RUN = ("push_to_hub cannot be set on a shared server (the training process gets no token): leave it empty "
                  "and press Push to the Hub when the run is done.")


class AccessError(ValueError):
    """Something the policy refuses; the message is one sentence a user (or the operator) can act on."""


def is_loopback(host: str) -> bool:
    """Whether `host` only listens on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _accounts(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for item in (env.get(USERS_VAR) or "").split(","):
        if item.strip():
            name, sep, password = item.strip().partition(":")
            if not sep or not password:
                raise AccessError(f"{USERS_VAR} must list name:password pairs separated by commas, not {name!r}.")
            pairs.append((name, password))
    if env.get(PASSWORD_VAR):
        pairs.append((PASSWORD_USER, env[PASSWORD_VAR]))
    bad = [name for name, _ in pairs if not USER_NAME.fullmatch(name) or name in RESERVED]
    if bad:
        raise AccessError(f"Account name {bad[0]!r} cannot be used: use letters, digits, '.', '_' or '-' "
                          "(and not 'uploads').")
    return tuple(pairs)


@dataclass(frozen=True)
class Access:
    """The policy of one app process."""

    mode: str = "local"  # local, space, password, open
    owner: str | None = None  # the Space's author
    allowed: frozenset[str] = frozenset()
    accounts: tuple[tuple[str, str], ...] = ()
    pushers: frozenset[str] = frozenset()  # FINETUNE_PUSH_USERS
    hub_kernels: bool = False  # FINETUNE_HUB_KERNELS=1: a shared server's runs may use the Hub's kernels

    @classmethod
    def from_env(cls, env: Mapping[str, str], host: str, no_auth: bool = False) -> Access:
        """The policy for serving on `host` with environment `env`; raises `AccessError` when a public host has no
        accounts and `--no-auth` was not given."""
        allowed, pushers = (frozenset(u.strip().lstrip("@") for u in (env.get(var) or "").split(",") if u.strip())
                            for var in (ALLOWED_VAR, PUSHERS_VAR))
        # What Gradio takes for a Space too: anywhere else a LoginButton would make it mock the sign-in.
        kernels = (env.get(HUB_KERNELS_VAR) or "").strip().lower() in {"1", "true", "yes"}
        if env.get("SPACE_ID") and env.get("SYSTEM") == "spaces":
            return cls("space", env.get("SPACE_AUTHOR_NAME") or None, allowed, pushers=pushers, hub_kernels=kernels)
        accounts = _accounts(env)
        if accounts:
            return cls("password", accounts=accounts, pushers=pushers, hub_kernels=kernels)
        if is_loopback(host):
            return cls()
        if no_auth:
            return cls("open", hub_kernels=kernels)
        raise AccessError(f"Listening on {host} lets anyone who can reach it train on this machine: set {USERS_VAR}="
                          f"name:password (or {PASSWORD_VAR}), or pass --no-auth to allow it anyway.")

    @property
    def shared(self) -> bool:
        """Whether several people may use the app: runs have owners and files are confined."""
        return self.mode != "local"

    def check_password(self, username: str, password: str) -> bool:
        """Gradio's `launch(auth=…)`: whether the account exists with this password (in constant time)."""
        return any(hmac.compare_digest(username.encode(), name.encode())
                   & hmac.compare_digest(password.encode(), secret.encode()) for name, secret in self.accounts)

    def identify(self, request: Any) -> str | None:
        """The user behind a Gradio request: None when anonymous (and always locally, where there is one user)."""
        if self.mode == "local":
            return None
        if self.mode == "open":
            return ANYONE
        if self.mode == "password":
            return getattr(request, "username", None) or None
        info = _session(request).get("oauth_info") or {}
        if info.get("expires_at") is not None and info["expires_at"] < time.time():
            return None
        return (info.get("userinfo") or {}).get("preferred_username") or None

    def oauth_token(self, request: Any) -> tuple[str, str] | None:
        """On a Space, the signed-in user's own Hugging Face access token and its scopes (as Gradio's OAuth keeps
        them in the session, what `gr.OAuthToken` is made from); None elsewhere, signed out, or expired."""
        if self.mode != "space" or self.identify(request) is None:
            return None
        info = _session(request).get("oauth_info") or {}
        token = info.get("access_token")
        return (str(token), str(info.get("scope") or "")) if token else None

    def may_run(self, user: str | None) -> bool:
        """Whether `user` may start, stop, resume, try and download runs (their own)."""
        if self.mode in ("local", "open"):
            return True
        if self.mode == "password":
            return user in {name for name, _ in self.accounts}
        return user is not None and (user == self.owner or user in self.allowed)

    def refusal(self, user: str | None) -> str:
        """Why `user` may not train ("" when they may)."""
        if self.may_run(user):
            return ""
        if self.mode == "space":
            if user is None:
                return "Sign in with Hugging Face to train."
            return (f"@{user} is not allowed to train on this Space (ask its owner to add you to "
                    f"{ALLOWED_VAR}).")
        return "Sign in to train."

    def may_push(self, user: str | None) -> bool:
        """Whether `user` may push a run's model with the token of whoever runs the app."""
        if self.mode == "local":
            return True
        if self.mode == "open" or not self.may_run(user):
            return False
        return user in self.pushers or (self.mode == "space" and user == self.owner)

    def push_refusal(self, user: str | None) -> str:
        """Why `user` may not push ("" when they may)."""
        if self.may_push(user):
            return ""
        if self.mode == "open":
            return ("Pushing is off on a server without accounts: download the model and push it with `finetune "
                    "push`.")
        who = "the Space's owner" if self.mode == "space" else "the server's owner"
        return (f"Pushing uses {who}'s Hugging Face token, and @{user} is not in {PUSHERS_VAR}: download the model "
                "and push it with your own token (`finetune push RUN_DIR REPO`).")

    def owns(self, user: str | None, owner: str | None) -> bool:
        """Whether `user` may see and steer a run started by `owner`."""
        return not self.shared or (self.may_run(user) and user == owner)

    # --- files
    def home(self, runs_dir: Path, user: str | None) -> Path:
        """Where `user`'s runs go: the runs folder itself locally, `runs/<user>/` when shared."""
        return runs_dir / user if self.shared and user else runs_dir

    def uploads(self, runs_dir: Path, user: str | None) -> Path:
        """Where `user`'s uploads are kept: `runs/uploads/`, or `runs/uploads/<user>/` when shared."""
        return runs_dir / "uploads" / user if self.shared and user else runs_dir / "uploads"

    def child_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment of a training or planning child: all of `env` locally, only what it needs when shared."""
        if not self.shared:
            return dict(env)
        child = {k: v for k, v in env.items() if k in CHILD_ENV or k.startswith("LC_")}
        if not self.hub_kernels:  # transformers reads it in every load, ours and the libraries' own (kernels=auto)
            child["USE_HUB_KERNELS"] = "NO"
        return child

    def check_source(self, source: str | None, what: str, readable: tuple[Path, ...], kind: str | None = None
                     ) -> None:
        """Refuse, when shared, a source of `kind` (model, data, file: `finetune.config.schema.SOURCE_KINDS`) named
        `what` that the user may not read: a local model folder; a local file or folder outside `readable` (the
        user's uploads, the sample data), or a `datasets` builder name (`csv`, `text`, …, which reads files from the
        server's folders); any file but those for a `file` (a chat template). `kind` defaults to `what`'s own."""
        # Here, not at the top: finetune.data.load imports torch, and `finetune --help` builds the `ui` parser from
        # app.door.server, which imports this module (3 s of torch for a help text).
        from finetune.data.load import builder_names, is_local

        kind = kind or ("model" if what == "model" else "file" if what == "chat_template" else "data")
        if not self.shared or not source:
            return
        if kind == "model":
            if source != DEFAULT_MODEL and _model_is_local(source):
                raise AccessError("Local model folders cannot be used on a shared server: give a Hugging Face hub "
                                  "id.")
            return
        if kind == "data" and source.lower() in builder_names():
            raise AccessError(f"`{what}` {summary(source, 200)} is the name of a `datasets` file builder, which reads "
                              "files from the server's folders: upload your file, or give a Hugging Face hub "
                              "dataset id.")
        if kind == "data" and not is_local(source):
            return
        try:
            path = Path(source).expanduser().resolve()
        except (OSError, ValueError, RuntimeError):
            path = None
        if path is not None and any(path == r or path.is_relative_to(r) for r in readable):
            return
        advice = "upload the file, or give a Hugging Face hub dataset id" if kind == "data" else "upload the file"
        raise AccessError(f"`{what}` {summary(source, 200)} is not one of your uploads: {advice}.")

    def check_config(self, config: Config, readable: tuple[Path, ...], own_runs: Path | None = None) -> None:
        """Refuse what a shared server must not run: remote code, local models, and any file the config names
        (found by the schema's `source` marks, each task of `tasks` included) that is not the user's. A reward model
        may be one of the user's own runs (a folder inside `own_runs`, `RequestPolicy.own_runs`)."""
        if not self.shared:
            return
        if config.trust_remote_code:
            raise AccessError(NO_REMOTE_CODE)
        if config.kernels == "hub" and not self.hub_kernels:
            raise AccessError(NO_HUB_KERNELS)
        if config.push_to_hub:
            raise AccessError(NO_PUSH_IN_RUN)
        for what, kind, value in sources(config):
            if kind != "output":  # the run folder: `resolve_output_dir` confines it to the user's folder
                self.check_source(value, what, readable, kind)
        for reward in parse_all(config.rewards):  # the config checked them: every name parses
            if reward.runs_code:
                raise AccessError(f"Reward {summary(reward.argument, 120)} runs the file's Python code, which a "
                                  "shared server does not: use a built-in reward or a reward model.")
            if reward.kind == "reward_model" and not _inside(reward.argument, own_runs):
                self.check_source(reward.argument, "rewards", readable, "model")

    def check_base(self, base: Any, own_runs: Path | None = None) -> None:
        """Refuse, when shared, the base model a saved adapter names (`base_model_name_or_path`, which loading the
        adapter loads) unless the user could have trained on it: a Hub id, the bundled model, or a run of their own
        (inside `own_runs`). A run fetched from a Jobs bucket holds whatever the bucket held: never another user's
        run, or any other folder of the server."""
        if not self.shared:
            return
        if not isinstance(base, str) or not base.strip():
            raise AccessError("The run's adapter names no base model: train the run again.")
        if base == DEFAULT_MODEL or not _model_is_local(base) or _inside(base, own_runs) or _is_bundled(base):
            return
        raise AccessError(f"The run's adapter names {summary(base, 120)} as its base model, a folder of this server "
                          "that is not yours: an adapter loads on a Hub model, the bundled model or one of your own "
                          "runs (were the run's files changed in its bucket?).")


def _is_bundled(path: str) -> bool:
    """Whether `path` is the bundled default model's folder (what a run on it saves as its adapter's base)."""
    from finetune.config.modelpath import resolve_model_path
    from finetune.errors import ModelError

    try:
        return Path(path).resolve() == Path(resolve_model_path(DEFAULT_MODEL)).resolve()
    except (ModelError, OSError, ValueError, RuntimeError):
        return False


def _inside(source: str, folder: Path | None) -> bool:
    """Whether `source` names a path strictly inside `folder` (links and `..` resolved first)."""
    if folder is None:
        return False
    try:
        path = Path(source).expanduser().resolve()
    except (OSError, ValueError, RuntimeError):
        return False
    return path != folder and path.is_relative_to(folder)


def _model_is_local(name: str) -> bool:
    # The same test as `finetune.models.pretrained.resolve_model_path`.
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def _session(request: Any) -> Mapping[str, Any]:
    """The request's session (where Gradio's OAuth keeps the signed-in user), or {} without one."""
    underlying = getattr(request, "request", None) or request
    scope = getattr(underlying, "scope", None)
    if isinstance(scope, dict):  # a Starlette request: reading `.session` without the middleware would raise
        return scope.get("session") or {}
    return getattr(request, "session", None) or {}


def resolve_output_dir(typed: str | None, home: Path) -> Path | None:
    """The run folder an `output_dir` typed in the app names: a name inside `home`; None when none was typed.

    A path that already lies inside `home` (such as `runs/x` locally) is kept; an absolute path elsewhere or one
    with `..` is refused, so that the app never writes outside its runs folder."""
    if not typed or not typed.strip():
        return None
    if len(typed) > MAX_OUTPUT_DIR_CHARS or any(ord(c) < 32 for c in typed):
        raise AccessError(f"output_dir {summary(typed)} must be a name of at most {MAX_OUTPUT_DIR_CHARS} characters "
                          "without control characters: give a shorter name for the run.")
    try:
        path = Path(typed.strip()).expanduser()
    except RuntimeError:  # `~bob/x` of a user this machine does not know
        raise AccessError(f"output_dir {typed!r} names the home folder of another user, which is outside the app's "
                          "runs folder: give a name for the run (it goes in your runs folder).") from None
    if ".." in path.parts:
        raise AccessError(f"output_dir {typed!r} may not contain '..': give a name for the run (it goes in your "
                          "runs folder).")
    inside = home.resolve()
    resolved = path.resolve()
    if resolved.is_relative_to(inside) and resolved != inside:
        return home / resolved.relative_to(inside)
    if path.is_absolute():
        raise AccessError(f"output_dir {typed!r} is outside the app's runs folder: give a name for the run (it "
                          "goes in your runs folder).")
    return home / path


def new_run_name(shared: bool) -> str:
    """A run folder's name: the date and time, and when shared a random part, so that names cannot be guessed."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return f"{stamp}-{os.urandom(4).hex()}" if shared else stamp
