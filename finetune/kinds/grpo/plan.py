"""What GRPO adds to the planner (the `PlanTerms` role): generation's KV cache and forward passes, the reference,
and the completions' logits."""

from __future__ import annotations

from typing import Any

import torch

from finetune.config.batch import resolve_batch
from finetune.config.schema import Config
from finetune.kinds.grpo.settings import GroupSettings


class GroupPlan(GroupSettings):
    """The plan's terms and note of a GRPO run."""

    def plan_note(self, c: Config) -> str:
        """How long generation makes a step, in forward passes of the model: each prompt's G completions are
        generated together, a token at a time, and the prompts one after another (6 steps of a tiny model took 198 s
        on a CPU at the default length of 256, and nothing said why)."""
        prompts = max(1, resolve_batch(c).effective_batch_size // max(c.num_generations, 1))
        when = "each optimizer step" if c.num_iterations == 1 else f"every {c.num_iterations} optimizer steps"
        return (f"Generation: {when} generates {prompts} prompt(s) × {c.num_generations} completions of up to "
                f"{c.max_completion_length} tokens, a token at a time: up to {prompts * c.max_completion_length:,} "
                "forward passes of the model one after another before its backward (a completion that ends sooner "
                "stops sooner), the step's longest part on a CPU; lower max_completion_length for shorter steps.")

    @property
    def generated_tokens(self) -> int:
        """Tokens a training sequence has beyond its prompt: the completion's."""
        return self.completion_length

    def synthetic_labels(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Labels of a micro-batch of completions, each its own group (the values do not matter to the memory)."""
        width = 3 * self.completion_length + 1 + len(self.rewards)
        labels = torch.zeros((input_ids.shape[0], 1, width), device=input_ids.device)
        labels[..., self.completion_length:2 * self.completion_length] = float("nan")
        return labels

    def logits_bytes(self, micro: int, tokens: int, vocab: int, num_labels: int) -> int:
        """The completions' float32 logits, their log-softmax and its gradient."""
        return 3 * micro * min(tokens, self.completion_length + 1) * vocab * 4

    def plan_reference(self, *, weights: int, cuda: bool, micro: int, tokens: int, vocab: int,
                       model_config: Any = None, layers: int = 0, precision: str = "fp32", data_tokens: int = 0
                       ) -> tuple[dict[str, int], dict[str, Any], str | None]:
        """What generation and the reference cost the plan beside one micro-batch's graph (which the dry run
        counts): the peak terms, the record plan.json keeps and the plan's note. `tokens` is the longest prompt and
        its completion, `micro` the micro-batch's completions, `weights` the model's parameter bytes in fp32.

        Generation's KV cache (a group at a time) lives before the window's backward, never beside its graph: added
        to the graph's peak, it is an upper bound. The reference's no-grad forward runs then too, and is the size
        of the no-grad forward every micro-batch makes anyway (`embed`, before its replay with a graph), smaller
        than the graph's window (`reference_forward_bytes`; the last window's gradients are freed by then): it adds
        nothing. A frozen copy's weights stay resident and are counted."""
        half = precision in ("bf16", "fp16")  # the plan's resolved compute dtype, the cache's
        cache = kv_cache_bytes(model_config, self.generations * tokens, 2 if half else 4, layers=layers)
        terms = {"generation_cache": cache}
        words = (f"Generation: the KV cache of {self.generations} × {tokens} tokens (num_generations × the longest "
                 f"prompt and max_completion_length), {cache / 2**20:.1f} MiB, counted on top of the graph (generation "
                 "runs before the backward: an upper bound)")
        generation = max(micro, self.generations)  # a micro-batch of part of a group: the group is generated whole
        if generation > micro:
            words += (f"; the generation batch ({generation} completions, whole groups) is generated and scored "
                      f"before it is cut into micro-batches of {micro}")
        if not self.beta:
            return terms, {"strategy": "none"}, words + "; no reference (beta is 0)."
        forward = self.reference_forward_bytes(generation, vocab, half)
        record: dict[str, Any] = {"strategy": "adapter_off" if self.lora else "frozen_copy",
                                  "reference_weights_bytes": 0, "reference_forward_bytes": forward}
        alone = (f"its no-grad forward ({forward / 2**20:.1f} MiB of logits, before the backward) fits in the "
                 "graph's peak")
        if generation > micro:  # over the generation batch, larger than the micro-batch whose graph the dry run takes
            terms["reference_forward"] = forward
            alone = (f"its no-grad forward over the generation batch ({forward / 2**20:.1f} MiB of logits, before "
                     "the backward) is counted on top of the graph (an upper bound)")
        if self.lora:
            return terms, record, words + f"; reference: the base with its LoRA adapter switched off (no second " \
                                          f"copy); {alone}."
        copy = weights // 4 * (2 if cuda else 4)  # `frozen_model` loads it in bf16 on a GPU
        terms["reference_weights"] = record["reference_weights_bytes"] = copy
        return terms, record, words + (f"; reference: a frozen copy of {self.model} beside the model "
                                       f"({copy / 2**30:.2f} GiB, counted); {alone}.")

    def reference_forward_bytes(self, micro: int, vocab: int, half: bool) -> int:
        """The peak of the reference's no-grad forward over a micro-batch (`embed`): the model's logits of t + 1
        positions (in the compute dtype) while the completions' t float32 logits over the temperature and their
        log-softmax are made."""
        t = self.completion_length
        return micro * vocab * ((t + 1) * (2 if half else 4) + 2 * t * 4)


def kv_cache_bytes(model_config: Any, tokens: int, dtype_bytes: int, layers: int = 0) -> int:
    """The bytes of a KV cache holding `tokens` positions (summed over the rows): per layer a key and a value of
    `num_key_value_heads` × `head_dim` each. `layers` overrides the config's count (the planner's skeleton of a
    deep model is built with fewer)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return (layers or text.num_hidden_layers) * 2 * kv_heads * head_dim * dtype_bytes * tokens
