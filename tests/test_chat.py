"""Conversation data: exactly the assistant tokens (plus their end-of-turn token) carry labels, for a ChatML and a
Llama-3 template on locally built tokenizers; refusals; rows left out and counted; a CLI run; (B, k) ≡ (k·B, 1)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, WORDS, _causal_tokenizer, _save, assert_same_weights, run_train, step_losses
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune.cli import main
from finetune.config.schema import from_dict
from finetune.data.load import IGNORE_INDEX, collate, load_data
from finetune.errors import ConfigError, DataError, ModelError
from finetune.registry import kind

CHATML = (ROOT / "assets" / "chatml.jinja").read_text()
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""
END_OF_TURN = {"chatml": "<|im_end|>", "chatml_bpe": "<|im_end|>", "llama3": "<|eot_id|>"}
# Renders only alternating user/assistant conversations, as some real templates (Llama 2, Mistral) do.
STRICT = CHATML.replace("{%- for message in messages %}", "{%- for message in messages %}{%- if message['role'] "
                        "== 'system' %}{{ raise_exception('no system turns') }}{%- endif %}")
# Numbers turns from the end: an earlier turn renders differently once more follow (not incremental).
COUNTDOWN = CHATML.replace("message['role'] + '\\n'", "message['role'] + ' ' + loop.revindex|string + '\\n'")

CAUSAL = kind("causal_lm")


def _chatml_tokenizer():
    tok = _causal_tokenizer()  # the bundled WordPiece vocabulary, [SEP] as end of sequence
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def _llama3_tokenizer():
    """A byte-level BPE (as Llama 3's) trained here on the test words, with Llama 3's special tokens."""
    return _bpe_tokenizer(LLAMA3, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], eos="<|eot_id|>")


def _chatml_bpe_tokenizer():
    """ChatML on a byte-level BPE (as Qwen's), where the newline after <|im_end|> is a token of its own."""
    return _bpe_tokenizer(CHATML, ["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")


def _bpe_tokenizer(template: str, extra: list[str], eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", *extra]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([" ".join(WORDS + ["user", "assistant", "system"])] * 20, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token=eos,
                                  pad_token="<|end_of_text|>")
    tok.chat_template = template
    return tok


TOKENIZERS = {"chatml": _chatml_tokenizer, "chatml_bpe": _chatml_bpe_tokenizer, "llama3": _llama3_tokenizer}


def _tiny_chat_llama(tok, path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    return _save(LlamaForCausalLM(cfg), tok, path)


@pytest.fixture(scope="module")
def chat_llama(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer has the ChatML template and its special tokens."""
    return _tiny_chat_llama(_chatml_tokenizer(), tmp_path_factory.mktemp("chat_llama"))


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _conversations(n: int, seed: int = 4) -> list[list[dict[str, str]]]:
    """Conversations of 1 to 3 exchanges, some with a system turn, of very different lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": _sentence(rng, 3)}] if rng.random() < 0.4 else []
        for _ in range(rng.choice([1, 2, 3])):
            turns += [{"role": "user", "content": _sentence(rng, rng.choice([2, 8, 30]))},
                      {"role": "assistant", "content": _sentence(rng, rng.choice([1, 5, 20]))}]
        out.append(turns)
    return out


def _write_jsonl(path: Path, rows: list, key: str = "messages") -> str:
    path.write_text("".join(json.dumps({key: r}) + "\n" for r in rows))
    return str(path)


def _sharegpt(turns: list[dict[str, str]]) -> list[dict[str, str]]:
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return [{"from": names[t["role"]], "value": t["content"]} for t in turns]


def _encoded(tmp_path: Path, tok, rows: list, key: str = "messages", **values):
    from finetune.data.load import encode, load_table, resolve_columns

    c = from_dict({"task": "causal_lm", "max_length": 512, **values})
    table = load_table(_write_jsonl(tmp_path / f"{key}.jsonl", rows, key))
    return encode(table, resolve_columns(c, table.column_names), c, tok, None, "data.jsonl")


def _expected_learned(tok, style: str, turns: list[dict[str, str]], train_on: str) -> list[int]:
    """What must carry labels, built independently of the template: each learned assistant reply tokenised on its
    own, followed by the end-of-turn token."""
    replies = [t["content"] for t in turns if t["role"] == "assistant"]
    replies = replies[-1:] if train_on == "last_assistant" else replies
    eot = tok.convert_tokens_to_ids(END_OF_TURN[style])
    return [i for r in replies for i in tok(r, add_special_tokens=False)["input_ids"] + [eot]]


@pytest.mark.parametrize("style", ["chatml", "chatml_bpe", "llama3"])
@pytest.mark.parametrize("train_on", ["assistant", "last_assistant", "all"])
def test_exactly_the_assistant_tokens_carry_labels(tmp_path, style, train_on):
    tok = TOKENIZERS[style]()
    conversations = _conversations(12)
    data = _encoded(tmp_path, tok, conversations, train_on=train_on)
    assert len(data) == len(conversations) and not data.dropped
    batch = collate(data, list(range(len(data))), tok.pad_token_id, CAUSAL)
    for row, turns in enumerate(conversations):
        ids, labels = batch["input_ids"][row], batch["labels"][row]
        present = batch["attention_mask"][row].bool()
        full = tok(tok.apply_chat_template(turns, tokenize=False), add_special_tokens=False)["input_ids"]
        assert ids[present].tolist() == full
        learned = labels[labels != IGNORE_INDEX]
        if train_on == "all":
            assert learned.tolist() == full
            continue
        assert learned.tolist() == ids[labels != IGNORE_INDEX].tolist()
        assert learned.tolist() == _expected_learned(tok, style, turns, train_on)
        # Each learned run ends on the end-of-turn token and starts right after the assistant header.
        eot = tok.convert_tokens_to_ids(END_OF_TURN[style])
        on = (labels != IGNORE_INDEX).int()
        ends = torch.nonzero(on[:-1] - on[1:] == 1).flatten().tolist() + ([len(on) - 1] if on[-1] else [])
        assert all(ids[e] == eot for e in ends)
        if style == "chatml_bpe":  # the template's newline after <|im_end|> is a token, and it is not learned
            newline = tok("\n", add_special_tokens=False)["input_ids"]
            assert len(newline) == 1 and all(ids[e + 1] == newline[0] and labels[e + 1] == IGNORE_INDEX
                                             for e in ends if e + 1 < int(present.sum()))
    # The precomputed counts are what the loss divides by: the labelled next-token targets.
    assert data.num_targets(list(range(len(data))), CAUSAL) == int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())


def test_sharegpt_spelling_encodes_like_role_and_content(tmp_path):
    tok = _chatml_tokenizer()
    conversations = _conversations(6)
    plain = _encoded(tmp_path, tok, conversations)
    share = _encoded(tmp_path, tok, [_sharegpt(t) for t in conversations], key="conversations")
    assert share.rows["input_ids"] == plain.rows["input_ids"]
    assert share.rows["loss_mask"] == plain.rows["loss_mask"]


def test_rows_with_nothing_to_learn_are_left_out_and_counted(tmp_path):
    tok = _chatml_tokenizer()
    long_prompt = [{"role": "user", "content": "good " * 60}, {"role": "assistant", "content": "fine"}]
    no_reply = [{"role": "user", "content": "hello"}]
    system = [{"role": "system", "content": "be brief"}, *_conversations(1)[0]]
    good = [[{"role": "user", "content": "good movie"}, {"role": "assistant", "content": w}] for w in WORDS[:5]]
    tok.chat_template = STRICT
    data = _encoded(tmp_path, tok, [*good, long_prompt, no_reply, system], max_length=32)
    assert data.dropped == {"cut_by_max_length": 1, "no_assistant_turn": 1, "template_error": 1}
    assert len(data) == len(good) and min(data.num_targets([i], CAUSAL) for i in range(len(data))) > 0
    tok.chat_template = COUNTDOWN
    with pytest.raises(DataError, match="2 because the template renders their turns differently"):
        _encoded(tmp_path, tok, good[:2])  # each earlier turn's render changes as turns follow
    assert len(_encoded(tmp_path, tok, good, train_on="all")) == len(good)  # `all` needs no prefix renders
    with pytest.raises(DataError, match="None of the 1 conversation"):
        _encoded(tmp_path, tok, [no_reply], train_on="last_assistant")


def test_refusals(tmp_path, tiny_llama):
    tok = _chatml_tokenizer()
    with pytest.raises(DataError, match=r"Row 2 of 'data.jsonl', column 'messages', is not a conversation"):
        _encoded(tmp_path, tok, [_conversations(1)[0], "just text"])
    with pytest.raises(DataError, match="Row 1 .* is not a conversation"):
        _encoded(tmp_path, tok, [[{"content": "no role"}]])
    with pytest.raises(DataError, match="Row 2 .*\\[\\]"):
        _encoded(tmp_path, tok, [_conversations(1)[0], []])
    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(4))
    c = from_dict({"task": "causal_lm", "model": tiny_llama, "dataset": data})
    from finetune.models.pretrained import load_tokenizer

    with pytest.raises(ModelError, match="has no chat template .* set `chat_template`"):
        load_data(c, load_tokenizer(c))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(ConfigError, match="not valid Jinja"):
        load_tokenizer(c.replace(chat_template=str(bad)))
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(c.replace(chat_template=str(tmp_path / "nope.jinja")))
    with pytest.raises(ConfigError, match="`messages_column` is for task=causal_lm"):
        from_dict({"messages_column": "messages"})
    with pytest.raises(ConfigError, match="`train_on` must be one of assistant, all, last_assistant"):
        from_dict({"task": "causal_lm", "train_on": "user"})


def test_bad_chat_input_exits_2_with_one_sentence(capsys, tmp_path, tiny_llama):
    data = _write_jsonl(tmp_path / "chat.jsonl", [*_conversations(3), {"role": "user"}])
    code = main(["train", f"model={tiny_llama}", f"dataset={data}", "task=causal_lm",
                 f"chat_template={ROOT / 'assets' / 'chatml.jinja'}", f"output_dir={tmp_path / 'run'}", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: Row 4 of") and err.count("\n") == 1 and "Traceback" not in err
    code = main(["train", f"model={tiny_llama}", f"dataset={_write_jsonl(tmp_path / 'ok.jsonl', _conversations(3))}",
                 "task=causal_lm", f"output_dir={tmp_path / 'run2'}", "-q"])
    err = capsys.readouterr().err
    assert code == 2 and "chat_template" in err and err.count("\n") == 1


def test_accumulation_is_exact_on_conversations(tmp_path, chat_llama):
    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(19))
    common = {"model": chat_llama, "dataset": data, "task": "causal_lm", "effective_batch_size": 8,
              "shuffle": False, "group_by_length": False, "max_length": 256, "learning_rate": 0.2}
    big, big_events, _ = run_train(tmp_path / "big", micro_batch_size=8, epochs=1, **common)
    acc, acc_events, _ = run_train(tmp_path / "acc", micro_batch_size=2, epochs=1, **common)
    assert len(step_losses(big_events)) == 3  # 19 = 2 windows of 8 and a tail of 3
    assert_same_weights(big, acc)
    torch.testing.assert_close(step_losses(acc_events), step_losses(big_events), rtol=1e-5, atol=1e-6)


def test_cli_trains_on_a_jsonl_of_conversations_and_chats(capsys, tmp_path, tiny_llama):
    """A newcomer's path through the CLI's entry point: a base model without a template, the shipped ChatML file,
    then evaluating and chatting with the result."""
    rows = [*_conversations(14), [{"role": "user", "content": "hello"}]]  # the last has nothing to learn
    data = _write_jsonl(tmp_path / "chat.jsonl", [_sharegpt(t) for t in rows], key="conversations")
    run = tmp_path / "run"
    code = main(["train", f"model={tiny_llama}", f"dataset={data}", "task=causal_lm", "max_steps=2",
                 f"chat_template={ROOT / 'assets' / 'chatml.jinja'}", "effective_batch_size=4", "eval_fraction=0",
                 f"output_dir={run}", "-q"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "note: training data: 1 conversation(s) left out: 1 because they have no assistant turn" in err
    start = next(json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["event"] == "start")
    assert start["dropped_rows"] == {"no_assistant_turn": 1} and start["num_train_samples"] == 14
    assert "<|im_start|>" in (run / "model" / "chat_template.jinja").read_text()  # saved with the model
    assert yaml.safe_load((run / "config.yaml").read_text())["messages_column"] == "conversations"  # as resolved
    # `finetune eval` on conversations: the same masked targets, and the row without a reply left out again.
    assert main(["eval", str(run), f"dataset={data}"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["samples"] == 14 and 0 < metrics["loss"] < 20
    conversation = ('[{"role": "user", "content": "good"}, {"role": "assistant", "content": "bad"}, '
                    '{"role": "user", "content": "odd"}]')
    assert main(["predict", str(run), "hello there", conversation, "--max-new-tokens", "5"]) == 0
    replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["text"] for r in replies] == ["hello there", conversation] and all("reply" in r for r in replies)
    assert main(["predict", str(run), "hello", "--no-chat", "--max-new-tokens", "3"]) == 0
    assert "generated" in json.loads(capsys.readouterr().out)


def test_a_plain_text_run_continues_text_unless_asked_to_chat(tmp_path, chat_llama, lm_csv):
    from finetune.use.predict import predict

    run_train(tmp_path / "run", model=chat_llama, dataset=lm_csv, task="causal_lm", max_steps=1,
              effective_batch_size=4)
    assert set(predict(str(tmp_path / "run"), ["good"], max_new_tokens=2)[0]) == {"text", "generated"}
    assert set(predict(str(tmp_path / "run"), ["good"], max_new_tokens=2, chat=True)[0]) == {"text", "reply"}
    # A model folder (no run around it) with a template chats by default.
    assert set(predict(chat_llama, ["good"], max_new_tokens=2)[0]) == {"text", "reply"}


def test_packed_conversations_have_the_unpacked_loss_and_gradient(tmp_path, chat_llama):
    # Packing carries each conversation's loss mask and target count into its row: one window of packed rows has
    # the loss and gradient of the same conversations unpacked, and only assistant tokens are targets in both.
    from test_packing import _window_loss_and_grad

    data = _write_jsonl(tmp_path / "chat.jsonl", _conversations(12))
    tok = AutoTokenizer.from_pretrained(chat_llama)

    def load(packing: bool):
        c = from_dict({"model": chat_llama, "dataset": data, "task": "causal_lm", "max_length": 256,
                       "eval_fraction": 0, "packing": packing})
        return load_data(c, tok)[0]

    plain, packed = load(False), load(True)
    assert len(packed) < len(plain) and packed.dropped == plain.dropped
    model = AutoModelForCausalLM.from_pretrained(chat_llama, attn_implementation="sdpa")
    samples, rows = list(range(len(plain))), list(range(len(packed)))
    loss, count, grads = _window_loss_and_grad(model, plain, [samples[i: i + 4] for i in range(0, len(samples), 4)],
                                               tok.pad_token_id)
    p_loss, p_count, p_grads = _window_loss_and_grad(model, packed, [rows[i: i + 2] for i in range(0, len(rows), 2)],
                                                     tok.pad_token_id)
    assert p_count == count
    assert p_loss == pytest.approx(loss, rel=1e-5)
    for name in grads:
        torch.testing.assert_close(p_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
