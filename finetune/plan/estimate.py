"""The peak memory of one configuration, term by term: the dry run's window (finetune.plan.dryrun) on the model's
skeleton, the terms counted from its shapes (weights, optimizer state), what the kind adds beside the model, and the
device's overhead.

The estimate is a *dry run*: the real model is built as fake tensors (shapes, dtypes and a device, no data and no
weights) and one accumulation window's forward and backward run on it at the worst-case length under the
live-tensor tracker. That follows the model's actual implementation (attention kernel, loss, saved tensors), so it
needs no per-architecture constants; on a CPU it matches measured live-tensor peaks to a few per cent. A real
device can keep different tensors (GPU attention kernels, allocator slack), which the optional probe measures.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Any

import numpy as np

from finetune.config.schema import Config
from finetune.engine import offload as offloading
from finetune.engine.recurrence import absolute_position_limit
from finetune.errors import PlanError
from finetune.kinds.base import TaskKind
from finetune.models import quantize, tiled_mlp
from finetune.models.pretrained import resolve_model_path
from finetune.plan import plancache
from finetune.plan.dryrun import dry_run, dry_run_forward, dry_run_segments
from finetune.plan.skeleton import Skeleton, model_skeleton
from finetune.registry import configured
from finetune.registry import kind as kind_named

SAFETY = 0.95  # plan to 95 % of the budget: the estimate aims at ±5 % on a GPU
CUDA_CONTEXT = 512 * 2**20  # the CUDA context and kernels, outside the allocator's counts
ALLOCATOR_SLACK = 0.10  # reserved − allocated in training: PyTorch's caching allocator fragments
CPU_RUNTIME = 0  # live tensors only: the process's own footprint is not the model's
# What FSDP splits over the processes.
SHARDED_TERMS = ("weights", "quantized_weights", "quantization_constants", "gradients", "optimizer_state")


def _bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def overhead(tensors: int, device: str) -> int:
    """Bytes the device needs beyond the live tensors: the CUDA context and the allocator's slack."""
    return CUDA_CONTEXT + int(ALLOCATOR_SLACK * tensors) if device.startswith("cuda") else CPU_RUNTIME


def estimate(skeleton: Skeleton, c: Config, *, kind: TaskKind, micro: int, tokens: int, accum: int, precision: str,
             optimizer: str, device: str, shards: int = 1, memory: int | None = None, padded: bool = False,
             quantization: str = "none", windows: dict[tuple, tuple] | None = None,
             host: dict[str, int] | None = None) -> dict[str, int]:
    """Peak memory by term for one configuration (bytes), per process; FSDP splits weights, gradients and
    optimizer state over `shards` processes. With `memory` (segment recurrence), `tokens` is one segment and
    `accum` its micro steps, which carry a cache of `memory` earlier tokens. `padded`: the micro-batch holds
    padding, so the model builds an attention mask (see `synthetic_batch`). `quantization` (8bit, 4bit): the
    skeleton's base linear layers are stored quantized (`quantize.weight_bytes`), and each is dequantized to the
    compute dtype for its matmul, one at a time. `windows` keeps dry runs already made, by skeleton and shape.
    `host`, when given, receives `offloaded_activations`: the CPU memory that a skeleton with activation offload
    keeps the checkpointed layers' inputs in (counted by the offload hooks in the dry run), not a device term."""
    gradients = skeleton.count(lambda m: _bytes(p for p in m.parameters() if p.requires_grad))
    terms = fixed_terms(skeleton, optimizer=optimizer, precision=precision, quantization=quantization)
    cuda = device.startswith("cuda")  # its attention kernels (`attention_as_on_cuda`)
    key = (id(skeleton), id(kind), micro, tokens, min(accum, 2), precision, memory, padded, cuda, c.packing)
    offloads = [offloading.of(m) for m in skeleton.models]
    if windows is not None and key in windows and windows[key][2] is kind:  # (an id outlives its object)
        window, carried, _, offloaded = windows[key]
    else:
        for counts in filter(None, offloads):
            counts.reset()
        for model in skeleton.models:  # a tiled MLP's default tile follows the length (`default_tile`)
            tiled_mlp.fit_tile(model, c, tokens)
        if memory is None:
            window, carried = dry_run(skeleton, kind, micro, tokens, accum, precision, packed=c.packing,
                                      padded=padded, cuda=cuda), 0
        else:
            window, carried = dry_run_segments(skeleton, micro, tokens, memory, accum, precision)
        # The offloaded inputs are layers' worth, like every other count of a deep model: scaled along the layers.
        offloaded = skeleton.count(lambda m: getattr(offloading.of(m), "peak", 0)) if any(offloads) else 0
    if windows is not None:
        windows[key] = window, carried, kind, offloaded
    if host is not None:
        host["offloaded_activations"] = offloaded
    # The window's peak holds gradients (all of them with accumulation; without it, whichever is larger of the
    # activations at the end of forward and the gradients at the end of backward), logits and activations.
    model_config = getattr(skeleton.model, "config", None)
    vocab = getattr(model_config, "vocab_size", 0) or 0
    terms["gradients"] = min(gradients, window)
    logits = kind.logits_bytes(micro, tokens, vocab, getattr(model_config, "num_labels", 0))
    terms["logits"] = min(logits, window - terms["gradients"])
    if memory is not None:  # memory_length tokens × layers × KV heads × head dim × 2 × dtype bytes × micro-batch
        terms["carried_cache"] = carried
    terms["activations"] = window - terms["gradients"] - terms["logits"] - carried
    # Each process keeps 1/N of every parameter, its gradient and its optimizer state; activations and logits
    # belong to the process's own micro-batch and are not sharded.
    for term in SHARDED_TERMS:
        if term in terms:
            terms[term] = math.ceil(terms[term] / shards)
    terms["overhead"] = overhead(sum(terms.values()), device)
    return terms


def estimate_forward(skeleton: Skeleton, *, micro: int, tokens: int, device: str) -> dict[str, int]:
    """Peak memory by term of an evaluation's forward without gradients (bytes): lm-evaluation-harness scoring a
    batch of `micro` requests of `tokens` tokens (`forward_only`). No gradients and no optimizer state; the
    activations are the few layers' transients alive at once (and a key/value cache where the model keeps one);
    the logits, their log-softmax and the previous batch's log-softmax are alive at once at the end."""
    terms = {"weights": skeleton.count(lambda m: _bytes(m.parameters()))}
    window = dry_run_forward(skeleton, micro, tokens)
    head = skeleton.model.get_output_embeddings()
    vocab = getattr(skeleton.model.config, "vocab_size", 0) or 0
    itemsize = head.weight.element_size() if head is not None else 4
    terms["logits"] = min(3 * micro * tokens * vocab * itemsize, window)
    terms["activations"] = window - terms["logits"]
    terms["overhead"] = overhead(sum(terms.values()), device)
    return terms


def fixed_terms(skeleton: Skeleton, *, optimizer: str, precision: str, quantization: str = "none"
                ) -> dict[str, int]:
    """The terms that no dry run is needed for, counted from the skeleton's shapes: the weights (or the quantized
    base's bytes) and the optimizer state."""
    gradients = skeleton.count(lambda m: _bytes(p for p in m.parameters() if p.requires_grad))
    state_per_byte = {"adamw": 2.0, "adamw_8bit": 0.5, "sgd": 0.0}[optimizer]  # relative to fp32 parameter bytes
    if quantization in ("8bit", "4bit"):
        terms = {term: skeleton.count(lambda m, term=term: quantize.weight_bytes(m, quantization)[term])
                 for term in quantize.weight_bytes(skeleton.model, quantization)}
        terms["dequantized_layer"] = quantize.dequantize_buffer(skeleton.model, precision)
    else:
        terms = {"weights": skeleton.count(lambda m: _bytes(m.parameters()))}
    terms["optimizer_state"] = int(state_per_byte * gradients)
    return terms


def lower_bound(skeleton: Skeleton, *, optimizer: str, precision: str, device: str, shards: int = 1,
                quantization: str = "none") -> int:
    """A peak that `estimate` never goes below, from the fixed terms alone (each process's share of them, and
    their overhead): when it is over the budget, no micro-batch of this rung fits, and no dry run is needed to
    say so (an 8 B model's full fine-tuning rungs at 24 GiB: their weights and AdamW state alone are 96 GiB)."""
    terms = fixed_terms(skeleton, optimizer=optimizer, precision=precision, quantization=quantization)
    tensors = sum(math.ceil(v / shards) if k in SHARDED_TERMS else v for k, v in terms.items())
    return tensors + overhead(tensors, device)


REUSED_SKELETONS = 4  # skeletons (and their dry runs) a process keeps for its next plans: `--longest` and the plan
_reused: OrderedDict[tuple, tuple[Skeleton, dict]] = OrderedDict()


def reused_skeleton(c: Config, num_labels: int, *, checkpointing: bool, lora: bool, precision: str,
                    offload: bool = False, tiled: bool = False) -> tuple[Skeleton, dict]:
    """`model_skeleton`, and a dict for the dry runs made on it (`estimate`'s `windows`), shared by the plans this
    process makes of the same model (`finetune plan --longest` asks twice, the GUI asks again and again). A model
    whose config.json is not on disk, or that runs its own code, is built afresh each time."""
    model_config = plancache.model_config_bytes(c)
    key = None if model_config is None else (
        hashlib.sha256(model_config).hexdigest(), c.model, c.task, num_labels, checkpointing, lora, precision,
        offload, tiled, c.tiled_mlp_tile, c.segment_recurrence, c.lora_r,
        c.lora_alpha, c.lora_dropout, repr(c.lora_target_modules), c.train_vision_tower)
    if key in _reused:
        _reused.move_to_end(key)
        return _reused[key]
    built = model_skeleton(c, num_labels, checkpointing=checkpointing, lora=lora, precision=precision,
                           offload=offload, tiled=tiled), {}
    if key is not None:
        _reused[key] = built
        while len(_reused) > REUSED_SKELETONS:
            _reused.popitem(last=False)
    return built


def reference_inputs(skeleton: Skeleton, cuda: bool, micro: int, tokens: int, precision: str,
                     data_tokens: int = 0) -> dict[str, Any]:
    """What a kind's `plan_reference` reads: the model's parameter bytes (fp32: the reference is a whole model,
    whatever rung stores the trained one), the device, the worst-case micro-batch, and the model's config with its
    real number of layers (`layers`; 0 when the skeleton was built whole), the plan's resolved precision, and the
    training data's tokens (`data_tokens`; 0 where not known)."""
    model = skeleton.model
    weights = skeleton.count(lambda m: sum(p.numel() for p in m.parameters()) * 4)
    config = getattr(model, "config", None)
    return {"weights": weights, "cuda": cuda, "micro": micro, "tokens": tokens,
            "vocab": getattr(config, "vocab_size", 0) or 0, "model_config": config, "layers": skeleton.layers,
            "precision": precision, "data_tokens": data_tokens}


def kind_for(c: Config, lora: bool) -> TaskKind:
    """The run's kind as a rung with or without LoRA trains it (LoRA can change its reference)."""
    spelled = str(lora).lower()
    return configured(c if c.lora == spelled else c.replace(lora=spelled))


def rung_kind(c: Config, skeleton: Skeleton, *, chunked: bool, lora: bool) -> TaskKind:
    """The kind a rung's dry run runs: the kind's chunked variant (`chunked_variant`) on a rung that computes the loss
    in chunks, where the model can; else the run's kind as the rung trains it (`kind_for`)."""
    chunks = kind_named(c.task).chunked_variant() if chunked else None
    if chunks is not None and chunks.unsupported(skeleton.model) is None:
        return chunks.kind
    return kind_for(c, lora)


def kind_terms(kind: TaskKind, skeleton: Skeleton, *, cuda: bool, micro: int, tokens: int, precision: str,
               window: int) -> dict[str, int]:
    """What a kind's plan hooks add to the dry run's terms, for every question the planner answers (a plan, the
    longest context, the smallest budget): a reference model's weights when one sits beside the model
    (`plan_reference`), a loss over the whole window of `window` samples, its embeddings and scores, resident
    (`plan_window`), and what the micro-batch's inputs cost that random tokens do not (`plan_inputs`: a vision
    tower's activations on its images)."""
    terms: dict[str, int] = {}
    if (reference := kind.plan_reference(**reference_inputs(skeleton, cuda, micro, tokens, precision))) is not None:
        terms |= reference[0]
    terms |= kind.plan_inputs(getattr(skeleton.model, "config", None), micro, tokens, precision)
    terms |= kind.plan_window(window, getattr(getattr(skeleton.model, "config", None), "hidden_size", 0) or 0)
    return terms


def worst_case_tokens(c: Config, lengths: Any) -> int:
    """The longest sample (a list or a numpy array of lengths), or `max_length` when the lengths are not known yet
    (a stream before its first window)."""
    # numpy's max: Python's iterates a 6 M-sample array element by element (a quarter of a second per pass).
    # A kind that generates (GRPO) trains on the prompt and its completion.
    generated = configured(c).generated_tokens
    return (int(np.max(lengths)) if len(lengths) else c.max_length) + generated


def may_pad(lengths: Any) -> bool:
    """Whether the samples differ in length (or are not known yet, a stream), so that a micro-batch of two or more
    holding the longest can be padded: the worst case then carries the attention mask that padding makes the model
    build, and an unpadded one does not."""
    return not len(lengths) or int(np.min(lengths)) < int(np.max(lengths))


def check_generated_positions(c: Config, model_config: Any, longest_prompt: int | None) -> None:
    """A `PlanError` when a generating kind's sequences (the longest prompt and `max_completion_length`, to which
    every completion is padded) need more positions than the model learned (GPT-2's `n_positions`): the first
    generation or dry run would fail deep in the position embedding. Without the data (a stream), only a completion
    that alone cannot fit is refused."""
    generated = configured(c).generated_tokens
    limit = absolute_position_limit(model_config)
    if not generated or limit is None:
        return
    needed = generated + (longest_prompt or 0)
    if needed <= limit:
        return
    if longest_prompt:
        what = (f"The longest prompt ({longest_prompt} tokens) and max_completion_length ({generated}) make "
                f"{needed} positions")
    else:
        what = f"max_completion_length ({generated}) needs {needed} positions"
    room = limit - (longest_prompt or 0)
    fix = f"set max_completion_length to at most {room}" if room > 0 else "shorten the prompts (max_length)"
    raise PlanError([f"{what}, but {c.model!r} learned positions only up to {limit}: {fix}, or use a model with a "
                     "longer context."])


def vocab_size(c: Config) -> int:
    """The model's vocabulary size, from its config alone."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(c.model), trust_remote_code=c.trust_remote_code)
    return getattr(config.get_text_config(), "vocab_size", 0) or 0
