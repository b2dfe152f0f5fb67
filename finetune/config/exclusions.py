"""What does not combine yet: one table of the features that exclude each other, and of the features a task kind
does not take, each refusal one sentence (the CLI exits 2 with it).

`problems(c)` walks the table for a configuration; tests/test_exclusions.py walks it too, turning on both sides of
every row and checking that the run is refused with that row's sentence. A refusal that depends on the model
rather than on the configuration (packing or segment recurrence on an architecture that cannot keep samples apart
or carry state) is checked where the model's config is read (`finetune.data.packing`, `finetune.engine.recurrence`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from finetune import registry

SPLITTING = ("chunk", "sliding_window")


@dataclass(frozen=True)
class Feature:
    """An option (or a shape of data) that can be on or off: `on` reads it from a config, `example` turns it on."""

    name: str
    on: Callable[[Any], bool]
    example: dict[str, Any] = field(default_factory=dict)


TWO_TASKS = [{"name": "a", "dataset": "a.csv"}, {"name": "b", "dataset": "b.csv"}]
FEATURES = {f.name: f for f in (
    Feature("packing", lambda c: c.packing, {"packing": True}),
    Feature("streaming", lambda c: c.streaming, {"streaming": True, "max_steps": 5, "eval_fraction": 0}),
    Feature("segment_recurrence", lambda c: c.segment_recurrence, {"segment_recurrence": True}),
    Feature("gradient_checkpointing", lambda c: c.gradient_checkpointing == "true", {"gradient_checkpointing": "true"}),
    Feature("split_documents", lambda c: c.long_documents in SPLITTING, {"long_documents": "chunk"}),
    Feature("conversations", lambda c: bool(c.messages_column), {"messages_column": "messages"}),
    Feature("prompt_completion", lambda c: bool(c.prompt_column),
            {"prompt_column": "prompt", "completion_column": "completion"}),
    Feature("tasks", lambda c: bool(c.tasks), {"tasks": TWO_TASKS}),
    Feature("chunked_loss", lambda c: c.chunked_loss == "true", {"chunked_loss": "true"}),
    Feature("activation_offload", lambda c: c.activation_offload == "true", {"activation_offload": "true"}),
    Feature("no_checkpointing", lambda c: c.gradient_checkpointing == "false", {"gradient_checkpointing": "false"}),
    Feature("overwrite", lambda c: c.overwrite, {"overwrite": True}),
    Feature("resume", lambda c: c.resume, {"resume": True}),
)}

RECURRENCE_NOT_FOR_CONVERSATIONS = ("`segment_recurrence=true` is for long plain-text or prompt/completion documents, "
                                    "not conversations: turn it off for `messages_column` data.")


@dataclass(frozen=True)
class Exclusion:
    """Features `a` and `b` do not combine: `refusal(c)` is the sentence that says so and what to do."""

    a: str
    b: str
    refusal: Callable[[Any], str]


def _split_refusal(c: Any) -> str:
    return (f"`long_documents={c.long_documents}` is for plain text: a part of a completion (or of a conversation) "
            "split from its prompt would be learned without it; use long_documents=truncate (or auto) for "
            "prompt/completion and conversation data.")


EXCLUSIONS: tuple[Exclusion, ...] = (
    Exclusion("overwrite", "resume", lambda c: "`overwrite=true` and `resume=true` contradict each other: pick one."),
    Exclusion("split_documents", "prompt_completion", _split_refusal),
    Exclusion("split_documents", "conversations", _split_refusal),
    Exclusion("packing", "streaming", lambda c: "`packing=true` packs the whole tokenised set once and cannot pack a "
              "stream: set streaming=false or packing=false."),
    Exclusion("segment_recurrence", "gradient_checkpointing", lambda c: (
        "`segment_recurrence=true` cannot use gradient_checkpointing: transformers drops the carried cache under "
        "checkpointing (with only a warning), so segments would train without their memory; set "
        "gradient_checkpointing=false or auto.")),
    Exclusion("segment_recurrence", "split_documents", lambda c: (
        "`segment_recurrence=true` reads each document whole, segment by segment with its memory: it cannot be "
        f"combined with long_documents={c.long_documents}; set long_documents=auto.")),
    Exclusion("segment_recurrence", "packing", lambda c: (
        "`segment_recurrence=true` carries a document's memory from one segment to the next, which packed rows of "
        "several samples cannot: set packing=false.")),
    Exclusion("segment_recurrence", "conversations", lambda c: RECURRENCE_NOT_FOR_CONVERSATIONS),
    Exclusion("segment_recurrence", "chunked_loss", lambda c: (
        "`chunked_loss=true` does not apply to segment recurrence, whose logits are already one segment's at a "
        "time: set chunked_loss=auto or false.")),
    Exclusion("activation_offload", "no_checkpointing", lambda c: (
        "`activation_offload=true` keeps the inputs of checkpointed layers in CPU memory, so it needs gradient "
        "checkpointing: set gradient_checkpointing=auto or true, or activation_offload=auto.")),
    Exclusion("segment_recurrence", "activation_offload", lambda c: (
        "`activation_offload=true` needs gradient checkpointing, which segment recurrence cannot use: set "
        "activation_offload=auto or false.")),
    Exclusion("tasks", "streaming", lambda c: "`streaming=true` does not combine with `tasks` yet: read the tasks' "
              "data whole."),
    Exclusion("tasks", "conversations", lambda c: "Conversation data (`messages_column`) does not combine with "
              "`tasks` yet: train on the conversations as a run of their own."),
    Exclusion("tasks", "packing", lambda c: "`packing=true` does not combine with `tasks` yet (a packed row would mix "
              "tasks, and each micro-batch holds one): set packing=false."),
    Exclusion("tasks", "segment_recurrence", lambda c: "`segment_recurrence=true` does not combine with `tasks` yet: "
              "train the long documents as a run of their own."),
)

# The features a task kind may not take: a kind takes the ones its registry entry lists in `features`; the others
# are refused with the entry's own sentence for them, else with a plain one.
KIND_FEATURES = ("packing", "segment_recurrence", "split_documents", "tasks", "chunked_loss")


def kind_refusal(task: str, feature: str, c: Any) -> str:
    """Why kind `task` does not take `feature`, in one sentence."""
    e = registry.entry(task)
    takers = [n for n in registry.names() if takes(n, feature)]
    reason = e.refusals.get(feature)
    if feature == "split_documents":
        return (f"`long_documents={c.long_documents}` is for plain-text causal LM: {reason}; use "
                "long_documents=truncate (or auto).") if reason else \
            f"`long_documents={c.long_documents}` does not apply to task={task}: use long_documents=truncate (or auto)."
    setting = "`tasks`" if feature == "tasks" else f"`{feature}=true`"
    if feature == "tasks":
        return f"task={task} does not combine with `tasks` yet: train each dataset as a run of its own."
    if reason:
        return f"{setting} is for task={' or '.join(takers)}: {reason}."
    return f"{setting} is for task={' or '.join(takers)}; task={task} does not take it: turn it off."


def takes(task: str, feature: str) -> bool:
    """Whether kind `task` takes `feature` (one of KIND_FEATURES)."""
    e = registry.entry(task)
    return bool(e.multitask) if feature == "tasks" else feature in e.features


def split_refusal(c: Any) -> str:
    """Why `long_documents` (chunk or sliding_window) cannot split this run's data: its kind, or its data's shape
    (prompt/completion pairs and conversations, set or guessed from the columns)."""
    return _split_refusal(c) if takes(c.task, "split_documents") else kind_refusal(c.task, "split_documents", c)


def problems(c: Any) -> list[str]:
    """One sentence per row of the table that this configuration turns on on both sides, kinds' first."""
    out = []
    if c.task in registry.names():
        taken = [f for f in KIND_FEATURES if takes(c.task, f)]
        out += [kind_refusal(c.task, f, c) for f in KIND_FEATURES if f not in taken and FEATURES[f].on(c)]
    for x in EXCLUSIONS:
        if FEATURES[x.a].on(c) and FEATURES[x.b].on(c):
            sentence = x.refusal(c)
            if sentence not in out:  # two rows may say one thing (split documents of either shape)
                out.append(sentence)
    return out
