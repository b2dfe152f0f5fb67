"""Try it's views of a prediction, one renderer per view name a kind's registry entry gives (`Entry.try_view`), and
the chat's: a new kind picks one of these by name in the registry; a new kind of view is one renderer here and its
widget in `app.tryit.tab`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gradio as gr

from app.results import hidden, keep


@dataclass(frozen=True, kw_only=True)
class PredictionShown:
    """Try it: label probabilities, highlighted entities, a number or generated text, or the chat with the model
    (the others hidden), or a message; `text` clears the box once a chat message is answered."""

    label: Any = keep()
    generated: Any = keep()
    chat: Any = keep()
    text: Any = keep()
    message: str = ""
    entities: Any = hidden()  # token classification: the words, each entity highlighted with its type
    image: Any = keep()  # the uploaded image stays as it was given
    base: Any = hidden()  # Compare: the base model's answer, or a classifier's evaluation beside its baseline
    calls: Any = hidden()  # a chat offered tools: the tool calls parsed from the reply (`app.tryit.tools`)


def base_box(label: str, value: str) -> Any:
    """The Compare box: the base model's answer (or a classifier's evaluation beside its baseline)."""
    return gr.update(value=value, label=label, visible=True)


def entity_pieces(out: dict[str, Any]) -> list[tuple[str, str | None]]:
    """A token-classification prediction as gr.HighlightedText pieces: each entity's words as one piece labelled
    with its type, the other words unlabelled (a tagging without entities, e.g. part of speech: each word's tag)."""
    words, tags, found = out.get("words") or [], out.get("tags") or [], out.get("entities") or []
    if not found:
        return [(f"{w} ", None if t == "O" else t) for w, t in zip(words, tags, strict=False)]
    starts = {e["start"]: e for e in found}
    pieces, i = [], 0
    while i < len(words):
        if i in starts:
            entity = starts[i]
            pieces += [(" ".join(words[i:entity["end"]]), entity["type"]), (" ", None)]
            i = entity["end"]
        else:
            pieces.append((f"{words[i]} ", None))
            i += 1
    return pieces


EMPTY_REPLY = "it may need more training, or more data."  # what an empty answer says to do (chat and text alike)


def _in_box(value: str, label: str, note: str) -> PredictionShown:
    """One line of text in the result box, labelled."""
    return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False), message=note,
                           generated=gr.update(value=value, label=label, visible=True))


def probabilities(out: dict[str, Any], note: str) -> PredictionShown:
    """A classifier's probability of each label (by the names in its `id2label`)."""
    return PredictionShown(label=gr.update(value=out["probabilities"], visible=True),
                           generated=gr.update(visible=False), chat=gr.update(visible=False), message=note)


def entities(out: dict[str, Any], note: str) -> PredictionShown:
    """The text with its entities highlighted (token classification)."""
    return PredictionShown(label=gr.update(visible=False), chat=gr.update(visible=False), message=note,
                           generated=gr.update(visible=False),
                           entities=gr.update(value=entity_pieces(out), visible=True))


def score(out: dict[str, Any], note: str) -> PredictionShown:
    """A reward model's score of the text."""
    return _in_box(f"{out['score']:.4g}", "Reward (score)", note)


def value(out: dict[str, Any], note: str) -> PredictionShown:
    """A regression model's predicted number."""
    return _in_box(f"{out['value']:.4g}", "Predicted value", note)


def _generated(value: str, label: str, note: str) -> PredictionShown:
    """A model's generated text in the result box; nothing generated says so (an empty box reads as a broken
    page), as the chat does for an empty reply."""
    if not value.strip():
        note = " ".join(n for n in (note, f"The model generated nothing: {EMPTY_REPLY}") if n)
    return _in_box(value, label, note)


def text(out: dict[str, Any], note: str) -> PredictionShown:
    """A causal LM's continuation of the text."""
    return _generated(out["generated"], "Generated continuation", note)


def vector(out: dict[str, Any], note: str) -> PredictionShown:
    """An embedding model's vector of the text (the record's one list of numbers): its size and first values; for a
    text and candidates (one a line), each candidate's cosine similarity to the text, the nearest first."""
    if "similarities" in out:
        rows = "\n".join(f"{sim:+.4f}  {candidate}" for candidate, sim in out["similarities"])
        if out.get("candidates_dropped"):
            note = " ".join(filter(None, [note, f"Only the first {len(out['similarities'])} candidates were "
                                                f"compared ({out['candidates_dropped']} more lines left out)."]))
        return _in_box(rows, f"Cosine similarity to “{out['query'][:80]}”, nearest first", note)
    values = next(v for v in out.values() if isinstance(v, list))
    shown = ", ".join(f"{x:.4f}" for x in values[:8]) + (", …" if len(values) > 8 else "")
    return _in_box(f"[{shown}]", f"Embedding ({len(values)} dimensions)", note)


def generated_text(out: dict[str, Any], note: str) -> PredictionShown:
    """A seq2seq model's target text for the text (its summary, its translation)."""
    return _generated(out["generated_text"], "Generated text", note)


def image(out: dict[str, Any], note: str) -> PredictionShown:
    """An image classifier's most likely labels for the uploaded image, with their probabilities (the label box
    shows the top five)."""
    return probabilities(out, note)


def image_chat(out: dict[str, Any], note: str) -> PredictionShown:
    """A vision-language model's reply to the question about the uploaded image."""
    return _generated(out["generated"], "Reply", note)


RENDERERS: dict[str, Callable[[dict[str, Any], str], PredictionShown]] = {
    "probabilities": probabilities, "entities": entities, "score": score, "value": value, "text": text,
    "vector": vector, "generated_text": generated_text, "image": image, "image_chat": image_chat}


def chat(turns: list[dict[str, str]], reply: str, note: str) -> PredictionShown:
    """The conversation so far (`turns`, the user's last message included) and the model's `reply`, in the chat box;
    an empty reply says so rather than showing an empty bubble."""
    if not reply.strip():  # an empty bubble reads as a broken page
        reply = "*(no reply)*"
        note = " ".join(n for n in (note, f"The model answered with nothing: {EMPTY_REPLY}") if n)
    return PredictionShown(label=gr.update(visible=False), generated=gr.update(visible=False),
                           chat=gr.update(value=[*turns, {"role": "assistant", "content": reply}], visible=True),
                           text="", message=note)
