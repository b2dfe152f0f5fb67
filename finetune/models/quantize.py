"""Storing a LoRA run's frozen base model smaller: in the run's half dtype, or quantized by bitsandbytes (8-bit
LLM.int8 or 4-bit NF4 with double quantization: QLoRA). Adapters, trainable heads and their optimizer state stay in
fp32. The planner counts the same bytes (`weight_bytes`), and a quantized run's merged model is written in plain
weights any transformers install loads (`merged_model`).

A quantized base is frozen: quantization implies LoRA. transformers keeps the output head (and a tied embedding)
unquantized, and bitsandbytes quantizes every other `nn.Linear`; embeddings and norms stay in the load dtype.
Unlike peft's `prepare_model_for_kbit_training`, the unquantized frozen weights are not upcast to fp32: on a GPU
that would store a Llama-3-8B's embeddings and head (1 B parameters) in 4 GiB instead of 2, more than its 4-bit
layers take, which is what the budgets of 8 GiB and less cannot afford.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import torch

from finetune.building import BUILDS
from finetune.engine.runtime import quiet_bitsandbytes

QUANTIZATIONS = ("auto", "none", "8bit", "4bit")
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
NF4_BLOCK = 64  # bitsandbytes' 4-bit block: one absmax constant per 64 weights
NESTED_BLOCK = 256  # double quantization: the absmax constants are themselves 8-bit, one fp32 scale per 256
QUANTIZATION_FILE = "quantization.json"  # beside a saved adapter: how its base was loaded in training


def available() -> bool:
    """Whether bitsandbytes is installed (it runs on CUDA and, since 0.4x, on CPU). Asked without importing it: the
    import takes 2 to 4 s and logs its CPU kernels' notes, and the planner asks in every run."""
    return importlib.util.find_spec("bitsandbytes") is not None


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype a run computes in: its half dtype under mixed precision, else fp32."""
    return HALF.get(precision, torch.float32)


def base_dtype(precision: str, lora: bool) -> torch.dtype:
    """The dtype the frozen base is stored in: the run's half dtype under LoRA with mixed precision, else fp32
    (full fine-tuning keeps fp32 master weights: the optimizer updates them)."""
    return HALF.get(precision, torch.float32) if lora else torch.float32


def bnb_config(quantization: str, precision: str) -> Any:
    """transformers' `BitsAndBytesConfig` for `8bit` or `4bit` (NF4, double quantization, the run's compute
    dtype)."""
    from transformers import BitsAndBytesConfig

    if quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=compute_dtype(precision))
    return BitsAndBytesConfig(load_in_8bit=True)


def load_kwargs(quantization: str, precision: str, lora: bool) -> dict[str, Any]:
    """The `from_pretrained` arguments that store the base as the plan says (dtype, quantization)."""
    kwargs: dict[str, Any] = {"dtype": base_dtype(precision, lora or quantization in ("8bit", "4bit"))}
    if quantization in ("8bit", "4bit"):
        quiet_bitsandbytes()
        kwargs["quantization_config"] = bnb_config(quantization, precision)
    return kwargs


def unquantized_layers(model: Any) -> list[str]:
    """The layers bitsandbytes replaced whose weight is still a plain tensor: layers the checkpoint lacks (a BERT's
    language-model head, loaded as a causal LM), which transformers creates after quantizing."""
    return [name for name, module in model.named_modules() if type(module).__module__.startswith("bitsandbytes")
            and type(getattr(module, "weight", None)) is torch.nn.Parameter]


def upcast_trainable(model: Any) -> Any:
    """Trainable parameters (adapters, a classifier head peft trains in full) in fp32 over a half base: the
    optimizer updates them, and half-precision master weights would lose small updates."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32 and p.is_floating_point():
            p.data = p.data.float()
    return model


def _quantized_linears(model: Any) -> list[torch.nn.Linear]:
    """The `nn.Linear` layers bitsandbytes would quantize: all but the output head (transformers keeps it)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = {id(head)} if head is not None else set()
    for name in ("score", "classifier"):  # a classification head is trained in full
        module = getattr(model, name, None)
        if module is not None:
            skip |= {id(m) for m in module.modules()}
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and id(m) not in skip
            and not _is_adapter(m)]


def _is_adapter(module: Any) -> bool:
    return any(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in module.parameters(recurse=False))


def weight_bytes(model: Any, quantization: str) -> dict[str, int]:
    """The weights of a (skeleton) model as a quantized run stores them: the quantized linear weights, their
    constants, and everything else (embeddings, norms, output head, biases, adapters) as the model holds it.

    Per 4-bit weight: half a byte, plus an 8-bit absmax per block of 64 and an fp32 scale per 256 blocks (double
    quantization), plus each layer's two code books; per 8-bit weight: one byte, plus an fp32 scale per output
    row."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = _quantized_linears(base)
    quantized_ids = {id(m.weight) for m in layers}
    rest = {p.untyped_storage()._cdata: p.numel() * p.element_size()
            for p in [*model.parameters(), *model.buffers()] if id(p) not in quantized_ids}
    quantized = constants = 0
    for m in layers:
        n = m.weight.numel()
        if quantization == "4bit":
            blocks = math.ceil(n / NF4_BLOCK)
            quantized += math.ceil(n / 2)
            constants += blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + 4 * (16 + 256)
        else:
            quantized += n
            constants += 4 * m.weight.shape[0]
    return {"weights": sum(rest.values()), "quantized_weights": quantized, "quantization_constants": constants}


def dequantize_buffer(model: Any, precision: str) -> int:
    """Bytes of the largest quantized layer dequantized for its matmul (one at a time, freed after each)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    sizes = [m.weight.numel() for m in _quantized_linears(base)]
    return max(sizes, default=0) * torch.empty((), dtype=compute_dtype(precision)).element_size()


def save_quantization(folder: Path, quantization: str, precision: str) -> None:
    """Record beside an adapter how its base was quantized in training, so that using it loads the same base."""
    (Path(folder) / QUANTIZATION_FILE).write_text(json.dumps({"quantization": quantization, "precision": precision}),
                                                  encoding="utf-8")


def saved_quantization(folder: Path) -> dict[str, str] | None:
    """What `save_quantization` wrote, or None for an adapter trained on an unquantized base."""
    path = Path(folder) / QUANTIZATION_FILE
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def quantization_of(model: Any) -> tuple[str, str] | None:
    """(8bit or 4bit, the run's precision) of a model whose base bitsandbytes quantized, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    q = getattr(base.config, "quantization_config", None)
    if q is None:
        return None
    q = q if isinstance(q, dict) else q.to_dict()
    if q.get("load_in_4bit"):
        dtype = q.get("bnb_4bit_compute_dtype")
        return "4bit", {"bfloat16": "bf16", "float16": "fp16"}.get(str(dtype).removeprefix("torch."), "fp32")
    return "8bit", {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(_unquantized_dtype(base), "fp32")


def _unquantized_dtype(model: Any) -> torch.dtype:
    embeddings = model.get_input_embeddings()
    return embeddings.weight.dtype if embeddings is not None else torch.float32


def plain_config(config: Any) -> Any:
    """A model config without its `quantization_config`: saved beside an adapter, a base loaded with it would be
    taken for a checkpoint already quantized."""
    return config.__class__.from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})


def merged_model(peft_model: Any) -> Any:
    """A quantized run's model with its adapter merged, in plain weights of the dtype its unquantized weights
    have (the run's half dtype on a GPU, fp32 on a CPU run): each quantized layer is
    dequantized (the weights the adapter was trained against), the adapter's update added, and the result is a
    model of ordinary `nn.Linear` layers that loads without bitsandbytes.

    (peft's own merge into a quantized layer quantizes the merged weight again, which rounds most of a small
    adapter update away.)"""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    base = peft_model.get_base_model()
    auto = AutoModelForCausalLM if peft_model.peft_config["default"].task_type == "CAUSAL_LM" \
        else AutoModelForSequenceClassification
    config = plain_config(base.config)
    dtype = _unquantized_dtype(base)
    with BUILDS:
        plain = auto.from_config(config, dtype=dtype)
    modules = dict(base.named_modules())
    state: dict[str, torch.Tensor] = {}
    for name, param in base.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        value = _effective_weight(modules[owner], dtype) if leaf == "weight" else param.detach()
        state[name.replace(".base_layer", "")] = value.float()
    for name, module in modules.items():
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):  # a LoRA layer
            state[f"{name}.weight"] = state[f"{name}.weight"] + module.get_delta_weight("default").float()
    missing, unexpected = plain.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"Merging the quantized model left weights unset ({missing[:3]}) or unused "
                           f"({unexpected[:3]}).")
    return plain


def _effective_weight(layer: Any, dtype: torch.dtype, rows: int = 1024) -> torch.Tensor:
    """The weight a layer computes with: for a quantized layer, its outputs for the identity matrix (less the
    bias), which is exactly what its kernels multiply by, whatever their storage layout (bitsandbytes repacks a
    4-bit weight for its CPU kernel on the first forward, after which its own dequantize no longer reads it)."""
    weight = layer.weight
    if type(weight).__name__ not in ("Params4bit", "Int8Params"):
        return weight.detach()
    device = weight.device
    eye = torch.eye(layer.in_features, dtype=dtype, device=device)
    with torch.no_grad():
        out = torch.cat([layer(eye[i:i + rows]).float() for i in range(0, layer.in_features, rows)])
        if layer.bias is not None:
            out -= layer.bias.float()
    return out.T.contiguous()
