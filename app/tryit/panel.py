"""What Try it does: the finished run's model on the caller's text (or, an image classifier, on the uploaded image),
shown by its kind's view (`renderers`), or the next turn of a chat through the template the run trained with; and
which of them the panel offers for a run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from app.door import limits
from app.local import bounded
from app.local.training import JobStatus
from app.picks import Picked, PickRefused, final_metrics_of, picker_update, resolve_pick
from app.report import waiting_note
from app.results import Unanswered, keep
from app.state import AppState
from app.tryit import renderers
from app.tryit.tools import calls_box, offered, tools_box
from finetune import registry as kinds
from finetune.config.schema import ConfigError, read_yaml
from finetune.use.generation import Generation, model_defaults

# The run's chat template is a visitor's text: it renders in a forked child stopped after this long (or past
# `bounded.MEMORY_HEADROOM` more memory), and what it renders is at most this long (the model reads far less).
RENDER_TIMEOUT_S = 2.0
MAX_PROMPT_CHARS = 4 * limits.MAX_INPUTS_CHARS


def bounded_prompt(tokenizer: Any, turns: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                   ) -> tuple[str, list[int]]:
    """`finetune.rows.chat.prompt_of` in a bounded child (`app.local.bounded`): the chat's prompt (offered `tools`)
    and its stop tokens, or `DataError` with a sentence when the template loops, eats memory or writes too much."""
    from finetune.errors import DataError
    from finetune.rows.chat import prompt_of

    def render() -> tuple[str, list[int]]:
        text, stop = prompt_of(tokenizer, turns, tools)
        if len(text) > MAX_PROMPT_CHARS:
            raise DataError(f"The run's chat template turned this chat into {len(text):,} characters (at most "
                            f"{MAX_PROMPT_CHARS:,} are read): start a new chat, or fix the template.")
        return text, stop

    try:
        return bounded.bounded(render, RENDER_TIMEOUT_S, "Rendering the chat with the run's chat template")
    except bounded.Overrun as e:
        raise DataError(f"{e} A template that needs this much cannot chat: fix the run's chat_template.") from None


def has_chat_template(model_dir: Any) -> bool:
    """Whether a saved model folder has a chat template (its own file, or in its tokenizer config)."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


# When a kind's run is chatted with (its entry's `chat_when`), from the run's config and its saved model folder.
CHATS: dict[str, Callable[[dict[str, Any], Path], bool]] = {
    "messages": lambda options, model_dir: bool(options.get("messages_column")),  # as `finetune predict` decides
    "template": lambda options, model_dir: has_chat_template(model_dir),  # as `finetune.use.predict.chat` needs
}


def try_view(status: JobStatus | Picked) -> str | None:
    """What Try it offers for the finished run: "chat" when its kind chats with such a run (its entry's
    `chat_when`), else the view its entry names (`try_view`: probabilities, entities, value, score, text, image, …);
    None before a finished model."""
    if status.model_dir is None or status.run_dir is None:
        return None
    config = status.run_dir / "config.yaml"
    try:  # a run fetched from a bucket holds whatever the bucket held: Predict then says why (`run_refusal`)
        options = read_yaml(config) if config.is_file() and not limits.config_size_problem(config, is_file=True) \
            else {}
    except ConfigError:
        options = {}
    task = options.get("task", kinds.DEFAULT)
    entry = kinds.entry(task if task in kinds.names() else kinds.DEFAULT)
    chats = CHATS.get(entry.chat_when)
    return "chat" if chats is not None and chats(options, status.model_dir) else entry.try_view


def history_turns(history: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """The Chatbot's messages (Gradio 6 gives each content as a list of parts) as {role, content} turns."""
    turns = []
    for message in history or []:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        turns.append({"role": message.get("role", "user"), "content": str(content or "")})
    return turns


@dataclass(frozen=True, kw_only=True)
class TryPanel:
    """Try it, set when the run (or its state) changes: a chat box for a run trained to chat, an image box for an
    image classifier, a text box for the others, Predict only once a model is finished; a new run's model starts a
    new chat (and an empty image box)."""

    chat: Any = keep()
    label: Any = keep()
    generated: Any = keep()
    button: Any = keep()
    new_chat: Any = keep()
    text: Any = keep()
    message: Any = keep()
    entities: Any = keep()  # token classification: the words with their entities highlighted
    image: Any = keep()  # an image classifier's input, shown in place of the text box
    settings: Any = keep()  # the generation settings, shown for a model that generates text
    max_new_tokens: Any = keep()
    temperature: Any = keep()
    top_p: Any = keep()
    system_prompt: Any = keep()  # a chat's system turn
    base: Any = keep()  # Compare's answer, cleared with a new model
    tools: Any = keep()  # a chat run trained with tools: the Tools (JSON) box (`app.tryit.tools`)
    calls: Any = keep()  # the tool calls parsed from the last reply


def panel(status: JobStatus | Picked, *, new_model: bool) -> TryPanel:
    """Try it for `status`: the chat box (a run its kind chats with), the image box (an image classifier) or the text
    box, Predict enabled once the model is finished; a new model clears the last one's chat, image, prediction and
    message; without one, a sentence says why."""
    view = try_view(status)
    chat = view == "chat"
    pictured = view in IMAGE_REFUSALS
    ready = view is not None
    cleared = {"label": gr.update(value=None, visible=False), "generated": gr.update(value="", visible=False),
               "entities": gr.update(value=None, visible=False), "message": "",
               "base": gr.update(value="", visible=False),
               "calls": gr.update(value=None, visible=False)} if new_model else {}
    if not ready:
        cleared["message"] = waiting_note(status)
    generates = view in GENERATING_VIEWS
    if new_model and generates:  # a new model's own defaults, from its generation_config
        gen = generation_defaults(status.model_dir)
        cleared |= {"max_new_tokens": gr.update(value=gen.max_new_tokens),
                    "temperature": gr.update(value=gen.temperature), "top_p": gr.update(value=gen.top_p)}
    return TryPanel(chat=gr.update(visible=chat, **({"value": []} if new_model else {})),
                    new_chat=gr.update(visible=chat),
                    button=gr.update(interactive=ready, value="Send" if chat else "Predict"),
                    image=gr.update(visible=pictured, **({"value": None} if new_model else {})),
                    text=gr.update(visible=view != "image", label="Your message" if chat else "Try it",
                                   placeholder=PLACEHOLDERS.get(view or "", "Type a text for the trained model")),
                    settings=gr.update(visible=generates), system_prompt=gr.update(visible=chat),
                    tools=tools_box(status.run_dir, chat, new_model), **cleared)


# The views of a model that generates text: Try it shows the generation settings for them.
GENERATING_VIEWS = ("chat", "text", "generated_text", "image_chat")
# The views of a model that reads an uploaded image, and why a text alone is refused for them (it would name a file
# on the server).
IMAGE_REFUSALS = {"image": "This run classifies images: upload an image in Try it.",
                  "image_chat": "This run answers questions about images: upload an image and type a question in "
                                "Try it."}


def generation_defaults(model_dir: Any) -> Generation:
    """Try it's settings for a model: its generation_config's, with at most `limits.MAX_NEW_TOKENS` new tokens."""
    gen = model_defaults(model_dir)
    return dataclasses.replace(gen, max_new_tokens=min(gen.max_new_tokens, limits.MAX_NEW_TOKENS))


PLACEHOLDERS = {"chat": "Write to the trained model", "image_chat": "A question about the uploaded image",
                "vector": "A text (its embedding), or a text and then candidates, one a line (each candidate's "
                          "similarity to it, the nearest first)"}


def nearest(query: list[float], candidates: list[str], vectors: list[list[float]]) -> list[tuple[str, float]]:
    """Each candidate with its cosine similarity to the query's embedding, the most similar first."""
    import math

    def cosine(a: list[float], b: list[float]) -> float:
        norms = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
        return sum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0

    return sorted(((c, cosine(query, v)) for c, v in zip(candidates, vectors, strict=True)), key=lambda p: -p[1])


class TryItHandlers:
    """Try it and the scripting API's `predict`, on the caller's own finished run."""

    def __init__(self, state: AppState):
        self.state = state

    def _finished_run(self, text: str, request: Any, run: str | None = None) -> tuple[str, Picked]:
        """The text cut to the Try it limit and the finished run (or picked checkpoint) of the user who asks, or
        `Unanswered`."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            raise Unanswered(refusal)
        text, _ = limits.truncate_try_text(text)
        if not text:
            raise Unanswered("Type a text first.")
        return text, self._loadable(user, run)

    def _loadable(self, user: str | None, run: str | None = None) -> Picked:
        """The caller's current finished run, or the run or checkpoint `run` picked among theirs (`app.picks`), once
        its files pass the policy (`RequestPolicy.run_refusal`), or `Unanswered`."""
        status = self.state.jobs.status()
        if run:
            try:
                picked = resolve_pick(run, self.state.policy.runs_home(user), status)
            except PickRefused as e:
                raise Unanswered(str(e)) from None
        elif status.model_dir is None or status.run_dir is None or not self.state.policy.is_mine(status, user):
            raise Unanswered("No trained model yet: train (or resume) a run to the end first.")
        else:
            picked = Picked(run_dir=status.run_dir, target=status.run_dir)
        if refused := self.state.policy.run_refusal(picked.run_dir, user):
            raise Unanswered(f"⚠️ {refused}")
        return picked

    def view_of(self, run: str | None, *, request: Any = None) -> TryPanel:
        """Try it for the run or checkpoint picked (its view: chat, text box, image box; its generation defaults)."""
        user, _ = self.state.policy.who(request)
        from finetune.errors import InputError

        try:
            picked = self._loadable(user, run)
            return panel(picked, new_model=True)
        except Unanswered as e:
            return TryPanel(message=str(e))
        except InputError as e:  # a checkpoint that cannot become a model
            return TryPanel(message=f"⚠️ {e}")

    def choices(self, value: str | None = None, *, request: Any = None) -> Any:
        """The picker's runs and checkpoints (`app.picks`), keeping `value` when it is still one of them."""
        user, refusal = self.state.policy.who(request)
        return picker_update(self.state.policy.runs_home(user, refusal), self.state.jobs.status(), value)

    def _settings(self, status: Picked, max_new_tokens: int | None, temperature: float | None,
                  top_p: float | None, system_prompt: str | None) -> dict[str, Any]:
        """`predict`'s generation keywords from a visitor's settings: unset ones from the model's generation_config,
        new tokens at most `limits.MAX_NEW_TOKENS`, the system prompt cut to the Try it limit."""
        default = generation_defaults(status.model_dir)
        wanted = default.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        return {"max_new_tokens": min(wanted, limits.MAX_NEW_TOKENS), "temperature": temperature, "top_p": top_p,
                "system_prompt": limits.truncate_try_text(system_prompt or "")[0], "prompt": bounded_prompt}

    def predict(self, text: str, *, request: Any = None, max_new_tokens: int | None = None,
                temperature: float | None = None, top_p: float | None = None, system_prompt: str = "",
                run: str | None = None, with_base: bool = False, tools: str = "") -> dict[str, Any]:
        """The finished model on one text: {label, probabilities}, {reply} (a causal LM with a chat template: the
        text is the user's turn), {generated}, {value}, {score} or {words, tags, entities} (the kind's record).

        Raises `Unanswered` without a text or a finished model, or for an image classifier (a text would name a
        file on the server: its images come as uploads, `predict_image`), `finetune.models.pretrained.ModelError`
        when the model cannot be loaded, `finetune.errors.DataError` when its chat template cannot render the
        text, and `finetune.errors.ConfigError` for generation settings out of range (`finetune.use.generation`).
        `run`: a run or checkpoint of the caller's (`app.picks`) instead of the current run; `with_base`: a model
        that generates text answers beside the base model, under "base" (`finetune.use.predict.base_of`); `tools`:
        a chat's tools as JSON text (`app.tryit.tools.offered`), the reply's parsed calls under "tool_calls"."""
        text, status = self._finished_run(text, request, run)
        offer = offered(tools)
        settings = self._settings(status, max_new_tokens, temperature, top_p, system_prompt)
        if (view := try_view(status)) in IMAGE_REFUSALS:
            raise Unanswered(IMAGE_REFUSALS[view])
        from finetune.use.predict import predict

        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if try_view(status) == "vector" and len(lines) > 1:  # a text, then candidates: the nearest first
            query, candidates = lines[0], lines[1:limits.MAX_TRY_CANDIDATES + 1]
            records = predict(str(status.target), [query, *candidates])
            vectors = [next(v for v in r.values() if isinstance(v, list)) for r in records]  # each one's vector
            return {"query": query, "similarities": nearest(vectors[0], candidates, vectors[1:]),
                    "candidates_dropped": max(0, len(lines) - 1 - limits.MAX_TRY_CANDIDATES)}
        based = with_base and try_view(status) in GENERATING_VIEWS
        out = predict(str(status.target), [text], **settings, with_base=based, tools=offer)[0]
        return {k: v for k, v in out.items() if k != "text"}  # the kind's record, less the text it was given

    def predict_image(self, image: str | None, question: str = "", *, request: Any = None, run: str | None = None,
                      **generation: Any) -> dict[str, Any]:
        """The finished image classifier on one uploaded image (a file in Gradio's upload cache): {label,
        probabilities}; a vision-language model's reply to `question` about it: {generated}, generated with the
        `generation` settings (`predict`'s).

        Raises `Unanswered` without an image (or a question, for a model that answers them), a finished model, or for
        a run that does not read images, and `finetune.errors.InputError` when the model cannot be loaded or the file
        is not a readable image."""
        user, refusal = self.state.policy.who(request)
        if refusal:
            raise Unanswered(refusal)
        if not image:
            raise Unanswered("Upload an image first.")
        status = self._loadable(user, run)
        if (view := try_view(status)) not in IMAGE_REFUSALS:
            raise Unanswered("This run's model reads text, not images: type a text in Try it.")
        if too_big := limits.image_size_problem(image):
            raise Unanswered(f"⚠️ {too_big}")
        from finetune.use.predict import predict

        if view == "image_chat":  # the uploaded file (in Gradio's cache, never a path a visitor typed), the question
            question = limits.truncate_try_text(question or "")[0]
            if not question:
                raise Unanswered("Type a question about the image.")
            if kinds.IMAGE_QUESTION in str(image):
                raise Unanswered(f"Rename the image: its name may not hold {kinds.IMAGE_QUESTION!r}.")
            settings = self._settings(status, generation.get("max_new_tokens"), generation.get("temperature"),
                                      generation.get("top_p"), "")
            out = predict(str(status.target), [f"{image}{kinds.IMAGE_QUESTION}{question}"], **settings)[0]
            return {k: v for k, v in out.items() if k != "text"}
        out = predict(str(status.target), [str(image)])[0]
        return {k: v for k, v in out.items() if k != "text"}  # the label and probabilities, less the file's path

    def try_it(self, text: str, history: list[dict[str, Any]] | None = None, image: str | None = None,
               max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
               system_prompt: str = "", run: str | None = None, compare: bool = False, tools: str = "", *,
               request: Any = None) -> renderers.PredictionShown:
        """Try it: the finished model's prediction shown by its kind's view (an image classifier's of the uploaded
        `image`), or (a run its kind chats with) the next turn of a chat with it, through the template it was
        trained with; a model that generates text generates with the settings given (unset: its own). `run`: the
        run or checkpoint picked (`app.picks`); `compare`: the base model's answer beside it (a classifier: its
        evaluation beside the majority-class baseline, `compared`); `tools`: a chat's Tools (JSON) box, offered to
        the model, its reply's tool calls shown parsed beside it (`app.tryit.tools`)."""
        from finetune.errors import InputError
        from finetune.use.predict import replies

        try:
            user, _ = self.state.policy.who(request)
            view = try_view(self._loadable(user, run) if run else self.state.jobs.status())
            if view in IMAGE_REFUSALS:
                out = self.predict_image(image, text, request=request, run=run, max_new_tokens=max_new_tokens,
                                         temperature=temperature, top_p=top_p)
                return renderers.RENDERERS[view](out, limits.truncate_try_text(text or "")[1])
            if history or view == "chat":  # the model answers the whole conversation
                text, status = self._finished_run(text, request, run)
                offer = offered(tools)
                turns = [*history_turns(history), {"role": "user", "content": text}]
                answers = replies(str(status.target), turns, with_base=bool(compare), tools=offer,
                                  **self._settings(status, max_new_tokens, temperature, top_p, system_prompt))
                base = ("Base model (before fine-tuning)", answers[1]) if compare else None
            else:
                out = self.predict(text, request=request, max_new_tokens=max_new_tokens, temperature=temperature,
                                   top_p=top_p, system_prompt=system_prompt, run=run, with_base=bool(compare))
                base = self.compared(out, view, run, request) if compare else None
        except Unanswered as e:
            return renderers.PredictionShown(message=str(e))
        except InputError as e:  # the model cannot be loaded, or its template cannot render the chat
            return renderers.PredictionShown(message=f"⚠️ {e}")
        shown_text, note = limits.truncate_try_text(text)
        if history or view == "chat":
            shown = renderers.chat([*history_turns(history), {"role": "user", "content": shown_text}], answers[0],
                                   note)
            shown = dataclasses.replace(shown, calls=calls_box(answers[0], offer))
        else:
            shown = renderers.RENDERERS[view or kinds.entry(kinds.DEFAULT).try_view](out, note)
        return dataclasses.replace(shown, base=renderers.base_box(*base)) if base else shown

    def compared(self, out: dict[str, Any], view: str | None, run: str | None, request: Any) -> tuple[str, str]:
        """What Compare shows beside the answer: (label, text) of the base model's answer (a model that generates
        text), or a classifier's final evaluation beside the majority-class baseline of its evaluation rows."""
        if "base" in out:
            return "Base model (before fine-tuning)", next(str(v) for v in out["base"].values())
        if view != "probabilities":
            return "Base model", "This kind of model has no comparison with its base model yet."
        from finetune.use.baseline import majority_baseline

        user, _ = self.state.policy.who(request)
        run_dir = self._loadable(user, run).run_dir
        accuracy = final_metrics_of(run_dir).get("accuracy")
        baseline = majority_baseline(run_dir)
        tuned = f"Fine-tuned: accuracy {accuracy:.3f}" if isinstance(accuracy, (int, float)) else \
            "Fine-tuned: no evaluation (the run had no evaluation rows)"
        base = (f"majority-class baseline (always “{baseline['label']}”): accuracy {baseline['accuracy']:.3f} on "
                f"{baseline['rows']} evaluation rows") if baseline else "no majority-class baseline (no evaluation "\
            "rows)"
        return "Evaluation beside the baseline (the base model's head is untrained)", f"{tuned} · {base}"
