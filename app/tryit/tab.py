"""The Try it tab: its widgets (the chat box or the text box, and one widget per view of a prediction) and its
events. The poll (`app.follow`) switches between chat and text when a run finishes (`panel.panel`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gradio as gr

from app.door import limits
from app.picks import newest_pick
from app.tryit import tools as tools_ui
from app.tryit.panel import panel
from finetune.use.generation import Generation
from finetune.use.toolcalls import MAX_TOOLS_CHARS

if TYPE_CHECKING:
    from app.follow import Seen
    from app.tabs import Page


@dataclass
class TryItTab:
    """The Try it tab's components."""

    chat: Any
    text: Any
    button: Any
    new_chat: Any
    message: Any
    label: Any
    generated: Any
    entities: Any
    image: Any  # an image classifier's input, in place of the text box (a vision-language model's, beside it)
    settings: Any  # the accordion of generation settings (a model that generates text)
    max_new_tokens: Any
    temperature: Any
    top_p: Any
    system_prompt: Any
    pick: Any  # which run or checkpoint (`app.picks`)
    compare: Any  # answer with the base model too
    base: Any  # the base model's answer (a classifier: its evaluation beside the majority-class baseline)
    tools: Any  # a chat run trained with tools: the tools offered to the model (`app.tryit.tools`)
    calls: Any  # the tool calls parsed from the model's reply

    @property
    def generation(self) -> list[Any]:
        """The generation settings, in `TryItHandlers.try_it`'s order."""
        return [self.max_new_tokens, self.temperature, self.top_p, self.system_prompt]

    @property
    def view(self) -> dict[str, Any]:
        """Where a `TryPanel` goes (Export's Push aside)."""
        return {"chat": self.chat, "label": self.label, "generated": self.generated, "button": self.button,
                "entities": self.entities, "new_chat": self.new_chat, "text": self.text, "message": self.message,
                "image": self.image, "settings": self.settings, "max_new_tokens": self.max_new_tokens,
                "temperature": self.temperature, "top_p": self.top_p, "system_prompt": self.system_prompt,
                "base": self.base, "tools": self.tools, "calls": self.calls}

    @property
    def polled(self) -> dict[str, Any]:
        """Where the views of `refresh` go (the panel's Push is Export's button: the page adds it)."""
        return {"try_panel": dict(self.view), "try_pick": self.pick}

    @property
    def shown(self) -> dict[str, Any]:
        """Where a `PredictionShown` goes."""
        return {"label": self.label, "generated": self.generated, "chat": self.chat, "text": self.text,
                "message": self.message, "entities": self.entities, "image": self.image, "base": self.base,
                "calls": self.calls}


def refresh(seen: Seen) -> dict[str, Any]:
    """Try it's view of the run, for the poll (`app.follow`), once the run or its state changed: the chat, image or
    text box its kind is tried with (a new model starts a new chat), and the picker with the newest run picked."""
    if not seen.changed_run:
        return {}
    return {"try_panel": panel(seen.status, new_model=seen.new_model), "try_pick": newest_pick(seen)}


def build(page: Page) -> TryItTab:
    """The Try it tab's widgets, inside the open `gr.Tab`: a chat box for a run trained to chat, an image box for an
    image classifier, a text box for the others; a label's probabilities, generated text (or a value, a score) and
    highlighted entities below."""
    pick = gr.Dropdown([], value=None, label="Run or checkpoint", elem_id="try-run", allow_custom_value=False,
                       info="Your finished runs (newest first) and the checkpoints of stopped ones")
    chat = gr.Chatbot(label="Chat with the trained model (through its chat template)", visible=False, height=280,
                      elem_id="try-chat")
    with gr.Row():
        text = gr.Textbox(label="Try it", placeholder="Type a text for the trained model",
                          max_length=limits.MAX_INPUT_CHARS, scale=4, elem_id="try-box")
        # A file path in Gradio's upload cache, the file as it was sent (`image_mode=None`: the kind converts it).
        # A fixed height: an 8×8 digit was shown as a strip a few pixels high.
        image = gr.Image(label="Image for the trained model", type="filepath", image_mode=None, height=240,
                         sources=["upload", "clipboard"], visible=False, scale=4, elem_id="try-image")
        button = gr.Button("Predict", scale=1, interactive=False, elem_id="try-button")
    compare = gr.Checkbox(label="Compare with the base model", value=False, elem_id="try-compare",
                          info="The same text, the same settings, answered by the model the run started from too "
                               "(a classifier: its evaluation beside the majority-class baseline)")
    new_chat = gr.ClearButton([chat], value="New chat", size="sm", visible=False)
    tools = gr.Textbox(label=tools_ui.LABEL, info=tools_ui.INFO, lines=4, max_lines=12, visible=False,
                       max_length=MAX_TOOLS_CHARS, placeholder='[{"type": "function", "function": {"name": …}}]',
                       elem_id="try-tools")
    calls = gr.JSON(label="Tool calls (parsed from the reply)", visible=False, elem_id="try-calls")
    # Set to the model's generation_config when a run finishes (`panel.panel`); hidden for a model that does not
    # generate text.
    defaults = Generation()
    with gr.Accordion("Generation settings", open=False, visible=False, elem_id="try-settings") as settings:
        with gr.Row():
            max_new_tokens = gr.Slider(1, limits.MAX_NEW_TOKENS, value=min(defaults.max_new_tokens,
                                                                           limits.MAX_NEW_TOKENS), step=1,
                                       label="Max new tokens", elem_id="try-max-new-tokens")
            temperature = gr.Slider(0, 2, value=defaults.temperature, step=0.05, elem_id="try-temperature",
                                    label="Temperature", info="0: greedy, the likeliest token each step")
            top_p = gr.Slider(0.05, 1, value=defaults.top_p, step=0.05, label="Top-p", elem_id="try-top-p",
                              info="Sampling: only the likeliest tokens that add up to this")
        system_prompt = gr.Textbox(label="System prompt", placeholder="Before the chat, e.g. Answer briefly.",
                                   max_length=limits.MAX_TRY_CHARS, visible=False, elem_id="try-system")
    message = gr.Markdown(elem_id="try-message")
    label = gr.Label(label="Prediction", num_top_classes=5, visible=False, elem_id="prediction")
    generated = gr.Textbox(label="Generated continuation", visible=False, interactive=False)
    entities = gr.HighlightedText(label="Entities", visible=False, show_legend=True, elem_id="try-entities")
    base = gr.Textbox(label="Base model (before fine-tuning)", visible=False, interactive=False, elem_id="try-base")
    return TryItTab(chat=chat, text=text, button=button, new_chat=new_chat, message=message, label=label,
                    generated=generated, entities=entities, image=image, settings=settings,
                    max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, system_prompt=system_prompt,
                    pick=pick, compare=compare, base=base, tools=tools, calls=calls)


def wire(page: Page, tab: TryItTab) -> None:
    """Predict (or Send) and Enter in the box ask the picked model (an image classifier: about the uploaded image),
    with the generation settings; picking another run shows its view; the picker's list is read again when the tab
    is opened and the page loads, the pick kept (the poll, `app.follow`, picks the newest when the current run
    changes)."""
    on, handlers, refresh = page.on, page.h.tryit, [page.selected["try"], page.load]
    for event in (tab.button.click, tab.text.submit):
        on(event, handlers.try_it, [tab.text, tab.chat, tab.image, *tab.generation, tab.pick, tab.compare, tab.tools],
           tab.shown,
           api_visibility="private")
    on(tab.pick.input, handlers.view_of, tab.pick, tab.view, api_visibility="private")
    for event in refresh:
        on(event, handlers.choices, tab.pick, {}, outputs=tab.pick, gate="quiet", show_progress="hidden",
           api_visibility="private")

