"""A job's time limit: `--timeout`, or an estimate of the run's length with a margin.

The estimate is arithmetic you can check: training a model of P parameters costs about 6·P floating-point
operations per token (forward and backward; 8·P with gradient checkpointing, which runs the forward twice), every
sample counted at its worst case of `max_length` tokens, over `max_steps` optimizer steps of the effective batch (or
`epochs` passes over the training rows, counted here for a local file and read from the Hub's dataset card for a Hub
dataset). The GPUs are assumed to sustain `UTILISATION` of their dense bf16/fp16 peak (`PEAK_TFLOPS`, from NVIDIA's
datasheets); `STARTUP_S` covers pulling the image, starting the container and downloading the model. The limit is
`MARGIN` times that, rounded up to 10 minutes, and at least `MINIMUM_S`. Before the limit, the job is asked to stop
(SIGTERM) `grace_s` early, so a run that is longer than its estimate stops with a checkpoint that `resume=true`
continues, instead of being killed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from finetune.building import BUILDS
from finetune.config.schema import Config, from_dict
from finetune.config.tasks import single_task_values
from finetune.data.load import is_local, load_table
from finetune.errors import ConfigError
from finetune.models.pretrained import quiet_transformers, resolve_model_path
from finetune.plan.timing import PEAK_TFLOPS, UTILISATION  # the plan's time prediction's own figures
from finetune.registry import entry

STARTUP_S = 600
MARGIN = 2.0
MINIMUM_S = 30 * 60
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class TimeLimit:
    """The job's limit in seconds and the sentence that says where it comes from."""

    seconds: int
    reason: str

    @property
    def grace_s(self) -> int:
        """How long before the limit the run is asked to stop: 10 % of it, at least 5 and at most 30 minutes (a
        checkpoint written to the bucket takes that long for a large model)."""
        return int(min(max(0.1 * self.seconds, 300), 1800, self.seconds / 2))

    @property
    def stop_after_s(self) -> int:
        """When the run is asked to stop (SIGTERM), in seconds after the job starts."""
        return self.seconds - self.grace_s


def parse_duration(text: str) -> int:
    """`90m`, `2h`, `1h30m`, `3600` (seconds) → seconds; one sentence for anything else."""
    text = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        seconds = float(text)
    elif re.fullmatch(r"(\d+(\.\d+)?[smhd])+", text):
        seconds = sum(float(n) * _UNITS[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)([smhd])", text))
    else:
        raise ConfigError([f"--timeout {text!r} is not a duration: write it like 90m, 2h, 1h30m or 3600 (seconds)."])
    if seconds < 300:
        raise ConfigError([f"--timeout {text} is under 5 minutes: a job needs that long to start; give at least 5m."])
    return int(seconds)


def format_duration(seconds: float) -> str:
    """3600 → `1h`, 5400 → `1h30m`, 600 → `10m`."""
    minutes = math.ceil(seconds / 60)
    hours, minutes = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes or not hours else "")


def parameter_count(c: Config) -> int:
    """The model's parameters, built from its config on the meta device (no weights read)."""
    import torch
    import transformers
    from transformers import AutoConfig

    quiet_transformers()
    config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    with BUILDS, torch.device("meta"):
        model = getattr(transformers, entry(c.task).auto_model).from_config(config,
                                                                           trust_remote_code=c.trust_remote_code)
    return sum(p.numel() for p in model.parameters())


def training_rows(c: Config, api: Any | None = None) -> int | None:
    """The rows `epochs` pass over: counted for a local file, read from the Hub's card for a Hub dataset (None
    when the card does not say), after `max_train_samples` and the held-out `eval_fraction`."""
    configs = [from_dict(single_task_values(c, t)) for t in c.tasks] if c.tasks else [c]
    total = 0
    for one in configs:
        rows = _rows(one.dataset, one.dataset_config, one.train_split, api)
        if rows is None:
            return None
        rows = min(rows, one.max_train_samples or rows)
        if not (one.eval_dataset or one.eval_split):
            rows = math.floor(rows * (1 - one.eval_fraction))
        total += rows
    return total


def _rows(dataset: str | None, config_name: str | None, split: str, api: Any | None) -> int | None:
    if dataset is None:
        return None
    if is_local(dataset):
        return len(load_table(dataset))
    if api is None:
        return None
    from huggingface_hub.errors import HTTPError

    try:
        card = api.dataset_info(dataset).card_data
    except (HTTPError, OSError):
        return None
    data = card.to_dict() if hasattr(card, "to_dict") else (card or {})
    infos = data.get("dataset_info")
    for info in infos if isinstance(infos, list) else [infos] if isinstance(infos, dict) else []:
        if config_name and info.get("config_name") not in (config_name, None):
            continue
        for s in info.get("splits") or []:
            if s.get("name") == split and isinstance(s.get("num_examples"), int):
                return s["num_examples"]
    return None


def estimate(c: Config, plan: Any, *, gpus: int, gpu_model: str, rows: int | None, params: int) -> TimeLimit:
    """The limit for a run of `c` with `plan` on `gpus` GPUs of `gpu_model` (see the module docstring)."""
    batch = plan.batch.effective_batch_size
    if c.max_steps:
        steps = c.max_steps
    elif rows is None:
        raise ConfigError(["The run's length cannot be estimated without reading its data (the Hub's card of "
                           f"{c.dataset or 'the tasks'!r} does not give the rows of its split): give --timeout "
                           "(for example --timeout 2h) or set max_steps."])
    else:
        steps = math.ceil(c.epochs * math.ceil(rows / batch))
    tokens = steps * batch * plan.worst_case_tokens
    per_token = 8 if plan.gradient_checkpointing else 6
    peak = PEAK_TFLOPS.get(gpu_model, min(PEAK_TFLOPS.values())) * 1e12 * gpus
    train_s = per_token * params * tokens / (peak * UTILISATION)
    seconds = max(MINIMUM_S, math.ceil(MARGIN * (STARTUP_S + train_s) / 600) * 600)
    reason = (f"estimated: {steps:,} steps × {batch} samples × {plan.worst_case_tokens} tokens × "
              f"{per_token}·{params / 1e6:,.0f}M parameters at {UTILISATION:.0%} of {gpus} × {gpu_model}'s "
              f"{peak / gpus / 1e12:g} TFLOPS ≈ {format_duration(train_s)}, plus {format_duration(STARTUP_S)} to "
              f"start, × {MARGIN:g}")
    return TimeLimit(seconds, reason)
