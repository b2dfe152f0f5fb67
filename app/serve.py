"""The top of the app: the door's server (`app.door.server`) serving the page (`app.page`). `python -m app` and
`finetune ui` start here, and no module of the app imports this one: the door below imports no tab."""

from __future__ import annotations

import argparse
import threading
from typing import Any

from app.door import server


def build_page(*args: Any, **kwargs: Any) -> Any:
    """`app.page.build`, imported as it is called: gradio comes in only once `server.serve` has checked the installed
    versions (a too-old one is one sentence, not an ImportError)."""
    from app.page import build

    return build(*args, **kwargs)


def launch(args: argparse.Namespace, terminated: threading.Event | None = None, **kwargs: Any) -> Any:
    """Build and serve the page (`app.door.server.launch`); returns the `App` once the server has stopped, or at once
    with `prevent_thread_lock=True`."""
    return server.launch(args, build_page, terminated, **kwargs)


def serve(args: argparse.Namespace) -> int:
    """Serve the page until Ctrl-C or SIGTERM (`app.door.server.serve`); 2 when it cannot be served."""
    return server.serve(args, build_page)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m app`."""
    return serve(server.build_parser().parse_args(argv))
