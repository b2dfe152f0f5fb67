"""Serving the fine-tuning GUI: the arguments of `python -m app` / `finetune ui`, and the server they start. The page
it serves is handed to it (`app.serve` hands it `app.page.build`): the door imports no tab."""

from __future__ import annotations

import argparse
import inspect
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.door import cleanup, limits
from app.door.access import Access, AccessError

DEFAULT_PORT = 7860
SHARED_HELP = (
    "On a Hugging Face Space (SPACE_ID and SYSTEM=spaces set), a non-loopback --host, or whenever accounts are set, "
    "the app is a shared server: each user's runs go to RUNS/<user>/ and only they see and steer them; "
    "trust_remote_code, local model folders and local data files other than the user's own uploads are refused; the "
    "training process gets no secrets (such as HF_TOKEN) from the app's environment. Accounts: "
    "FINETUNE_USERS='alice:secret,bob:other' (name:password pairs) and/or FINETUNE_PASSWORD=secret (an account named "
    "admin), asked for by Gradio's login form. On a Space, visitors sign in with Hugging Face: its owner and "
    "FINETUNE_ALLOWED_USERS=alice,bob may train. Behind a reverse proxy, list its addresses (or networks) in "
    "FINETUNE_TRUSTED_PROXIES=10.0.0.1,172.16.0.0/12: only from them are forwarded client addresses believed (the "
    "sign-in throttle counts by address), from the one header FINETUNE_PROXY_HEADER names (X-Forwarded-For, the "
    "default, or Forwarded).")
PRESET = Path("assets") / "demo.yaml"
QUEUE_IDLE_S = 0.05  # how often Gradio's queue looks for work while none is queued (`quiet_queue`)


def build_parser() -> argparse.ArgumentParser:
    """The arguments of `python -m app` / `finetune ui`."""
    parser = argparse.ArgumentParser(prog="finetune ui", description="Serve the fine-tuning GUI (a thin client of "
                                     "the `finetune` CLI: every run is a `finetune train` child process).")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1",
                   help="Address to listen on (default: $GRADIO_SERVER_NAME or 127.0.0.1). Any other than loopback "
                   "(0.0.0.0 exposes the app to your network) needs accounts ($FINETUNE_USERS or $FINETUNE_PASSWORD) "
                   "or --no-auth.")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT") or DEFAULT_PORT),
                   help=f"Port (default: $GRADIO_SERVER_PORT or {DEFAULT_PORT}).")
    parser.add_argument("--runs-dir", default=os.environ.get("FINETUNE_RUNS_DIR") or "runs",
                   help="Where runs, uploads and their configs go (default: $FINETUNE_RUNS_DIR or runs). On a "
                   "Hugging Face Space, a folder a restart would lose gives way to /data/runs when a storage bucket "
                   "(or another persistent volume) is mounted at /data.")
    parser.add_argument("--preset", default=None, help="Config YAML the form opens with (default: assets/demo.yaml, "
                   "the bundled model on the sample data, when it exists).")
    parser.add_argument("--open", action="store_true", help="Open the app in a browser tab.")
    shared = parser.add_argument_group("shared server", SHARED_HELP)
    shared.add_argument("--no-auth", action="store_true", help="Serve a non-loopback --host without accounts: "
                   "anyone who can reach it can train (as one shared user; see the limits below).")
    limits.add_arguments(parser)
    return parser


def _preset(arg: str | None) -> tuple[Path | None, Path]:
    """The preset config and the folder its relative data paths start from."""
    if arg:
        return Path(arg), Path.cwd()
    # From the repository (or the Docker image's /app) the sample data is in assets/; an editable install run from
    # elsewhere still finds it beside the package.
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):  # app/door/server.py → the repository
        if (root / PRESET).is_file():
            return root / PRESET, root
    return None, Path.cwd()


def _gradio_settings(runs_dir: Path) -> None:
    """Gradio's settings from the environment, where the user has not set them, read once the page is built."""
    # Gradio keeps uploads and served files here; it must be writable (the Docker image points it at $HOME).
    os.environ.setdefault("GRADIO_TEMP_DIR", str((runs_dir / ".gradio").resolve()))
    # Gradio's queue recomputes its event statistics (a pandas table of its last 10,000 events, for a monitoring
    # page this app does not offer) after every queued event: 3-9 ms each, many times a minute on a busy page. Once
    # per 1,000 events, over the last 1,000, instead (read when the page's queue is made, in `build`).
    os.environ.setdefault("GRADIO_ANALYTICS_CACHE_FREQUENCY", "1000")
    os.environ.setdefault("GRADIO_ANALYTICS_MAX_EVENTS", "1000")


def launch(args: argparse.Namespace, build: Callable[..., Any], terminated: threading.Event | None = None,
           **kwargs: Any) -> Any:
    """Build the app with `build` (`app.page.build`'s arguments) and serve it (kwargs go to `Blocks.launch`); returns
    the `App` once the server has stopped, or at once with `prevent_thread_lock=True`. A training run outlives the
    server: the next start re-attaches to it. SIGTERM closes the server like Ctrl-C and sets `terminated`."""
    access = Access.from_env(os.environ, args.host, args.no_auth)
    from app.door.guard import PROXY_HEADER_VAR, TRUSTED_PROXIES_VAR, forwarded_header, trusted_networks

    trusted = os.environ.get(TRUSTED_PROXIES_VAR, "")
    proxy_header = os.environ.get(PROXY_HEADER_VAR, "")
    try:
        trusted_networks(trusted)
        forwarded_header(proxy_header)
    except ValueError as e:
        raise AccessError(str(e)) from None
    from app.door import persist

    runs_dir = persist.runs_folder(Path(args.runs_dir), os.environ)
    if runs_dir != Path(args.runs_dir):
        print(f"Runs go to {runs_dir}, on the storage mounted at {persist.DATA_MOUNT}: {args.runs_dir} would be lost "
              "when the Space restarts.", file=sys.stderr)
    runs_dir.mkdir(parents=True, exist_ok=True)
    if access.shared and not access.hub_kernels:
        # The app's own loads (Try it, exports) too: transformers 5.25 kernelizes every load from the Hub by default.
        os.environ["USE_HUB_KERNELS"] = "NO"
    _gradio_settings(runs_dir)
    from app.device import detect

    preset, base = _preset(args.preset)
    if access.mode == "open":
        print(f"WARNING: no accounts on {args.host}: anyone who can reach this app can train on this machine.",
              file=sys.stderr)
    if access.mode == "password":
        kwargs.setdefault("auth", access.check_password)
        kwargs.setdefault("auth_message", "Sign in to train.")
    server_limits = limits.from_args(args)
    app = build(runs_dir, memory=detect(), preset=preset, preset_base=base, access=access,
                server_limits=server_limits)

    def tidy() -> None:
        cleanup.tidy(runs_dir, server_limits.keep_days, keep=app.jobs.status().run_dir,
                     gradio_dir=cleanup.gradio_temp_dir())

    tidy()
    cleanup.sweep_every(cleanup.SWEEP_EVERY_S, tidy)  # uploads nobody kept go within a day, not at the next start
    # Inside Gradio's own middleware: a Space's upload route needs a signed-in user, and the login form slows down.
    from starlette.middleware import Middleware

    from app.door.guard import Guard

    # uvicorn (which Gradio starts without saying) would take X-Forwarded-For from any client on 127.0.0.1 as the
    # client's address: the sign-in throttle's key would be whatever a client sends. The guard reads the forwarded
    # headers itself, and only from the proxies listed.
    os.environ["FORWARDED_ALLOW_IPS"] = ""
    guard = Middleware(Guard, access=access, upload_quota=limits.size_bytes(server_limits.upload_quota)
                       if access.shared else None, trusted=trusted, proxy_header=proxy_header)
    app_kwargs = kwargs.setdefault("app_kwargs", {})
    app_kwargs["middleware"] = [*app_kwargs.get("middleware", []), guard]

    def on_sigterm(signum: int, frame: Any) -> None:
        if terminated is not None:
            terminated.set()
        raise KeyboardInterrupt

    # As PID 1 of a container, Python ignores SIGTERM; make `docker stop` close the server like Ctrl-C does.
    signal.signal(signal.SIGTERM, on_sigterm)
    _no_spaces_reloader()
    # Gradio's run history (from Gradio 6.24) would keep every call's inputs (file references too) in the browser
    # and offer to copy them to a Hub bucket: nothing a shared training server needs. Older Gradios lack it.
    if "run_history" in inspect.signature(app.demo.launch).parameters:
        kwargs.setdefault("run_history", False)
    quiet_queue(app.demo.queue(default_concurrency_limit=1)).launch(
        server_name=args.host, server_port=args.port, max_file_size=args.max_file_size, css=app.css, js=app.js,
        footer_links=["gradio", "settings"], inbrowser=args.open, **kwargs)
    return app


def quiet_queue(demo: Any) -> Any:
    """Gradio's queue loop looks for work every millisecond while nothing is queued (`Queue.sleep_when_free`: 0.001
    on Linux, 0.05 on Windows), so a served app with no page open kept 5 % of a core busy (1.5 CPU-s in 30 s, here).
    Every 50 ms instead, as on Windows: a queued press may start up to 50 ms later. A Gradio without the setting is
    left as it is. Returns `demo`."""
    queue = getattr(demo, "_queue", None)
    if isinstance(getattr(queue, "sleep_when_free", None), float):
        queue.sleep_when_free = max(queue.sleep_when_free, QUEUE_IDLE_S)
    return demo


def _no_spaces_reloader() -> None:
    """Gradio starts its hot-reloader on every Space (no setting turns it off), and that needs the `spaces` package,
    which a Gradio-SDK Space has and this Docker image does not: each start logged "RuntimeError: `spaces` package
    is required to run hot-reloading in Spaces" from the watcher's thread. The app is never reloaded in place (a
    new image is a new container), so its watcher does nothing."""
    from gradio import http_server

    http_server.watchfn_spaces = lambda reloader: None


def serve(args: argparse.Namespace, build: Callable[..., Any]) -> int:
    """Serve the app `build` builds until Ctrl-C, then say whether a run goes on without the app; or until SIGTERM
    (`docker stop`: the container is going away), then stop the run with a checkpoint, waiting up to --stop-grace
    seconds for it. 2 when a public host has no accounts or a package is outside its supported range."""
    from finetune.config.versions import require
    from finetune.errors import PackageError

    terminated = threading.Event()
    try:
        require()  # `python -m app` too: a too-old gradio or transformers is one sentence, not a traceback
        jobs = launch(args, build, terminated).jobs
    except (AccessError, PackageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if terminated.is_set():
        if said := jobs.shutdown(limits.from_args(args).stop_grace_s):
            print(said, file=sys.stderr)
        return 0
    status = jobs.status()
    if status.active:
        print(f"The run in {status.run_dir} goes on in the background; `finetune ui` re-attaches to it (Stop ends it).",
              file=sys.stderr)
    return 0
