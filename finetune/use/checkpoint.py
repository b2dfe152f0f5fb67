"""A run's checkpoint used as a model: `finetune predict RUN/checkpoints/step-0000040` and `finetune export` of one.

A checkpoint is accelerate's state (the model's tensors, the optimizer's, the random state), not a folder
`from_pretrained` reads: the first use builds the model as the run built it (its config.yaml: the kind, LoRA, the
class names from its data), loads the checkpoint's tensors into it and saves it as a model folder beside them
(`CHECKPOINT/model/`), which every later use reads as it reads a finished run's model. A run keeps its last few
checkpoints only while it is stopped or failed: a finished run removes them (`finetune.train.loop`).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file

from finetune.config.schema import from_dict, read_yaml
from finetune.data.load import load_data
from finetune.errors import ModelError
from finetune.models.pretrained import load_model, load_tokenizer, prepare_for_training, resolve_model_dir, save_model
from finetune.registry import kind
from finetune.run.rundir import MARKER, TRAINER_STATE

MODEL_DIR = "model"  # inside the checkpoint: the model folder written on first use
SAVED = ("config.json", "adapter_config.json")


def run_of_checkpoint(path: Path) -> Path | None:
    """The run folder of checkpoint `path` (RUN/checkpoints/step-…/), or None when `path` is not one."""
    path = Path(path)
    run_dir = path.parent.parent
    if path.parent.name == "checkpoints" and (path / TRAINER_STATE).is_file() and (run_dir / MARKER).is_file():
        return run_dir
    return None


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step a checkpoint folder was written after (`step-0000040` → 40), or None."""
    name = Path(path).name
    return int(name[5:]) if name.startswith("step-") and name[5:].isdigit() else None


def resolve(target: str) -> tuple[Path, Path | None]:
    """(model folder, run folder or None) for a run, a saved model folder or a run's checkpoint (whose model folder
    is written on first use: `checkpoint_model`)."""
    run_dir = run_of_checkpoint(Path(target).expanduser())
    if run_dir is None:
        return resolve_model_dir(target)
    return checkpoint_model(Path(target).expanduser()), run_dir


def checkpoint_model(path: Path) -> Path:
    """The model folder of checkpoint `path`: written beside its tensors the first time (see the module)."""
    out = path / MODEL_DIR
    if any((out / name).is_file() for name in SAVED):
        return out
    run_dir = path.parent.parent
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"Checkpoint {str(path)!r} has no model.safetensors (a sharded or multi-task run's "
                         "checkpoint cannot be used as a model yet): resume the run to the end, then use it.")
    c = from_dict(read_yaml(run_dir / "config.yaml"))
    tokenizer = load_tokenizer(c)
    # A classifier's head is sized and named by the classes its data has, as training found them.
    labels = load_data(c, tokenizer, num_processes=1)[2] if kind(c.task).model_kwargs(["a", "b"]) else None
    model = prepare_for_training(load_model(c, labels), c, checkpointing=False, lora=c.lora == "true")
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied weight (an LM head that is the embedding) is saved once: the only kind of tensor allowed to be missing.
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded]
    if unexpected or untied:
        raise ModelError(f"Checkpoint {str(path)!r} does not match the model of the run's config.yaml "
                         f"({len(unexpected)} unexpected, {len(untied)} missing tensors): resume the run to the "
                         "end, then use it.")
    # A staging folder of its own: two uses at once (Try it's pick and its Predict) each write theirs, and the first
    # rename wins.
    staging = Path(tempfile.mkdtemp(prefix=".model-", dir=path))
    try:
        save_model(model.eval(), tokenizer, staging)
        with contextlib.suppress(OSError):  # already there: the other use's
            (staging / MODEL_DIR).rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
