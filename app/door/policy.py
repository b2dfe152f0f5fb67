"""The request policy: the one place every page event and every API route asks who is asking and whether they may.

Every page event is wired through `RequestPolicy.on`, which refuses inputs too large for anyone and (unless the
event is "public") a caller who may not train, before the handler runs; every handler, and the scripting API's
routes, then ask `who(request)` and `is_mine(status, user)`. What a user may read and where their runs go is the
access policy's (`app.door.access`); the HTTP routes Gradio serves itself are guarded by `app.door.guard`.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gradio as gr

from app.door import limits
from app.door.access import Access, AccessError
from app.door.limits import parse_config_yaml
from app.results import Targets, components, updates
from finetune.config.schema import ConfigError
from finetune.remote.jobfile import is_remote_run

if TYPE_CHECKING:
    from app.local.training import JobStatus

# The components whose own preprocessing refuses a value a caller chose (one not among their choices), before the door.
CHOICES = (gr.Dropdown, gr.Radio, gr.CheckboxGroup)

# How an event passes the door: "signed_in" (it reads a file or a visitor's input: refused, with Gradio's toast, to
# whoever may not train), "quiet" (it runs by itself, on page load: refused silently), "public" (progress, Stop, the
# form of one's own run: the handler checks ownership itself).
GATES = ("signed_in", "quiet", "public")
ADAPTER_CONFIG, BASE_KEY = "adapter_config.json", "base_model_name_or_path"  # what loading an adapter reads


class RequestPolicy:
    """Who asks, and what they may see and read, for one app (its access policy, runs folder and sample files)."""

    def __init__(self, access: Access | None = None, runs_dir: Path = Path("runs"), samples: tuple[Path, ...] = ()):
        self.access = access or Access()
        self.runs_dir = runs_dir
        self.samples = tuple(Path(p).resolve() for p in samples)  # the app's own sample data, readable by all

    def who(self, request: Any) -> tuple[str | None, str]:
        """The user behind `request` and why they may not train ("" when they may)."""
        user = self.access.identify(request)
        return user, self.access.refusal(user)

    def admit(self, request: Any, args: tuple[Any, ...], gate: str = "signed_in") -> str:
        """The door of every page event: "" when the event may run, else why not. Inputs over
        `limits.MAX_INPUT_CHARS` are refused for everyone; with `gate` "signed_in" (every event that reads a file
        or a visitor's input) so is a caller who may not train. "public" events check ownership themselves."""
        if over := limits.input_size_problem(args):
            return over
        return "" if gate == "public" else self.who(request)[1]

    def readable(self, user: str | None) -> tuple[Path, ...]:
        """The folders and files `user` may read on a shared server: their uploads and the app's sample data."""
        return (self.access.uploads(self.runs_dir, user).resolve(), *self.samples)

    def own_runs(self, user: str | None) -> Path | None:
        """The folder of `user`'s own runs, whose finished models a shared server lets them name (a reward model of
        theirs); None for no one known, or where the runs folder is everyone's."""
        if user is None or not self.access.shared:
            return None
        return self.access.home(self.runs_dir, user).resolve()

    def runs_home(self, user: str | None, refusal: str = "") -> Path | None:
        """Where the caller's runs are listed from: the runs folder locally, their own folder when shared; None
        for a caller who may not train on a shared server (no one's runs are shown to them)."""
        if self.access.shared and (refusal or user is None):
            return None
        return self.access.home(self.runs_dir, user)

    def run_refusal(self, run_dir: Path, user: str | None) -> str:
        """Why `user` may not load (Try it, `/predict`, export, Resume) their run `run_dir`'s model; "" when they
        may. On a shared server the files of a run on Hugging Face Jobs are checked as what the user types is: the
        fetch copied whatever the user's bucket held (a local run's files are the training child's, from a checked
        config). Its config.yaml passes the check a typed config does (`Access.check_config`), and each adapter's
        base model `Access.check_base`: another user's run, a server file or remote code is never loaded."""
        if not self.access.shared or not is_remote_run(run_dir):
            return ""
        config = run_dir / "config.yaml"
        try:
            if too_big := limits.config_size_problem(config, is_file=True):
                raise ConfigError([too_big])
            self.access.check_config(parse_config_yaml(config.read_text(encoding="utf-8")), self.readable(user),
                                     self.own_runs(user))
        except ConfigError as e:
            return f"The run's config.yaml cannot be used: {limits.short_problems(e.problems)[0]}"
        except AccessError as e:
            return f"The run's config.yaml is refused: {e}"
        except (OSError, ValueError) as e:  # unreadable, or not UTF-8
            return f"The run's config.yaml cannot be read ({type(e).__name__}): train the run again."
        try:
            for adapter in _adapter_configs(run_dir):
                if adapter.stat().st_size > limits.MAX_CONFIG_BYTES:
                    raise ValueError("too big")
                saved = json.loads(adapter.read_text(encoding="utf-8"))
                self.access.check_base(saved.get(BASE_KEY) if isinstance(saved, dict) else None, self.own_runs(user))
        except AccessError as e:
            return str(e)
        except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON, too big for one
            return f"The run's adapter_config.json is not one a run writes ({e}): train the run again."
        return ""

    def is_mine(self, status: JobStatus, user: str | None) -> bool:
        """Whether `status` is a run `user` may see and steer (every run, locally)."""
        return status.state != "idle" and self.access.owns(user, status.owner)

    @staticmethod
    def in_progress(status: JobStatus) -> str:
        """All that someone else's run shows of itself."""
        step, total = status.progress or (0, None)
        return f"A run is in progress (step {step}/{total})." if total else "A run is in progress (starting)."

    def on(self, event: Callable[..., Any], handler: Callable[..., Any], inputs: Any, targets: Targets, *,
           gate: str = "signed_in", **kwargs: Any) -> Any:
        """Wire `handler` to `event` through the door (`admit`), its named result going to the components of
        `targets` (or to `outputs=` when `targets` is empty); the handler gets the request too (who asks).

        A refused event raises Gradio's error (its toast), or for a "quiet" one leaves everything as it is; either
        way nothing is written to the server's log (`refused`). tests/test_app_attacks.py walks the Blocks' events
        to check that none goes around it."""
        # Checked when the page is built, not when a button is pressed: a handler without `request` would turn its
        # outputs into Gradio's red "Error" badge only in the browser.
        if "request" not in inspect.signature(handler).parameters:
            raise TypeError(f"{getattr(handler, '__qualname__', handler)} is wired to the page but takes no request=")

        # Gradio passes the request to a leading parameter typed gr.Request. Nothing to update is Gradio's skip: an
        # empty dict would read as one value for the first output.
        def guarded(request: gr.Request, *args: Any) -> Any:
            if refusal := self.admit(request, args, gate):
                if gate == "quiet":
                    return gr.skip()
                raise refused(refusal)
            result = handler(*args, request=request)
            if not targets:
                return result
            return updates(result, targets) or gr.skip()

        guarded.gate, guarded.handler = gate, handler  # what the event walk of the tests reads
        quiet_choices()
        quiet_images()
        return event(guarded, inputs, components(targets) if targets else kwargs.pop("outputs"), **kwargs)


def _adapter_configs(run_dir: Path) -> list[Path]:
    """The adapter configs of a run's saved model: model/ or adapter/, and one folder per task of a multi-task run."""
    found = []
    for folder in (run_dir / "model", run_dir / "adapter"):
        found += [p for p in (folder / ADAPTER_CONFIG, *folder.glob(f"*/{ADAPTER_CONFIG}")) if p.is_file()]
    return found


def refused(message: str) -> gr.Error:
    """Gradio's error for a refused input: its toast, and no traceback in the server's log. A refusal is an answer,
    not a fault of the server; Gradio prints the traceback of every other error, about 2 KB, from its event loop,
    so that callers who send refused inputs fast would fill the log (100 of them wrote 188 KB), and a log that is
    read slowly (a full pipe) would stall every request of the server, anyone's sign-in included."""
    return gr.Error(message, print_exception=False)


def quiet_choices() -> None:
    """Make Gradio's own check of a choice (a Dropdown's, a Radio's or a CheckboxGroup's value that is not one of its
    choices, refused while Gradio prepares an event's inputs, before the door) a quiet refusal (`refused`).

    On the classes, once for the process, as `app.door.server` turns off Gradio's reloader: a session's copy of a
    component, which Gradio makes anew from its class when a handler updates it, checks its choices the same way.
    (A subclass would not do: Gradio writes a .pyi file beside the module of every component class defined.)"""
    for cls in CHOICES:
        if getattr(cls.preprocess, "quiet", False):
            continue
        loud = cls.preprocess

        def preprocess(self: Any, payload: Any, loud: Callable[..., Any] = loud) -> Any:
            try:
                return loud(self, payload)
            except gr.Error as e:
                if not e.print_exception:
                    raise
                raise refused(e.message) from None

        preprocess.quiet = True
        cls.preprocess = preprocess


def quiet_images() -> None:
    """Make Gradio's own opening of an image input (gr.Image reads the file's header while it prepares the event's
    inputs, before any handler) answer an image past Pillow's safety limit with a sentence (`refused`), not its bare
    "Error" and a traceback in the log. On the class, once for the process, as `quiet_choices`."""
    if getattr(gr.Image.preprocess, "quiet", False):
        return
    loud = gr.Image.preprocess

    def preprocess(self: Any, payload: Any) -> Any:
        from PIL import Image

        try:
            return loud(self, payload)
        except Image.DecompressionBombError:
            raise refused(limits.image_too_big()) from None

    preprocess.quiet = True
    gr.Image.preprocess = preprocess
