"""GRPO's reward functions, named in `rewards`: the built-ins, a reward model, or a Python function of the user's.

A name is one of:

- `exact_match`: 1 when the completion's final answer equals the answer column's (the text after `####`, else the
  last `\\boxed{…}`, else the last number; numbers compare as numbers), else 0;
- `regex:PATTERN`: 1 when PATTERN is found in the completion, else 0;
- `format:PATTERN`: 1 when the whole completion matches PATTERN (`re.fullmatch`, DOTALL), else 0;
- `length:N`: 1 − |tokens − N| / N, at least 0 (closer to N tokens is better);
- `reward_model:PATH`: a `task: reward` run folder (its `model/`) or any sequence classifier with one output,
  scoring prompt + completion;
- `file.py:function`: `function(prompts, completions, completion_ids, **columns) -> list[float]`, TRL's signature
  (the dataset's other columns as keyword lists). It runs the file's code: the CLI and a local app take it, a shared
  server refuses it.

Parsing and checking import nothing heavy (the configuration checks the names before any model loads); scoring
with a reward model imports transformers when it runs.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.building import BUILDS
from finetune.errors import ConfigError

BUILT_INS = ("exact_match", "regex:PATTERN", "format:PATTERN", "length:N", "reward_model:PATH", "file.py:function")
# One example of each built-in, with what it scores in a few words: the app's Rewards field offers them (a pattern, a
# length or a reward model of one's own is typed in).
EXAMPLES = (("exact_match", "the final answer equals the answer column"),
            ("format:(?s).*#### -?\\d+\\s*", "the completion ends with #### and a number"),
            ("regex:\\\\boxed\\{", "the completion has a \\boxed{} answer"),
            ("length:100", "closer to 100 tokens is better"))
# The fields of a row of the `samples` event (`finetune.run.events.Samples`), besides `rewards` (each function's).
SAMPLE_FIELDS = ("prompt", "completion", "reward")
MODEL_KIND = "reward"  # the kind whose runs `reward_model:` takes as their folder (the app lists them)
CODE = re.compile(r"^(?P<file>.+\.py):(?P<function>[A-Za-z_][A-Za-z0-9_]*)$")
DEFAULT_BATCH = 32  # finetune.config.schema.DEFAULT_EFFECTIVE_BATCH (the schema imports this module's caller)
ANSWER_NAMES = ("answer", "solution", "ground_truth")  # the answer column's usual names (finetune.kinds.grpo)
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


@dataclass(frozen=True)
class Reward:
    """One parsed reward: its kind (exact_match, regex, format, length, reward_model, function), its argument and
    the name its metric `rewards/<name>/mean` has."""

    kind: str
    argument: str
    name: str

    @property
    def runs_code(self) -> bool:
        """Whether it runs a file's Python code (which a shared server refuses)."""
        return self.kind == "function"


def parse(spec: str) -> Reward:
    """A reward name as `rewards` spells it, parsed; a ConfigError of one sentence for one that is unknown or bad."""
    spec = str(spec).strip()
    head, _, argument = spec.partition(":")
    if spec == "exact_match":
        return Reward("exact_match", "", "exact_match")
    if head in ("regex", "format") and argument:
        try:
            re.compile(argument)
        except re.error as e:
            raise ConfigError([f"Reward {spec!r} has a bad pattern ({e}): fix the regular expression."]) from None
        return Reward(head, argument, head)
    if head == "length":
        if not argument.isdigit() or int(argument) < 1:
            raise ConfigError([f"Reward {spec!r} needs a whole number of tokens above 0: write length:N, as "
                               "length:100."])
        return Reward("length", argument, "length")
    if head == "reward_model" and argument:
        return Reward("reward_model", argument, Path(argument.rstrip("/")).name or "reward_model")
    if match := CODE.match(spec):
        return Reward("function", spec, match["function"])
    raise ConfigError([f"Unknown reward {spec!r}: use one of {', '.join(BUILT_INS)}."])


def parse_all(specs: Sequence[str]) -> tuple[Reward, ...]:
    """Every reward of `rewards`, with distinct metric names (a second `regex` is `regex_2`)."""
    parsed, seen = [], {}
    for spec in specs:
        r = parse(spec)
        seen[r.name] = seen.get(r.name, 0) + 1
        parsed.append(r if seen[r.name] == 1 else Reward(r.kind, r.argument, f"{r.name}_{seen[r.name]}"))
    return tuple(parsed)


def problems(specs: Sequence[str], weights: Sequence[str]) -> list[str]:
    """The configuration's sentences about `rewards` and `reward_weights` (none when they are fine)."""
    found = []
    if not specs:
        # `rewards` named first: the app's form shows a problem beside the first option it names.
        found.append("`rewards` is empty, and task=grpo needs it: a list of reward names (exact_match, "
                     "regex:PATTERN, format:PATTERN, length:N, reward_model:PATH or file.py:function).")
    for spec in specs:
        try:
            parse(spec)
        except ConfigError as e:
            found += e.problems
    if weights:
        if len(weights) != len(specs):
            found.append(f"`reward_weights` has {len(weights)} weight(s) for {len(specs)} reward(s): give one per "
                         "reward, or none (all 1).")
        for w in weights:
            try:
                ok = math.isfinite(float(w))
            except ValueError:
                ok = False
            if not ok:
                found.append(f"`reward_weights` holds {w!r}, not a number: give one number per reward.")
    return found


def weights_of(specs: Sequence[str], weights: Sequence[str]) -> tuple[float, ...]:
    """The weight of each reward (1 each when `reward_weights` is empty)."""
    return tuple(float(w) for w in weights) if weights else (1.0,) * len(specs)


# --- the built-ins


def text_of(completion: Any) -> str:
    """A completion's text: a string, or the contents of a conversational completion's messages."""
    if isinstance(completion, str):
        return completion
    return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))


def _last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{…}` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The final answer of a text: after the last `####`, else the last `\\boxed{}`'s contents, else its last
    number; None when it has none."""
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalised(answer: str) -> str | float:
    """An answer as compared: a number as a float (commas and a trailing full stop dropped), else its words."""
    clean = answer.strip().rstrip(".").replace("$", "").strip()
    try:
        return float(clean.replace(",", ""))
    except ValueError:
        return " ".join(clean.split()).lower()


def exact_match(completion: str, answer: Any) -> float:
    """1.0 when the completion's final answer equals the answer (its final answer, for a worked answer with
    `####` or `\\boxed{}`), else 0.0."""
    truth = str(answer)
    if "####" in truth or "\\boxed{" in truth:  # a worked answer (GSM8K's, MATH's): its final answer
        truth = final_answer(truth) or truth
    mine = final_answer(completion)
    return float(mine is not None and _normalised(mine) == _normalised(truth))


def length_reward(tokens: int, target: int) -> float:
    """1 at `target` tokens, falling linearly to 0 at 0 and at twice the target."""
    return max(0.0, 1.0 - abs(tokens - target) / target)


# --- scoring


Scorer = Callable[[list[Any], list[Any], list[list[int]], dict[str, list[Any]]], list[float]]


def scorer(reward: Reward, answer_column: str | None) -> Scorer:
    """A function (prompts, completions, completion ids, columns) → one float per completion, for `reward`."""
    if reward.kind == "exact_match":
        def score_exact(prompts, completions, ids, columns):
            answers = columns.get(answer_column) if answer_column else None
            if answers is None:
                raise ConfigError([f"Reward exact_match compares with the answer column, but the data has no "
                                   f"{answer_column or 'answer'!r} column: set `answer_column`."])
            return [exact_match(text_of(c), a) for c, a in zip(completions, answers, strict=True)]
        return score_exact
    if reward.kind in ("regex", "format"):
        pattern = re.compile(reward.argument, re.DOTALL)
        test = pattern.search if reward.kind == "regex" else pattern.fullmatch
        return lambda prompts, completions, ids, columns: [float(test(text_of(c)) is not None) for c in completions]
    if reward.kind == "length":
        target = int(reward.argument)
        return lambda prompts, completions, ids, columns: [length_reward(len(i), target) for i in ids]
    if reward.kind == "reward_model":
        return functools.partial(_score_with_model, reward.argument)
    function = load_function(reward.argument)

    def score_function(prompts, completions, ids, columns):
        values = function(prompts=prompts, completions=completions, completion_ids=ids, **columns)
        out = [math.nan if v is None else float(v) for v in values]
        if len(out) != len(completions):
            raise ConfigError([f"Reward {reward.argument} returned {len(out)} values for {len(completions)} "
                               "completions: return one float per completion."])
        return out
    return score_function


STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids")  # what every function is passed besides columns


def _signature(spec: str) -> tuple[list[str], list[str], bool] | None:
    """A `file.py:function` reward's parameters without a default, those with one, and whether it takes
    `**kwargs`, read from the file without running it; None when the file or the function cannot be read (scoring
    says why)."""
    match = CODE.match(spec)
    try:
        tree = ast.parse(Path(match["file"]).expanduser().read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == match["function"]), None)
    if node is None:
        return None
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    first_default = len(positional) - len(a.defaults)
    required = [x.arg for x in positional[:first_default]]
    optional = [x.arg for x in positional[first_default:]]
    for x, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        (required if default is None else optional).append(x.arg)
    return required, optional, a.kwarg is not None


def column_problem(reward: Reward, columns: list[str], prompt: str, answer: str | None) -> str | None:
    """Why the data's columns cannot feed `reward` (one sentence), or None: exact_match needs the answer column; a
    function gets every column besides the prompt as a keyword (TRL's convention), so each parameter it declares
    without a default must be a column, and without `**kwargs` it must name every one."""
    if reward.kind == "exact_match" and answer is None:
        return (f"Reward exact_match compares each completion with an answer column, and the data has none "
                f"(looked for {', '.join(ANSWER_NAMES)}; its columns are {', '.join(columns)}): set `answer_column`.")
    if reward.kind != "function" or (signature := _signature(reward.argument)) is None:
        return None
    required, optional, any_keyword = signature
    passed = [c for c in columns if c != prompt]
    if missing := [x for x in required if x not in STANDARD_ARGUMENTS and x not in passed]:
        return (f"Reward {reward.argument} takes the column(s) {', '.join(missing)}, which the data lacks (its "
                f"columns besides the prompt are {', '.join(passed) or 'none'}): add them, or give the parameter "
                "a default.")
    if not any_keyword and (extra := [c for c in passed if c not in required and c not in optional]):
        return (f"Reward {reward.argument} is passed every column besides the prompt as a keyword, and takes no "
                f"{', '.join(extra)}: add `**kwargs` to its parameters.")
    return None


def load_function(spec: str) -> Callable[..., Sequence[float | None]]:
    """The function `file.py:function` names (its file run as a module)."""
    match = CODE.match(spec)
    path = Path(match["file"]).expanduser()
    if not path.is_file():
        raise ConfigError([f"Reward {spec!r}: file {str(path)!r} does not exist: check the path."])
    module_spec = importlib.util.spec_from_file_location(f"finetune_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    function = getattr(module, match["function"], None)
    if not callable(function):
        raise ConfigError([f"Reward {spec!r}: {path.name} defines no function {match['function']!r}."])
    return function


@functools.cache
def _reward_model(path: str) -> tuple[Any, Any]:
    """A sequence classifier with one output and its tokenizer: a `task: reward` run's `model/`, or the folder or
    hub id itself; frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = Path(path).expanduser()
    if (folder / "model" / "config.json").is_file():
        folder = folder / "model"
    name = str(folder) if folder.exists() else path
    try:
        # use_kernels=False: a frozen scorer needs no Hub kernel code (transformers 5.25 would fetch it by default).
        with BUILDS:
            model = AutoModelForSequenceClassification.from_pretrained(name, use_kernels=False).eval()
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError([f"Reward model {path!r} could not be loaded ({str(e).splitlines()[0][:160]}): give a "
                           "task=reward run folder or a sequence classifier."]) from None
    if model.config.num_labels != 1:
        raise ConfigError([f"Reward model {path!r} has {model.config.num_labels} outputs, not one score: give a "
                           "task=reward run folder or a one-output sequence classifier."])
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    model.requires_grad_(False)
    return model, tokenizer


def _score_with_model(path: str, prompts: list[Any], completions: list[Any], ids: list[list[int]],
                      columns: dict[str, list[Any]]) -> list[float]:
    """The reward model's score of each prompt + completion (conversations through its chat template)."""
    import torch

    model, tokenizer = _reward_model(path)
    texts = []
    for p, c in zip(prompts, completions, strict=True):
        if isinstance(p, str):
            texts.append(p + text_of(c))
        else:
            turns = [*p, {"role": "assistant", "content": text_of(c)}]
            texts.append(tokenizer.apply_chat_template(turns, tokenize=False) if tokenizer.chat_template else
                         "\n".join(str(m.get("content", "")) for m in turns))
    enc = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
    device = next(model.parameters()).device
    with torch.no_grad():
        scores = model(**{k: v.to(device) for k, v in enc.items()}).logits[:, 0]
    return scores.float().tolist()


def config_problems(c: Any) -> list[str]:
    """A GRPO config's problems, one sentence each: its rewards and weights, a window of whole groups and
    micro-batches that cut them evenly (`micro_batch_size` and `effective_batch_size` count completions,
    `num_generations` per prompt; a window's groups are generated whole, then split into micro-batches)."""
    found = problems(c.rewards, c.reward_weights)
    g = c.num_generations
    eff, micro = c.effective_batch_size, c.micro_batch_size
    if eff is not None and eff % g:
        low = max(g, eff // g * g)
        found.append(f"`effective_batch_size`={eff} counts completions, so it must be a whole number of groups of "
                     f"num_generations={g}: use {low} or {low + g}.")
    if micro is not None and micro % g and g % micro:
        parts = [d for d in range(1, g) if g % d == 0]
        below = max([d for d in parts if d < micro] or [1])
        found.append(f"`micro_batch_size`={micro} counts completions, so it must divide num_generations={g} or "
                     f"be a whole number of its groups: use {below} or {max(g, micro // g * g)}.")
    if c.effective_batch_size is None and not (c.micro_batch_size and c.grad_accum_steps) and DEFAULT_BATCH % g:
        found.append(f"The default effective_batch_size={DEFAULT_BATCH} is not a whole number of groups of "
                     f"num_generations={g}: set `effective_batch_size` to a multiple of {g}.")
    mu = c.num_iterations
    if mu > 1 and c.save_every % mu:
        low = max(mu, c.save_every // mu * mu)
        found.append(f"`save_every`={c.save_every} must be a multiple of num_iterations={mu}: a checkpoint is taken "
                     f"only where a window's {mu} optimizer steps end; use {low} or {low + mu}.")
    if c.epsilon_high is not None and c.epsilon_high < c.epsilon:
        found.append(f"`epsilon_high`={c.epsilon_high} is below `epsilon`={c.epsilon}: the upper clipping range "
                     "is at least the lower one.")
    return found
