"""The Export tab's *Export for local inference* block and the `/export` endpoints: `finetune export` of the
caller's own finished run as a child process (through the job client: its own session, the environment a training
child gets), its progress, the behaviour check's result, the files to download, and a push of the export.

On a shared server a visitor cannot point it anywhere or exhaust the machine: the run is the caller's current run,
or a run folder that must resolve inside their own runs folder (`access.resolve_output_dir`) and have finished; the
export always goes to RUN/export/ (inside the runs folder); one export runs at a time on the server and none while
a run trains; it needs the free disk a run needs (`min_free_gb`), and is killed (its whole process group) past the
server's run-time limit, else `app.local.export.EXPORT_LIMIT_S`.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gradio as gr

from app.door import cleanup
from app.door.access import AccessError, resolve_output_dir
from app.downloads import zip_model
from app.export.publish import PushHandlers, PushOutcome
from app.follow import IDLE_POLL_S, POLL_S
from app.local.training import JobBusy
from app.picks import PickRefused, picker_update, resolve_pick
from app.state import AppState
from finetune.config.schema import ConfigError, read_yaml
from finetune.registry import ENTRIES
from finetune.run.rundir import is_finished
from finetune.use import llamacpp
from finetune.use.export import EXPORT_DIR, FORMATS, MERGED_DIR, QUANTS, RECORD, describe_check


class Refused(ValueError):
    """An export the caller may not start: one sentence."""


class InferenceExport:
    """The export handlers of one app (the block's buttons and the API's `/export` and `/export_status`)."""

    def __init__(self, state: AppState, pushes: PushHandlers):
        self.state, self.pushes = state, pushes
        self._fetching: threading.Thread | None = None  # llama.cpp's converter, fetched ahead of a first GGUF export
        self._seen: set[Path] = set()  # finished runs already looked at for it

    def fetch_ahead(self, run_dir: Path) -> None:
        """Once a finished run can become a GGUF, fetch llama.cpp's converter in the background (once per app, and
        only when it is not kept yet): the first export from the page waited for it (219 s, where the CLI with a
        kept converter took 24 s; measured here: 164 s fresh, 34 s kept, the page the CLI's time when kept)."""
        if self._fetching is not None or run_dir in self._seen:
            return
        self._seen.add(run_dir)
        try:
            task = str(read_yaml(run_dir / "config.yaml").get("task") or "")
        except ConfigError:
            return  # the export itself says what is wrong with the run
        if task in ENTRIES and "gguf" in ENTRIES[task].exports:
            self._fetching = llamacpp.fetch_ahead()

    def run_of(self, user: str | None, run: str | None = None) -> Path:
        """The finished run `user` may export: their current run, or `run` inside their runs folder, once its files
        pass the policy (`RequestPolicy.run_refusal`)."""
        run_dir = self._finished_run(user, run)
        if refused := self.state.policy.run_refusal(run_dir, user):
            raise Refused(refused)
        return run_dir

    def _finished_run(self, user: str | None, run: str | None) -> Path:
        state = self.state
        if not run or not str(run).strip():
            status = state.jobs.status()
            if not state.policy.is_mine(status, user) or status.run_dir is None:
                raise Refused("Nothing to export yet: train a run to the end first.")
            if status.state != "done":
                raise Refused("The run has not finished: export it once it is done.")
            return status.run_dir
        home = state.access.home(state.runs_dir, user)
        try:
            path = resolve_output_dir(str(run), home)
        except AccessError as e:
            raise Refused(str(e).replace("output_dir", "The run")) from None
        from finetune.use.checkpoint import run_of_checkpoint  # here: the app starts without transformers

        if path is not None and run_of_checkpoint(path) is not None:  # a stopped run's checkpoint (`app.picks`)
            try:
                return resolve_pick(str(run), home, state.jobs.status()).target
            except PickRefused as e:
                raise Refused(str(e)) from None
        if path is None or not (path / "config.yaml").is_file():
            raise Refused(f"There is no run {str(run)!r} in your runs folder: give the name of one of your runs.")
        status = state.jobs.status()
        if status.active and status.run_dir is not None and status.run_dir.resolve() == path.resolve():
            raise Refused("The run has not finished: export it once it is done.")
        if not is_finished(path):
            raise Refused(f"The run {str(run)!r} has not finished (it stopped before the end): resume it, then "
                          "export it.")
        return path

    def start(self, fmt: str, quant: str | None, ollama: bool, run: str | None = None, *,
              request: Any = None) -> dict[str, Any]:
        """Start `finetune export` of the caller's finished run: {started, run_dir, command, message}."""
        user, refusal = self.state.policy.who(request)
        try:
            if refusal:
                raise Refused(refusal)
            fmt = fmt or "merged"
            if fmt not in FORMATS:
                raise Refused(f"The format must be one of {', '.join(FORMATS)}.")
            quant = (quant or "f16") if fmt == "gguf" else None
            if quant is not None and quant not in QUANTS:
                raise Refused(f"The quantization must be one of {', '.join(QUANTS)}.")
            run_dir = self.run_of(user, run)
            if other := self.state.jobs.export_refusal():
                raise Refused(other)
            if problem := cleanup.disk_problem(self.state.runs_dir, self.state.limits.min_free_gb):
                raise Refused(problem.replace("to start a run", "to export"))
            command = [sys.executable, "-m", "finetune", "export", str(run_dir), "--format", fmt,
                       *(["--quant", quant] if quant else []), *(["--ollama"] if ollama and fmt == "gguf" else [])]
            try:
                self.state.jobs.start_export(command, run_dir, user)
            except JobBusy as e:
                raise Refused(str(e)) from None
        except Refused as e:
            return {"started": False, "run_dir": None, "command": "", "message": str(e)}
        return {"started": True, "run_dir": str(run_dir), "command": f"finetune {' '.join(command[3:])}",
                "message": f"Exporting ({fmt}{' ' + quant if quant else ''})…"}

    def status(self, *, request: Any = None) -> dict[str, Any]:
        """The caller's export: {state (idle, running, done, failed), run_dir, stage, message, check, files}."""
        user, _ = self.state.policy.who(request)
        child = self.state.jobs.exports.child
        if child is not None and child.proc.poll() is not None and self._newer_run(child.run_dir, child.started,
                                                                                 user):
            child = None  # an ended export, then a newer run: the block speaks of that run, not of the export
        if child is None or not self.state.access.owns(user, child.owner):
            try:
                run_dir = self.run_of(user)
            except Refused as e:  # no finished run yet: the block says so rather than nothing
                return _shown("idle", message=str(e))
            record = _record(run_dir)
            self.fetch_ahead(run_dir)
            return _finished(run_dir, record) if record else _shown("idle", run_dir)
        rc = child.proc.poll()
        lines = child.log.read_text(encoding="utf-8", errors="replace").splitlines() if child.log.is_file() else []
        if rc is None:
            stage = next((line.removeprefix("export: ") for line in reversed(lines) if line.startswith("export: ")),
                         "starting")
            return _shown("running", child.run_dir, stage=stage,
                          message=f"Exporting: {stage} ({time.time() - child.started:.0f} s)")
        if rc == 0 and (record := _record(child.run_dir)):
            return _finished(child.run_dir, record)
        if child.timed_out:
            return _shown("failed", child.run_dir, message="The export took longer than this server allows and was "
                          "stopped.")
        error = next((line.removeprefix("error: ") for line in reversed(lines) if line.startswith("error: ")), None)
        error = error and in_page_words(error)
        return _shown("failed", child.run_dir, message=error or "The export failed: " + (
            " ".join(lines[-3:])[-400:] if lines else f"exit code {rc}."))

    def _newer_run(self, run_dir: Path, since: float, user: str | None) -> bool:
        """Whether `user` started another run than `run_dir` after `since` (its config written then)."""
        status = self.state.jobs.status()
        if status.run_dir is None or status.config_path is None or not self.state.policy.is_mine(status, user):
            return False
        try:
            return status.run_dir.resolve() != run_dir.resolve() and status.config_path.stat().st_mtime > since
        except OSError:
            return False

    def files(self, shown: dict[str, Any]) -> list[str]:
        """The export's files as the download box may hand them out (the merged folder as one zip)."""
        out = []
        for name in shown.get("files") or []:
            path = Path(shown["run_dir"]) / EXPORT_DIR / name
            if name == MERGED_DIR:
                path = zip_model(path, path.parent / "merged.zip")
            out.append(self.state.downloads.handout(path))
        return out

    # --- the page
    def poll(self, seen: Any, run: str | None = None, *, request: Any = None) -> dict[str, Any]:
        """Refresh the Export block: progress, the check, the files and which buttons can act (Export model: on the
        run or checkpoint picked, `run`, or else the current run, once no export is in progress)."""
        shown = self.status(request=request)
        ready = shown["state"] in ("idle", "done", "failed") and (shown["run_dir"] is not None or bool(run))
        interval = POLL_S if shown["state"] == "running" else IDLE_POLL_S  # as the run's poll (`app.follow`)
        signature = [shown["state"], shown["run_dir"], shown["message"], ready, interval]
        if seen == signature:
            return {}
        timer = {"timer": gr.Timer(interval)} if not isinstance(seen, list) or seen[4:] != [interval] else {}
        failed = "⚠️ " if shown["state"] == "failed" else ""  # the export's own sentence, marked as a failure
        return {**timer, "signature": signature, "status": failed + shown["message"],
                "files": gr.update(value=self.files(shown) or None, visible=shown["state"] == "done"),
                "button": gr.update(interactive=ready), "push": gr.update(interactive=shown["state"] == "done")}

    def export(self, fmt: str, quant: str, ollama: bool, run: str | None = None, *, request: Any = None
               ) -> dict[str, Any]:
        """The Export model button: the run or checkpoint picked (none: the current run)."""
        return {"status": self.start(fmt, quant, bool(ollama), run or None, request=request)["message"]}

    def picked(self, run: str | None, *, request: Any = None) -> dict[str, Any]:
        """A run or checkpoint picked: Export model can act on it (an export in progress aside)."""
        child = self.state.jobs.exports.child
        return {"button": gr.update(interactive=bool(run) and (child is None or child.proc.poll() is not None))}

    def choices(self, value: str | None = None, *, request: Any = None) -> Any:
        """The picker's runs and checkpoints (`app.picks`), keeping `value` when it is still one of them."""
        user, refusal = self.state.policy.who(request)
        return picker_update(self.state.policy.runs_home(user, refusal), self.state.jobs.status(), value)

    def push(self, repo: str, private: bool, run: str | None = None, *, request: Any = None) -> dict[str, Any]:
        """The Push the export button: the picked (or current) run's export to `repo`, as Push to the Hub pushes
        the model."""
        return {"message": self.push_run(repo, private, run, request=request).message}

    def push_run(self, repo: str, private: bool, run: str | None = None, *, request: Any = None) -> PushOutcome:
        """Push the export of the caller's finished run or of `run` (see `app.export.publish.push_finished_run`)."""
        return self.pushes.push_run(repo, private, run, request=request, export=True)


def in_page_words(text: str) -> str:
    """`finetune export`'s sentence in the Export block's words: its `--format merged` is the Format choice."""
    return re.sub(r"--format (merged|gguf)\b", r"**Format** \1", text)


def _record(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / EXPORT_DIR / RECORD
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
    except ValueError:
        return None


def _shown(state: str, run_dir: Path | None = None, *, stage: str = "", message: str = "",
           check: dict[str, Any] | None = None, files: list[str] | None = None) -> dict[str, Any]:
    return {"state": state, "run_dir": str(run_dir) if run_dir else None, "stage": stage, "message": message,
            "check": check, "files": files or []}


def _finished(run_dir: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A finished export as shown: what was written, how long it took, and the behaviour check in words."""
    fmt, quant, check = record.get("format"), record.get("quant"), record.get("check")
    names = [n for n in record.get("files") or {} if n != MERGED_DIR and (run_dir / EXPORT_DIR / n).is_file()]
    files = names if fmt == "gguf" else [MERGED_DIR]
    what = f"GGUF {quant}" if fmt == "gguf" else "merged weights (a transformers folder)"
    lines = [f"✅ Exported {what} in {record.get('seconds', 0):.0f} s to `{run_dir.name}/{EXPORT_DIR}/`."]
    if check:
        lines += [("⚠️ " if line.startswith("warning: ") else "") + line for line in describe_check(check).splitlines()]
    if "Modelfile" in names:
        lines.append(f"Make it an Ollama model: `ollama create {run_dir.name} -f Modelfile` beside the GGUF.")
    return _shown("done", run_dir, message="\n\n".join(lines), check=check, files=files)


def place_export_block(on: Callable[..., Any], exporter: InferenceExport, pick: Any, load: Any) -> None:
    """The Export block, inside the Export tab being built, wired to its handlers (and its poll to the page's
    `load`); it exports the run or checkpoint `pick` (the tab's picker) names."""
    with gr.Column(variant="panel", elem_id="export-block"):
        gr.Markdown("## Export for local inference\n\nMerged weights (a plain transformers folder), or a GGUF for "
                    "llama.cpp and Ollama with the chat template and end-of-turn token the run trained with, "
                    "checked against transformers.")
        with gr.Row():
            fmt = gr.Radio(list(FORMATS), value="merged", label="Format", elem_id="export-format")
            quant = gr.Radio(list(QUANTS), value="q4_k_m", label="GGUF quantization", elem_id="export-quant")
            ollama = gr.Checkbox(label="Ollama Modelfile (GGUF)", value=True, elem_id="export-ollama")
        button = gr.Button("Export model", interactive=False, elem_id="export-model")
        status = gr.Markdown(elem_id="export-status")
        files = gr.File(label="Exported files", file_count="multiple", interactive=False, visible=False,
                        elem_id="export-files")
        with gr.Row():
            repo = gr.Textbox(label="Hub repository for the export", placeholder="your-name/my-model-gguf", scale=3,
                              max_length=200, elem_id="export-repo")
            private_repo = gr.Checkbox(label="Private repository", value=True, scale=1)
            push = gr.Button("Push the export", scale=1, interactive=False, elem_id="export-push")
        push_msg = gr.Markdown(elem_id="export-push-message")
        seen = gr.State(None)
        timer = gr.Timer(IDLE_POLL_S)
    private = {"api_visibility": "private"}
    out = {"signature": seen, "timer": timer, "status": status, "files": files, "button": button, "push": push}
    # Off Gradio's queue, as the run's poll; at once on a page load and after Export model (an export ticks each
    # second). It takes the pick: a pick made before the page's first tick is not undone by it.
    exporting = on(button.click, exporter.export, [fmt, quant, ollama, pick], {"status": status},
                   concurrency_id="export", **private)
    for event in (timer.tick, load, exporting.then):
        on(event, exporter.poll, [seen, pick], out, gate="public", queue=False, show_progress="hidden", **private)
    on(push.click, exporter.push, [repo, private_repo, pick], {"message": push_msg}, concurrency_id="push",
       **private)
    on(pick.input, exporter.picked, pick, {"button": button}, show_progress="hidden", **private)
