"""Before anything is sent: the plan for the flavor's GPU and the job's time limit.

The plan is `finetune plan --device cuda`'s dry run for one of the flavor's GPUs (its memory is the budget), made
from the model's config and `max_length` alone: the data stays where it is, so every sample is planned at
`max_length` tokens and padded, and a classifier's head at the model config's `num_labels` (2 unless it says; a
head is a few kilobytes). A config that cannot fit is refused here, before it costs anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from finetune.config.schema import Config, from_dict
from finetune.config.tasks import single_task_values
from finetune.errors import ConfigError, HostMemoryError, PlanError
from finetune.models.pretrained import resolve_model_path
from finetune.plan.planner import HostMemory, plan_run
from finetune.remote.flavors import GIB, Flavor
from finetune.remote.timelimit import TimeLimit, estimate, format_duration, parameter_count, training_rows


@dataclass(frozen=True)
class Preflight:
    """What the launcher checked: the config as the job will run it (the flavor's budget in it), its plan for
    the flavor, and the time limit."""

    config: Config
    flavor: Flavor
    plan: Any  # finetune.plan.planner.Plan
    limit: TimeLimit

    def summary(self) -> str:
        """The lines the launcher prints before it sends the job."""
        b = self.plan.batch
        cost = self.flavor.usd_per_hour * self.limit.seconds / 3600
        return "\n".join([
            f"flavor: {self.flavor.describe()}",
            f"plan: {b.micro_batch_size} micro × {b.grad_accum_steps} accumulation × {b.num_processes} GPU(s) = "
            f"{b.effective_batch_size}, predicted peak {self.plan.predicted_peak_bytes / GIB:.2f} of "
            f"{self.flavor.budget_gib:g} GiB per GPU (dry run at {self.plan.worst_case_tokens} tokens)",
            f"time limit: {format_duration(self.limit.seconds)} ({self.limit.reason}); at most "
            f"${cost:.2f}; the run is asked to stop with a checkpoint {format_duration(self.limit.grace_s)} "
            "before it"])


def job_config(c: Config, flavor: Flavor) -> Config:
    """`c` with the flavor's GPU as its memory budget (a smaller budget of the user's is kept)."""
    budget = flavor.budget_gib
    if c.memory_budget_gb and c.memory_budget_gb < budget:
        budget = c.memory_budget_gb
    return c.replace(memory_budget_gb=budget)


def plan_for(c: Config, flavor: Flavor, *, service: str = "Hugging Face Jobs",
             larger: str = "`finetune jobs flavors` lists the flavors with more {more}") -> Any:
    """The dry-run plan of `c` on one of the flavor's GPUs, for as many processes as it has GPUs; a `PlanError`
    that names the flavor (or partition) and the `service` it was not sent to when nothing fits, and says where
    to find `larger` hardware."""
    from transformers import AutoConfig

    single = from_dict({**single_task_values(c, c.tasks[0]), "memory_budget_gb": c.memory_budget_gb}) \
        if c.tasks else c
    model_config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    labels = [str(i) for i in range(max(2, int(getattr(model_config, "num_labels", 2) or 2)))]
    device = (f"cuda ({flavor.name}: {flavor.gpu_model}, planned for {c.memory_budget_gb:g} GiB)",
              int(c.memory_budget_gb * GIB))
    try:
        plan, _ = plan_run(single, [], labels, num_processes=flavor.gpus, device=None,
                           distributed="ddp" if flavor.gpus > 1 else "single", planned_device=device,
                           host=flavor_host(flavor))
    except PlanError as e:
        inner = " ".join(e.problems).rstrip(".")
        more = "RAM" if isinstance(e, HostMemoryError) else "GPU memory"  # what was short, and what to look for
        raise type(e)([f"Not sent to {service}: on {flavor.name} ({flavor.gpus} × {flavor.gpu_model}, "
                       f"{c.memory_budget_gb:g} GiB per GPU) {inner[:1].lower()}{inner[1:]}; "
                       f"{larger.format(more=more)}."]) from None
    return plan


def flavor_host(flavor: Flavor) -> HostMemory | None:
    """The RAM that one GPU's process may keep offloaded activations in on the flavor (its RAM over its GPUs, each
    process offloading its own), or None when the table does not say (this machine's is checked instead)."""
    ram = flavor.ram_bytes
    if ram is None:
        return None
    share = f", {ram // flavor.gpus / 1e9:g} GB for each of its {flavor.gpus} GPUs' processes" \
        if flavor.gpus > 1 else ""
    return HostMemory(ram // max(flavor.gpus, 1), f"{flavor.name}'s {ram / 1e9:g} GB of RAM{share}",
                      "a flavor with more RAM")


def preflight(c: Config, flavor: Flavor, *, timeout_s: int | None, api: Any | None = None) -> Preflight:
    """The checks before a job is sent: the plan for the flavor, then the time limit (`timeout_s`, else the
    estimate). `api` answers a Hub dataset's card for the estimate (None: not asked)."""
    if not flavor.gpus:
        raise ConfigError([f"Flavor {flavor.name!r} has no GPU: choose a GPU flavor (`finetune jobs flavors`)."])
    planned = job_config(c, flavor)
    plan = plan_for(planned, flavor)
    if timeout_s is not None:
        limit = TimeLimit(timeout_s, "--timeout")
    else:
        rows = None if planned.max_steps else training_rows(planned, api)
        limit = estimate(planned, plan, gpus=flavor.gpus, gpu_model=flavor.gpu_model or "",
                         rows=rows, params=parameter_count(planned))
    return Preflight(planned, flavor, plan, limit)
