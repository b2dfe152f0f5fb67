"""`finetune doctor`'s self-test on a device: one window of a tiny Llama-shaped model in each precision the device
has, the window's gradient split into k micro-batches of B against one batch of k·B (the project's promise), and the
planner's predicted peak against the measured one.

The window runs through the loop's own functions (`finetune.engine.step.backward_window` under accelerate's
`Accelerator`), on samples of different lengths, so padding and the exact loss normalisation are exercised too. The
model is built from a config (random weights, nothing downloaded) and saved to a temporary folder for the planner.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

from finetune.config.schema import from_dict
from finetune.data.load import IGNORE_INDEX
from finetune.engine.runtime import make_accelerator
from finetune.engine.step import backward_window
from finetune.models.pretrained import load_model, prepare_for_training, quiet_transformers
from finetune.plan.memory import measure_window
from finetune.plan.planner import estimate
from finetune.plan.skeleton import model_skeleton
from finetune.registry import kind

SHAPE = {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256, "tie_word_embeddings": False}
LENGTHS = [5, 31, 12, 24, 9, 17, 3, 28]  # one window of 8 samples: k = 4 micro-batches of B = 2 against 8 × 1
MICRO = 2
# How far the two splits' gradients may differ (relative norm of the difference): fp32 only by summation order; a
# half precision rounds each micro-batch's matmuls on its own padding, so its split changes the rounding.
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}
PEAK_WITHIN = (-0.05, 0.10)  # the planner's accuracy target (docs/memory.md): predicted −5 % … +10 % of measured
PEAK_TOKENS, PEAK_MICRO, PEAK_ACCUM = 64, 2, 2
TASK = "causal_lm"  # the kind whose window the self-test trains: a tiny Llama, the shape most runs have


@dataclass(frozen=True)
class WindowCheck:
    """One precision's window: the relative difference of the split's gradient, its bound, and the loss."""

    precision: str
    relative_difference: float
    tolerance: float
    loss: float
    seconds: float

    @property
    def ok(self) -> bool:
        """Whether the split trained like the big batch (and the loss is a number)."""
        return self.relative_difference <= self.tolerance and self.loss == self.loss


@dataclass(frozen=True)
class PeakCheck:
    """The planner's predicted peak of one window against the measured one (bytes), on `device`."""

    device: str
    predicted: int
    measured: int

    @property
    def error(self) -> float:
        """Predicted over measured, less one."""
        return self.predicted / self.measured - 1 if self.measured else 0.0

    @property
    def ok(self) -> bool:
        """Whether the prediction is within the planner's accuracy target."""
        return PEAK_WITHIN[0] <= self.error <= PEAK_WITHIN[1]


def precisions(device: str) -> list[str]:
    """The precisions a device trains in: fp32 everywhere, bf16 where supported, fp16 on a CUDA GPU."""
    if device.startswith("cuda"):
        return ["fp32", *(["bf16"] if torch.cuda.is_bf16_supported() else []), "fp16"]
    return ["fp32", "bf16"]


def build_model(folder: str) -> str:
    """The tiny model, saved (fp32, random weights from a fixed seed) where the loader and the planner read it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE, pad_token_id=0, eos_token_id=1, bos_token_id=2)).save_pretrained(folder)
    return folder


def _samples() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g) for n in LENGTHS]


def _collate(data: list[torch.Tensor], indices: list[int]) -> dict[str, torch.Tensor]:
    width = max(len(data[i]) for i in indices)
    ids = torch.zeros((len(indices), width), dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, IGNORE_INDEX)
    for row, i in enumerate(indices):
        n = len(data[i])
        ids[row, :n], mask[row, :n], labels[row, :n] = data[i], 1, data[i]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _gradient(model_dir: str, precision: str, micro: int, device: str) -> tuple[torch.Tensor, float]:
    """The window's gradient (flattened, fp64) and loss with micro-batches of `micro` samples."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM

    AcceleratorState._reset_state(True)  # each precision is a new Accelerator in this one process
    GradientState._reset_state()
    accelerator = make_accelerator(precision)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, use_kernels=False).to(device)
    model.train()
    model = accelerator.prepare(model)
    data = _samples()
    window = list(range(len(data)))
    chunks = [window[i:i + micro] for i in range(0, len(window), micro)]
    count = sum(n - 1 for n in LENGTHS)  # positions that predict a next token
    loss = backward_window(model, chunks, lambda mb: _collate(data, mb), count, accelerator, kind=kind(TASK))
    grad = torch.cat([p.grad.detach().double().flatten().cpu() for p in model.parameters() if p.grad is not None])
    return grad, float(loss.sum()) / count


def window_check(model_dir: str, precision: str, device: str) -> WindowCheck:
    """k micro-batches of B against one batch of k·B, in `precision` on `device`."""
    start = time.perf_counter()
    split, loss = _gradient(model_dir, precision, MICRO, device)
    whole, _ = _gradient(model_dir, precision, len(LENGTHS), device)
    difference = float((split - whole).norm() / whole.norm().clamp_min(1e-30))
    return WindowCheck(precision, difference, TOLERANCE[precision], loss, time.perf_counter() - start)


def peak_check(model_dir: str, device: str) -> PeakCheck:
    """The dry run's predicted peak of a full fine-tuning window against the measured one (CUDA: the allocator's
    peak, without the CUDA context and slack the plan adds; CPU: the live-tensor tracker's)."""
    c = from_dict({"model": model_dir, "task": TASK, "precision": "fp32", "optimizer": "adamw",
                   "max_length": PEAK_TOKENS, "lora": "false", "gradient_checkpointing": "false",
                   "quantization": "none", "kernels": "off"})
    skeleton = model_skeleton(c, 0, checkpointing=False, lora=False, precision="fp32")
    terms = estimate(skeleton, c, kind=kind(TASK), micro=PEAK_MICRO, tokens=PEAK_TOKENS, accum=PEAK_ACCUM,
                     precision="fp32", optimizer="adamw", device="cuda" if device.startswith("cuda") else "cpu")
    terms.pop("overhead", None)
    model = prepare_for_training(load_model(c), c, checkpointing=False, lora=False).to(device)
    measured = measure_window(model, c, micro=PEAK_MICRO, tokens=PEAK_TOKENS, accum=PEAK_ACCUM, precision="fp32")
    return PeakCheck(device, sum(terms.values()), measured)


def run(device: str) -> dict[str, Any]:
    """Every check on `device`: the windows (one per precision) and the peak."""
    quiet_transformers()
    with tempfile.TemporaryDirectory(prefix="finetune-doctor-") as folder:
        model_dir = build_model(folder)
        windows = [window_check(model_dir, p, device) for p in precisions(device)]
        peak = peak_check(model_dir, device)
    return {"windows": windows, "peak": peak}
