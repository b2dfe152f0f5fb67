"""Reusing a plan: the dry run of a model, a worst-case length and the planner's options is estimated once and
read back on the next start with the same inputs, instead of being run again (the dry run imports torch's compiler
stack for its fake tensors and builds the model from them: about 1.8 s of every start on a 2-core CPU, more than
the rest of setting up).

The key is everything the plan depends on: the model's config.json, the task and number of labels, the worst-case
length, every option the planner reads, the processes and how they share the model, the device, whether 8-bit
AdamW is available, the versions of torch, transformers and peft, and finetune's own planning code (so a change to
the planner is never answered from an old estimate). A model whose config.json is not on disk, or that runs its own
code (`trust_remote_code`), is never cached. Plans live in `$XDG_CACHE_HOME/finetune/plans/` (by default
`~/.cache/finetune/plans/`), one small JSON file each; deleting the folder is always safe.
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from finetune.config.schema import Config
from finetune.models.pretrained import resolve_model_path

# The options make_plan reads (directly or through the skeleton it builds); anything else cannot change a plan.
PLAN_OPTIONS = ("task", "max_length", "effective_batch_size", "micro_batch_size", "grad_accum_steps",
                "memory_budget_gb", "gradient_checkpointing", "lora", "lora_r", "lora_alpha", "lora_dropout",
                "lora_target_modules", "optimizer", "precision", "packing", "segment_recurrence", "memory_length",
                "quantization", "preference_loss", "reference_model", "precompute_reference", "streaming",
                "chunked_loss", "num_generations", "max_completion_length", "beta", "activation_offload",
                "tiled_mlp", "tiled_mlp_tile", "train_vision_tower",
                # Distillation: the teacher's size and where it runs, the divergence's (logits_bytes) form.
                "teacher_model", "distill_teacher", "distill_top_k", "distill_loss", "distill_beta",
                "num_iterations")  # num_iterations: the GRPO note says how often a window generates
# Paths under finetune/: every module of the planner, and those it dry-runs.
PLANNING_CODE = (*sorted(f"plan/{p.name}" for p in Path(__file__).parent.glob("*.py")), "models/pretrained.py",
                 "engine/losses.py", "config/batch.py", "engine/recurrence.py", "data/packing.py",
                 "models/quantize.py", "kinds/chunked.py", "kinds/causal_lm.py", "kinds/grpo/plan.py",
                 "kinds/grpo/loss.py", "kinds/distill.py", "kinds/vlm.py", "engine/offload.py", "models/tiled_mlp.py")
LIBRARIES = ("torch", "transformers", "peft")


def cache_dir() -> Path:
    """Where plans are kept: the user's cache folder (XDG_CACHE_HOME, the usual place for such caches)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "plans"


def model_config_bytes(c: Config) -> bytes | None:
    """The bytes of the model's config.json (a local folder, or the hub's copy in the local cache), or None."""
    if c.trust_remote_code:  # its own code may change without its config.json changing
        return None
    path = resolve_model_path(c.model)
    local = Path(path) / "config.json"
    if local.is_file():
        return local.read_bytes()
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(path, "config.json")
    return Path(cached).read_bytes() if isinstance(cached, str) else None


def _library_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def plan_key(c: Config, **inputs: Any) -> str | None:
    """The cache key of a plan for `c` and the planner's other `inputs` (worst-case tokens, labels, processes,
    device, …); None when the plan must not be cached."""
    model_config = model_config_bytes(c)
    if model_config is None:
        return None
    code = Path(__file__).parents[1]
    parts = {
        "model_config": hashlib.sha256(model_config).hexdigest(),
        "options": {name: getattr(c, name) for name in PLAN_OPTIONS},
        "inputs": inputs,
        "libraries": {name: _library_version(name) for name in LIBRARIES},
        "code": hashlib.sha256(b"".join((code / name).read_bytes() for name in PLANNING_CODE)).hexdigest(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(key: str | None) -> dict[str, Any] | None:
    """The plan stored under `key` (as `Plan.to_dict` wrote it), or None."""
    if key is None:
        return None
    try:
        return json.loads((cache_dir() / f"{key}.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not there, unreadable or cut short: plan again
        return None


def save(key: str | None, plan: dict[str, Any]) -> None:
    """Store a plan under `key`; a cache that cannot be written only costs the next start its dry run."""
    if key is None:
        return
    path = cache_dir() / f"{key}.json"
    # Every process of a launch plans the same, so each writes its own temporary file and renames it.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
