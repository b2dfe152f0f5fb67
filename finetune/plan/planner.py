"""From a memory budget and an effective batch to a training plan: micro-batch, accumulation, precision,
checkpointing, LoRA, and the predicted peak with its breakdown (contract: docs/memory.md).

The estimate is a *dry run*: the real model is built as fake tensors (shapes, dtypes and a device, no data and no
weights) and one accumulation window's forward and backward run on it at the worst-case length under the
live-tensor tracker. That follows the model's actual implementation (attention kernel, loss, saved tensors), so it
needs no per-architecture constants; on a CPU it matches measured live-tensor peaks to a few per cent. A real
device can keep different tensors (GPU attention kernels, allocator slack), which the optional probe measures.

The planner, by the question each part answers:
- plan.py: the plan, how plan.json holds it, and its table (`Plan`, `render`);
- estimate.py: the peak of one configuration, term by term (`estimate`; an evaluation's forward: `estimate_forward`),
  and the skeletons it is dry-run on;
- ladder.py: the rungs climbed when a plan does not fit, and the savings laid over them (`rungs`, `LAYERS`);
- search.py: the plan of the first rung where a micro-batch fits (`make_plan`);
- longest.py: the reverse questions, the longest context and the smallest budget;
- probe.py: the plan corrected by measured windows (`refine_with_probe`);
- evaluation.py: an evaluation's batch size, from a forward without gradients (`eval_batch_size`);
- this module: the plan a run trains with (`plan_run`), read back from the plan cache when nothing changed;
- skeleton.py, dryrun.py, memory.py: the fake model, its dry run, and the live-tensor measurements under both.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from finetune.config.schema import Config
from finetune.engine.recurrence import check_run
from finetune.engine.runtime import device_memory
from finetune.models.pretrained import load_model, prepare_for_training
from finetune.plan import plancache
from finetune.plan.estimate import SAFETY, estimate, may_pad, worst_case_tokens
from finetune.plan.ladder import has_bitsandbytes
from finetune.plan.longest import explain_longest, longest_context, longest_within, rungs_needed, smallest_budget
from finetune.plan.plan import GIB, HostMemory, Plan, render
from finetune.plan.probe import probe_enabled, refine_with_probe
from finetune.plan.search import make_plan

# The planner's questions, answered in the modules above, for the callers that ask them here.
__all__ = ["GIB", "SAFETY", "HostMemory", "Plan", "estimate", "explain_longest", "longest_context", "longest_within",
           "make_plan", "may_pad", "plan_run", "probe_enabled", "refine_with_probe", "render", "rungs_needed",
           "smallest_budget", "worst_case_tokens"]


def plan_run(c: Config, lengths: list[int], label_names: list[str] | None, *, num_processes: int, device: Any,
             load: bool = False, distributed: str = "single", planned_device: tuple[str, int] | None = None,
             host: HostMemory | None = None) -> tuple[Plan, Any | None]:
    """The plan a run trains with (what `finetune train` and `finetune plan` both use): the dry run, then, when
    `plan_probe` is on, the probe on the real model at `device`. `planned_device` (name, bytes): plan for that
    device instead of this machine's (`finetune plan --device cuda`), by the dry run alone; `host`: the RAM that
    activation offload's copies must fit in there (default: this machine's).

    Returns the plan and the model loaded for it, prepared for training (checkpointing, LoRA). The model is loaded
    when the probe needs it or `load` asks for it; a dry run alone reads no weights (None)."""
    if c.segment_recurrence:  # refuse a model that would train silently wrong before planning for it
        check_run(c, lengths)
    plan = _dry_run_plan(c, lengths, len(label_names or []), num_processes=num_processes, distributed=distributed,
                         device=planned_device, host=host)
    if planned_device is not None:  # nothing to probe or load for a device that is not here
        return plan, None
    probe = probe_enabled(c)
    if probe and distributed == "fsdp":  # the probe trains the whole model on one device: what FSDP is there to avoid
        probe = False
        plan = dataclasses.replace(plan, notes=(*plan.notes, "Probe skipped under FSDP: it would put the whole "
                                                "model on one device."))
    if not (probe or load):
        return plan, None
    planned = plan.apply(c)  # the base stored as the plan says: fp32, the half dtype or quantized
    model = prepare_for_training(load_model(planned, label_names), planned,
                                 checkpointing=plan.gradient_checkpointing, lora=plan.lora,
                                 offload=plan.activation_offload, tiled=plan.tiled_mlp)
    if probe:
        # bitsandbytes puts a quantized model on its device as it loads it, and refuses to move it after.
        model = model if plan.quantization != "none" else model.to(device)
        plan = refine_with_probe(plan, model, c, longest=int(max(lengths)) if len(lengths) else None)
    return plan, model


def _dry_run_plan(c: Config, lengths: list[int], num_labels: int, *, num_processes: int, distributed: str,
                  device: tuple[str, int] | None = None, host: HostMemory | None = None) -> Plan:
    """`make_plan`, or the same plan read back when nothing it depends on has changed since it was last made and
    its offloaded activations still fit the RAM they would wait in (a plan made on a machine with more RAM is made
    again here: a smaller micro-batch, another rung, or the refusal)."""
    device = device or device_memory()
    host = host or HostMemory.here()
    key = plancache.plan_key(c, tokens=worst_case_tokens(c, lengths), num_labels=num_labels,
                             num_processes=num_processes, distributed=distributed, device=device[0],
                             padded=may_pad(lengths),
                             eight_bit=has_bitsandbytes(device[0].startswith("cuda")))
    cached = plancache.load(key)
    if cached is not None:
        try:
            plan = dataclasses.replace(Plan.from_dict(cached), method="cached dry-run")
        except (KeyError, TypeError):  # written by another version of Plan: plan again
            plan = None
        if plan is not None and host.fits(plan.host_bytes):
            return plan
    plan = make_plan(c, lengths, num_labels, num_processes=num_processes, device=device, distributed=distributed,
                     host=host)
    plancache.save(key, plan.to_dict())
    return plan
