"""Models and tokenizers: loading them from the Hub, a local folder or the bundled MiniLM, preparing them for
training (gradient checkpointing, LoRA), saving them and reading the saved ones back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.building import one_at_a_time
from finetune.config.modelpath import resolve_model_path
from finetune.config.schema import Config
from finetune.engine import offload as offloading
from finetune.engine.runtime import quiet_bitsandbytes, resolve_precision
from finetune.errors import ModelError
from finetune.models import kernels, quantize, tiled_mlp
from finetune.registry import entry, kind_of_model_config, kind_of_peft_task_type
from finetune.registry import kind as kind_named
from finetune.rows.chat import read_template


def quiet_transformers() -> None:
    """Keep transformers' progress bars, load reports and deprecation notes out of the user's terminal."""
    import warnings

    import transformers

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    quiet_bitsandbytes()  # peft imports it, when it is installed, for its quantized LoRA layers


def load_tokenizer(c: Config) -> Any:
    """The model's tokenizer (with `chat_template` when given); without a pad token it pads with end-of-sequence."""
    from transformers import AutoTokenizer

    quiet_transformers()
    path = resolve_model_path(c.model)
    own = kind_named(c.task).load_preprocessor(path, c.trust_remote_code)
    if own is not None:  # a kind whose inputs are not text (images): the model's own processor
        return own
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=c.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(load_failure(c.model, e)) from None
    if c.chat_template:  # saved with the tokenizer, so the trained model chats through the same template
        tokenizer.chat_template = read_template(c.chat_template)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"The tokenizer of {c.model!r} has neither a pad nor an end-of-sequence token.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_saved_preprocessor(model_dir: Path, task: str) -> Any:
    """The tokenizer saved beside a trained model, or the kind's own preprocessor (an image processor)."""
    from transformers import AutoTokenizer

    own = kind_named(task).load_preprocessor(str(model_dir))
    return own if own is not None else AutoTokenizer.from_pretrained(model_dir)


def auto_class(task: str) -> Any:
    """The transformers auto class of a task kind (AutoModelForSequenceClassification, AutoModelForCausalLM, …)."""
    import transformers

    return getattr(transformers, entry(task).auto_model)


def load_model(c: Config, label_names: list[str] | None = None) -> Any:
    """The task kind's model (its auto class and config, a classifier sized for `label_names`) with safetensors
    weights."""
    quiet_transformers()
    path = resolve_model_path(c.model)
    # fp32 master weights whatever the checkpoint's dtype: mixed precision casts copies, the optimizer needs fp32.
    # A frozen LoRA base needs no master weights: it is stored in the half dtype, or quantized (models/quantize.py).
    kwargs: dict[str, Any] = {"trust_remote_code": c.trust_remote_code, "use_safetensors": True,
                              **quantize.load_kwargs(c.quantization, resolve_precision(c.precision),
                                                     c.lora == "true")}
    kind = kind_named(c.task)
    head = kind.model_kwargs(label_names)
    if head:  # a head of the kind's own size replaces the checkpoint's
        kwargs.update(head, ignore_mismatched_sizes=True)
    auto = auto_class(c.task)
    try:
        model = kernels.load(lambda **k: auto.from_pretrained(path, **kwargs, **k), c.kernels, c.model)
    except ModelError:  # already said in the kernels' own words
        raise
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise ModelError(load_failure(c.model, e, c.task)) from None
    if c.quantization in ("8bit", "4bit") and (new := quantize.unquantized_layers(model)):
        # peft's quantized LoRA layers would fail on them with an AttributeError, after the plan
        raise ModelError(f"quantization={c.quantization} cannot quantize {c.model!r} as a {c.task} model: "
                         f"the checkpoint lacks {len(new)} layer(s) of that model ({', '.join(new[:3])}), which "
                         "transformers creates after quantizing (this checkpoint was not trained for this task): "
                         "pick a model trained for it, or set quantization=none.")
    if getattr(model.config, "pad_token_id", 0) is None:  # an image model's config has no token ids at all
        model.config.pad_token_id = model.config.eos_token_id
    # A kind that trains part of the model (an embedding model's encoder, not its pooler) says which; the modules its
    # configured kind keeps frozen (a vision tower) get no gradient.
    for name in kind.frozen_modules(model, c):
        model.get_submodule(name).requires_grad_(False)
    return kind.trained_model(model)


def prepare_for_training(model: Any, c: Config, *, checkpointing: bool, lora: bool, offload: bool = False,
                         tiled: bool = False) -> Any:
    """Turn on gradient checkpointing (with `offload`, its layers' inputs kept in CPU memory:
    `finetune.engine.offload`), wrap in LoRA adapters and (`tiled`) tile the MLPs by `tiled_mlp_tile` positions
    (`finetune.models.tiled_mlp`), the same way for the dry run and for training."""
    if checkpointing:
        enable_checkpointing(model)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = c.lora_target_modules
        modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
        task_type = entry(c.task).peft_task_type
        # peft trains a classifier head whole (`modules_to_save`) but keeps it out of all-linear only for SEQ_CLS:
        # keep it out for every kind whose head peft trains whole (TOKEN_CLS too), or both would wrap it.
        heads = [n for n in ("classifier", "score") if getattr(model, n, None) is not None] \
            if task_type != "CAUSAL_LM" else []
        # A kind peft has no task type for (images) names its new head to train whole, as peft's own do; the
        # modules the kind keeps frozen (a vision tower) get no adapters.
        excluded = (heads if modules == "all-linear" else []) + kind_named(c.task).frozen_modules(model, c)
        model = get_peft_model(model, LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                                                 target_modules=modules, task_type=task_type or None,
                                                 exclude_modules=excluded or None,
                                                 modules_to_save=(heads if not task_type else []) or None))
        quantize.upcast_trainable(model)
    if offload and checkpointing:
        offloading.enable(model)
    if tiled:  # on the MLP modules themselves, so below peft's wrapper and around its adapters
        tiled_mlp.enable(model, tiled_mlp.resolved_tile(c, model.config))
    return model


def enable_checkpointing(model: Any) -> None:
    """Gradient checkpointing with torch's non-reentrant checkpoint, by the name the installed transformers has: it
    renamed `gradient_checkpointing_enable` (which still works, with a FutureWarning) to
    `activation_checkpointing_enable` after 5.17."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_failure(name: str, error: Exception, task: str | None = None) -> str:
    """Why model `name` cannot be loaded (for `task`), in one sentence, from transformers' error (whose own text
    lists every configuration class it knows, or points into its code)."""
    text = str(error)
    if kernels.is_kernel_failure(error):
        return (f"Model {name!r} could not be loaded with the Hub's kernels ({text.splitlines()[0][:200]}): set "
                "kernels=off to load it without them.")
    if "Unrecognized configuration class" in text:
        return (f"Model {name!r} has no {task} head in Transformers: pick a model made for {task} "
                f"(or change `task`).")
    if "safetensors" in text.lower() or "model.safetensors" in text:
        return (f"Model {name!r} has no safetensors weights; only safetensors are loaded (pickled .bin files can run "
                "code): convert it or pick another model.")
    if "trust_remote_code" in text:
        return f"Model {name!r} needs its own code to run: set `trust_remote_code=true` if you trust its authors."
    return (f"Model {name!r} could not be loaded ({text.splitlines()[0][:200]}): check the hub id or folder "
            "(hub ids need a network connection).")


def save_model(model: Any, tokenizer: Any, run_dir: Path, merge_lora: bool = False,
               state_dict: dict[str, Any] | None = None) -> Path:
    """Save the final model (safetensors) and tokenizer to run_dir/model, loadable with `from_pretrained`.

    A LoRA model saves its adapter there (load it with peft's `AutoPeftModelFor…`); with `merge_lora` the adapter
    goes to run_dir/adapter and model/ gets the base model with the adapter merged in. `state_dict` is the full
    one gathered from a sharded (FSDP) model, saved instead of the model's own shards."""
    is_peft = hasattr(model, "peft_config")
    target = run_dir / ("adapter" if is_peft and merge_lora else "model")
    target.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(target, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(target)
    quantized = quantize.quantization_of(model)
    if is_peft:  # the base config beside the adapter keeps the run's label names and head size
        quantize.plain_config(model.get_base_model().config).save_pretrained(target)
    if quantized:  # using the adapter loads its base quantized as in training
        quantize.save_quantization(target, *quantized)
    if is_peft and merge_lora:
        # A quantized base is dequantized into plain weights of its unquantized dtype (models/quantize.py).
        merged = quantize.merged_model(model) if quantized else model.merge_and_unload()
        merged.save_pretrained(run_dir / "model", safe_serialization=True)
        tokenizer.save_pretrained(run_dir / "model")
    return run_dir / "model"


def is_adapter(model_dir: Path) -> bool:
    """Whether a saved model folder holds a LoRA adapter rather than full weights."""
    return (Path(model_dir) / "adapter_config.json").is_file()


@one_at_a_time
def load_trained(model_dir: Path, task: str, kernels_mode: str = "auto") -> Any:
    """A model saved by a run: full weights, or a LoRA adapter on its base model (with the run's labels); hub
    kernels as `kernels_mode` says (the `kernels` option)."""
    from transformers import AutoConfig

    quiet_transformers()
    auto = auto_class(task)
    if not is_adapter(model_dir):
        return kernels.load(lambda **k: auto.from_pretrained(model_dir, use_safetensors=True, **k), kernels_mode,
                            str(model_dir))
    from peft import PeftModel

    base_path = json.loads((Path(model_dir) / "adapter_config.json").read_text())["base_model_name_or_path"]
    config = AutoConfig.from_pretrained(model_dir)
    saved = quantize.saved_quantization(model_dir)
    kwargs = quantize.load_kwargs(saved["quantization"], saved["precision"], True) if saved else {}
    base = kernels.load(lambda **k: auto.from_pretrained(base_path, config=config, use_safetensors=True,
                                                         ignore_mismatched_sizes=True, **kwargs, **k),
                        kernels_mode, base_path)
    return PeftModel.from_pretrained(base, model_dir)


def resolve_model_dir(target: str) -> tuple[Path, Path | None]:
    """(model folder, run directory or None) for a run directory or a saved model folder."""
    path = Path(target).expanduser()
    # tasks.json: a multi-task model (finetune.models.heads)
    saved = ("config.json", "adapter_config.json", "tasks.json")
    if any((path / "model" / name).is_file() for name in saved):
        return path / "model", path
    if any((path / name).is_file() for name in saved):
        return path, None
    if (path / "config.yaml").is_file():
        raise ModelError(f"The run in {target!r} has no final model yet (it stopped or is still training): resume "
                         "it, or point at another run.")
    raise ModelError(f"{target!r} is neither a run directory nor a model folder (no config.json): check the path.")


def task_of(model_dir: Path) -> str:
    """The task kind of a saved model, from its architecture (or the adapter's task type)."""
    if is_adapter(model_dir):
        task_type = json.loads((model_dir / "adapter_config.json").read_text(encoding="utf-8")).get("task_type")
        # The base config saved beside the adapter tells apart kinds that share a task type (by `problem_type`
        # and the output's name).
        config = model_dir / "config.json"
        saved = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
        return kind_of_peft_task_type(task_type, problem_type=saved.get("problem_type"), model_config=saved)
    return kind_of_model_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))


def saved_label_names(model_dir: Path) -> list[str]:
    """The class names a saved classifier was trained with, in id order."""
    id2label = json.loads((model_dir / "config.json").read_text(encoding="utf-8")).get("id2label") or {}
    return [id2label[k] for k in sorted(id2label, key=int)]
