"""The distillation case of the kind contract: a tiny GPT-2 student distilled from a wider tiny GPT-2 teacher on causal
LM's 27 texts (windows of 8: three and a tail of 3), counted per next-token target; the generalized JSD with some
plain next-token loss beside it, forward KL, and the teacher's top 8 cached before training. Both models share a
word-level tokenizer trained here on the texts' words (a vocabulary of 24: the divergence is over the whole vocabulary
at every position, which the bundled 30,522 would make the slowest case of the contract)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kind_cases import Case


def word_tokenizer():
    """A word-level tokenizer of the tests' words, with [CLS] in front and [SEP] as end of sequence, trained here."""
    from conftest import WORDS
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    backend = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=specials))
    backend.post_processor = processors.TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]",
                                   bos_token="[CLS]", eos_token="[SEP]")


def small_gpt2(path: Path, width: int, seed: int, tokenizer=None) -> str:
    """A 2-layer GPT-2 of `width` on the word tokenizer (or `tokenizer`), saved to `path`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tokenizer or word_tokenizer()
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=256, n_embd=width, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                     pad_token_id=tok.pad_token_id)
    GPT2LMHeadModel(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def word_student(tmp_path_factory) -> str:
    """The student: width 16."""
    return small_gpt2(tmp_path_factory.mktemp("word_student"), 16, seed=0)


@pytest.fixture(scope="session")
def word_teacher(tmp_path_factory) -> str:
    """The teacher: width 32, another seed."""
    return small_gpt2(tmp_path_factory.mktemp("word_teacher"), 32, seed=1)


CASE = Case(model="word_student", data="lm_csv", counts="token",
            values={"task": "distill", "max_length": 128, "learning_rate": 0.2}, batch=8, micro=2,
            fixtures={"teacher_model": "word_teacher"},
            variants={"jsd-alpha": {"distill_loss": "jsd", "distill_beta": 0.3, "distill_temperature": 2.0,
                                    "distill_alpha": 0.25},
                      "forward_kl": {"distill_loss": "forward_kl"},
                      # The teacher's top 8 of 26 tokens per position cached before training, the rest a tail bucket.
                      "cache-top8": {"distill_teacher": "cache", "distill_top_k": 8, "distill_loss": "jsd",
                                     "distill_beta": 0.3, "distill_temperature": 2.0}},
            predict=("good movie",), predicted=frozenset({"text", "generated"}))
