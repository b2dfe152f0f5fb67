"""`finetune export`: a finished run as something people run locally.

    RUN/export/
      merged/          the adapter merged into the base in the half dtype: a plain transformers folder, with the
                       run's tokenizer and chat template, and a generation config whose `eos_token_id` lists the
                       end-of-turn token the run learned (then end of sequence)
      model-f16.gguf   llama.cpp's own converter run on merged/ (`--format gguf`); model-q8_0.gguf and
                       model-q4_k_m.gguf by llama.cpp's own quantizer from it (finetune.use.llamacpp)
      Modelfile        with `--ollama`: FROM, TEMPLATE (the run's template in Go's syntax), PARAMETER stop, SYSTEM
      check-<quant>.json  the behaviour check of that GGUF: llama.cpp greedy against transformers greedy
      export.json      what was exported, how long it took, the files and the check

Everything that can be refused is refused before any work (`prepare`): a run that has not finished, a multi-task
run, GGUF for a model that does not generate text (its kind's registry entry says which do), an architecture or
a tokenizer llama.cpp's converter does not take, not enough disk space. The run's `events.jsonl` gets an `export` event.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from finetune.building import BUILDS
from finetune.config.schema import read_yaml
from finetune.errors import ConfigError, InputError, ModelError
from finetune.models import quantize
from finetune.models.heads import TASKS_FILE
from finetune.models.pretrained import (
    auto_class,
    is_adapter,
    load_trained,
    quiet_transformers,
    resolve_model_path,
    task_of,
)
from finetune.registry import ENTRIES, a_model, entry
from finetune.rows.chat import end_of_turn_ids, turns_of
from finetune.run.events import EventLog, Exported
from finetune.run.rundir import is_finished, write_json
from finetune.use import checkpoint, llamacpp, ollama

FORMATS = ("merged", "gguf")
QUANTS = ("f16", "q8_0", "q4_k_m")
DTYPES = ("auto", "float16", "bfloat16", "float32")
EXPORT_DIR, MERGED_DIR, RECORD = "export", "merged", "export.json"
CHECK_TOKENS = 32
# Bytes per parameter of each file written, for the disk-space check (q4_k_m: 4.5 bits and the tensors it keeps
# at 6 bits; the f16 GGUF is always written first, the quantized ones from it).
BYTES_PER_PARAM = {"float16": 2, "bfloat16": 2, "float32": 4, "f16": 2, "q8_0": 1.07, "q4_k_m": 0.62}
DISK_MARGIN = 1.05


class ExportError(InputError):
    """The run cannot be exported as asked: one sentence that says why and what works instead (exit 2)."""


@dataclass(frozen=True)
class ExportPlan:
    """What an export will do, resolved and checked before any work."""

    run_dir: Path
    model_dir: Path
    out: Path
    format: str
    quant: str | None
    dtype: str
    task: str
    chat: bool
    ollama: bool
    parameters: int
    converter: Path | None = None  # llama.cpp's convert_hf_to_gguf.py, for a GGUF


@dataclass(frozen=True)
class ExportResult:
    """Where the export went, what it wrote, how long it took and (a GGUF) how it behaved."""

    out: Path
    format: str
    quant: str | None
    merged: Path
    gguf: Path | None
    modelfile: Path | None
    seconds: float
    check: dict[str, Any] | None

    def to_dict(self) -> dict[str, Any]:
        """As written to export.json and printed by the CLI."""
        out = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}
        out["files"] = {p.name: p.stat().st_size for p in (self.gguf, self.modelfile) if p is not None and p.is_file()}
        out["files"]["merged"] = sum(p.stat().st_size for p in self.merged.rglob("*") if p.is_file())
        return out


def prepare(target: str, *, fmt: str = "merged", quant: str | None = None, out: str | None = None,
            ollama_file: bool = False, dtype: str = "auto", llama_cpp: str | None = None,
            progress: Callable[[str], None] | None = None) -> ExportPlan:
    """Check everything an export needs before any work: an `ExportError` (one sentence) for what cannot be done.
    `progress` is told when llama.cpp's converter has to be fetched first."""
    if fmt not in FORMATS:
        raise ConfigError([f"--format {fmt!r} is not one of {', '.join(FORMATS)}."])
    if quant is not None and fmt != "gguf":
        raise ConfigError(["--quant is for --format gguf (a merged folder keeps the half dtype; see --dtype)."])
    quant = (quant or "f16") if fmt == "gguf" else None
    if quant is not None and quant not in QUANTS:
        raise ConfigError([f"--quant {quant!r} is not one of {', '.join(QUANTS)}."])
    if ollama_file and fmt != "gguf":
        raise ConfigError(["--ollama writes a Modelfile beside a GGUF: add --format gguf."])
    if dtype not in DTYPES:
        raise ConfigError([f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}."])
    path = Path(target).expanduser()
    if (path / "config.yaml").is_file() and not is_finished(path):
        raise ExportError(f"The run in {target!r} has not finished (it is still training, or stopped before the "
                          "end): resume it to the end, then export it.")
    model_dir, run_dir = checkpoint.resolve(target)
    if run_dir is None:
        raise ExportError(f"{target!r} is a model folder, not a run directory: export the run that trained it (its "
                          "config.yaml says which template and end-of-turn token it learned).")
    if (model_dir / TASKS_FILE).is_file():
        raise ExportError(f"The run in {target!r} is a multi-task model (one model per task in {model_dir}): "
                          "export is for single-task runs for now.")
    config = read_yaml(run_dir / "config.yaml")
    task = task_of(model_dir)
    kind = str(config.get("task") or task)
    # Both the saved model and the run that trained it (a preference run saves a causal LM too).
    if fmt == "gguf" and not all(fmt in (ENTRIES[k].exports if k in ENTRIES else ()) for k in (task, kind)):
        # A kind that generates text without a GGUF path says why in its entry (seq2seq's encoder–decoder models).
        reason = next((ENTRIES[k].refusals["gguf"] for k in (kind, task) if "gguf" in getattr(ENTRIES.get(k),
                                                                                            "refusals", {})), None)
        raise ExportError(f"GGUF cannot be written for this run: {reason}; export it with --format merged (a "
                          "transformers folder) instead." if reason else
                          f"GGUF is for models that generate text, and this run trained {a_model(kind)}: export "
                          "it with --format merged (a transformers folder) instead.")
    # A checkpoint's export goes beside it, not over the run's own.
    out_dir = Path(out).expanduser() if out else (path if checkpoint.run_of_checkpoint(path) else run_dir) / EXPORT_DIR
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"--out {str(out_dir)!r} is a file: give a directory.")
    base_dtype = _base_dtype(model_dir)
    dtype = dtype if dtype != "auto" else base_dtype if base_dtype in ("float16", "bfloat16") else "float16"
    parameters = parameter_count(model_dir)
    _check_disk(out_dir, parameters, dtype, quant)
    converter = None
    if fmt == "gguf" and _reusable(out_dir, model_dir, dtype):  # converted before, from the same model: no re-check
        converter = llamacpp.converter(llama_cpp, say=progress)
    elif fmt == "gguf":
        converter = llamacpp.converter(llama_cpp, say=progress)
        arch = _architecture(model_dir)
        if arch not in llamacpp.supported_architectures(converter):
            raise ExportError(f"llama.cpp's converter does not support the {arch} architecture, so this run cannot "
                              "become a GGUF: --format merged (safetensors for transformers) still works.")
        if problem := llamacpp.tokenizer_problem(converter, model_dir):
            raise ExportError(problem)
    chat = _is_chat(config, kind, model_dir)
    if ollama_file:
        _check_ollama_template(model_dir)
    return ExportPlan(run_dir=run_dir, model_dir=model_dir, out=out_dir, format=fmt, quant=quant, dtype=dtype,
                      task=task, chat=chat, ollama=ollama_file, parameters=parameters, converter=converter)


def export(target: str, *, fmt: str = "merged", quant: str | None = None, out: str | None = None,
           ollama_file: bool = False, dtype: str = "auto", check: bool = True, check_tokens: int = CHECK_TOKENS,
           llama_cpp: str | None = None, progress: Callable[[str], None] | None = None) -> ExportResult:
    """Export the finished run `target` (see the module docstring); every refusal comes before any work.
    `progress` is told each stage as it begins (the CLI prints them; the app shows the last one)."""
    say = progress or (lambda stage: None)
    plan = prepare(target, fmt=fmt, quant=quant, out=out, ollama_file=ollama_file, dtype=dtype,
                   llama_cpp=llama_cpp, progress=say)
    started = time.perf_counter()
    plan.out.mkdir(parents=True, exist_ok=True)
    merged, f16 = plan.out / MERGED_DIR, plan.out / "model-f16.gguf"
    # Another quant of a run exported before reuses its merged folder and f16 GGUF (the quantizer starts from it).
    reuse = plan.format == "gguf" and _reusable(plan.out, plan.model_dir, plan.dtype)
    if not reuse:
        say("merging the adapter into the base" if is_adapter(plan.model_dir) else "writing the merged weights")
        write_merged(plan.model_dir, merged, plan.task, plan.dtype, plan.chat,
                     base=str(read_yaml(plan.run_dir / "config.yaml").get("model") or ""))
    gguf = modelfile = report = None
    if plan.format == "gguf":
        if not reuse:
            say("converting to GGUF with llama.cpp's converter")
            llamacpp.convert(plan.converter, merged, f16)
            llamacpp.mark_end_of_turn(plan.converter, f16, stop_ids(merged))
        if plan.quant != "f16":
            say(f"quantizing to {plan.quant} with llama.cpp's quantizer")
        gguf = f16 if plan.quant == "f16" else llamacpp.quantize(f16, plan.out / f"model-{plan.quant}.gguf",
                                                                   plan.quant)
        if plan.ollama:
            modelfile = ollama.write_modelfile(plan.out / "Modelfile", gguf, merged, system=_system_prompt(plan))
    seconds = round(time.perf_counter() - started, 2)
    if gguf is not None and check:
        say("checking llama.cpp's greedy tokens against transformers'")
        report = behaviour_check(merged, gguf, prompt_turns(plan.run_dir, plan.chat), check_tokens)
        write_json(plan.out / f"check-{plan.quant}.json", report)
    result = ExportResult(out=plan.out, format=plan.format, quant=plan.quant, merged=merged, gguf=gguf,
                          modelfile=modelfile, seconds=seconds, check=report)
    write_json(plan.out / RECORD, {**result.to_dict(), "dtype": plan.dtype, "source": _source_stamp(plan.model_dir),
                                   "reused_f16": reuse})
    EventLog(plan.run_dir / "events.jsonl").emit(Exported(format=plan.format, quant=plan.quant,
                                                          path=str(gguf or merged), seconds=seconds, check=report))
    return result


def generates_text(kind: str) -> bool:
    """Whether the models of task kind `kind` generate text (causal LM, preference tuning): its registry entry says
    so (`generates`), not its name."""
    return kind in ENTRIES and ENTRIES[kind].generates


def _is_chat(config: dict[str, Any], kind: str, model_dir: Path) -> bool:
    """Whether the run talks in turns: it trained on conversations (`messages_column`) or with a `chat_template`,
    or its kind chats whenever its saved model has a template (as Try it does: a preference-tuned chat model)."""
    if config.get("messages_column") or config.get("chat_template"):
        return True
    chats_by_template = kind in ENTRIES and ENTRIES[kind].chat_when == "template"
    saved = _json(model_dir / "tokenizer_config.json")
    return chats_by_template and (bool(saved.get("chat_template")) or (model_dir / "chat_template.jinja").is_file())


def write_merged(model_dir: Path, out: Path, task: str, dtype: str, chat: bool, base: str | None = None) -> Path:
    """The run's model with its adapter merged in, cast to `dtype`, with tokenizer and generation config (and the
    base model's SentencePiece `tokenizer.model`, when it has one)."""
    import torch
    from transformers import AutoTokenizer, GenerationConfig

    quiet_transformers()
    model = load_trained(model_dir, task)
    if is_adapter(model_dir) and quantize.quantization_of(model):
        # A quantized base: each layer dequantized to the weights the adapter was trained against, plus the update.
        model = quantize.merged_model(model)
    elif is_adapter(model_dir):  # peft adds the scaled low-rank update to each adapted weight, in fp32
        model = model.merge_and_unload()
    model = model.to(getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    if entry(task).generates:
        # Stop where the run learned to stop: after its end-of-turn token (chat), else at end of sequence.
        stops = end_of_turn_ids(tokenizer) if chat else [tokenizer.eos_token_id]
        gen = GenerationConfig.from_model_config(model.config)
        gen.eos_token_id = [i for i in stops if i is not None]
        gen.bos_token_id = tokenizer.bos_token_id
        gen.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else gen.eos_token_id[0]
        model.generation_config = gen
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    if entry(task).generates:
        _write_tokenizer_settings(partial, tokenizer, chat)
        if (spm := _sentencepiece_model(base)) is not None and not (partial / "tokenizer.model").exists():
            shutil.copy(spm, partial / "tokenizer.model")
    if out.exists():
        shutil.rmtree(out)
    partial.replace(out)
    return out


PROBE = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
         {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Why?"}]


def _write_tokenizer_settings(folder: Path, tokenizer: Any, chat: bool) -> None:
    """Say in tokenizer_config.json how the run tokenised, so that llama.cpp's converter writes it into the GGUF
    (llama.cpp's own defaults differ): a chat run tokenised its rendered conversations without adding special
    tokens (no BOS beyond what the template writes), a plain-text run with the tokenizer's own; and a chat run's
    text after a template's special token got no SentencePiece space prefix (which llama.cpp adds by default).
    The prefix setting is kept only when the saved tokenizer still tokenises a conversation as the run did."""
    from transformers import AutoTokenizer

    path = folder / "tokenizer_config.json"
    config = _json(path)
    # The added tokens in the form tokenizer_config.json had before transformers 5: the converter marks the special
    # ones (end-of-turn markers) as control tokens from it when it reads a SentencePiece model.
    config.setdefault("added_tokens_decoder", {str(i): {"content": t.content, "special": t.special, "lstrip": t.lstrip,
                                                        "rstrip": t.rstrip, "normalized": t.normalized,
                                                        "single_word": t.single_word}
                                               for i, t in sorted(tokenizer.added_tokens_decoder.items())})
    if chat:
        config.update(add_bos_token=False, add_eos_token=False)
    else:
        ids = tokenizer("a")["input_ids"]
        config.update(add_bos_token=bool(ids) and ids[0] == tokenizer.bos_token_id,
                      add_eos_token=bool(ids) and ids[-1] == tokenizer.eos_token_id)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    if not chat or config.get("add_prefix_space") is False:
        return
    try:
        text = tokenizer.apply_chat_template(PROBE, tokenize=False)
    except (ValueError, TypeError, KeyError, IndexError, ImportError):  # jinja's errors are ValueError/TypeError here
        return
    before = tokenizer(text, add_special_tokens=False)["input_ids"]
    path.write_text(json.dumps({**config, "add_prefix_space": False}, indent=2, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    if AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"] != before:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _sentencepiece_model(base: str | None) -> Path | None:
    """The base model's `tokenizer.model` (a local folder, or a hub model in the local cache), or None.

    transformers saves a SentencePiece tokenizer as tokenizer.json alone; llama.cpp's converter then takes the
    vocabulary from it without the pieces' scores, and its tokenizer merges differently from the run's. With the
    SentencePiece model beside it, the converter reads the scores (and the check compares the prompt's tokens)."""
    if not base:
        return None
    try:
        folder = Path(resolve_model_path(base))
    except ModelError:
        return None
    if (folder / "tokenizer.model").is_file():
        return folder / "tokenizer.model"
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(base, "tokenizer.model") if not folder.exists() else None
    return Path(cached) if isinstance(cached, str) else None


def stop_ids(merged: Path) -> list[int]:
    """The token ids generation stops at, as the merged folder's generation config lists them."""
    ids = json.loads((merged / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    return [ids] if isinstance(ids, int) else list(ids or [])


def parameter_count(model_dir: Path) -> int:
    """The saved model's parameters, from its config on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig

    quiet_transformers()
    config = AutoConfig.from_pretrained(model_dir)
    auto = auto_class(task_of(model_dir))
    with BUILDS, torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


def behaviour_check(merged: Path, gguf: Path, turns: list[dict[str, Any]] | None, n_tokens: int) -> dict[str, Any]:
    """llama.cpp greedy on the GGUF against transformers greedy on the merged folder, on the same prompt rendered
    with the run's template: whether they agree token for token, the rate at which llama.cpp's next token is
    transformers' (each position given transformers' tokens), whether each stops at the end-of-turn token, and
    warnings that say what differs (template, end-of-turn, prompt tokens, generated tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quiet_transformers()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    text = (tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True) if turns
            else "Once upon a time")
    prompt = tokenizer(text, add_special_tokens=turns is None)["input_ids"]
    stops = stop_ids(merged)
    # The reference the GGUF is checked against: transformers' own layers, no Hub kernels (5.25 loads them by default).
    with BUILDS:
        model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, use_kernels=False).eval()
    with torch.inference_mode():
        ids = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=n_tokens, do_sample=False, eos_token_id=stops,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0])
    theirs = ids[0, len(prompt):].tolist()
    ours = llamacpp.greedy(gguf, text, prompt, n_tokens, teacher=theirs)
    same = ours["tokens"] == theirs
    matched = sum(a == b for a, b in zip(ours["forced"], theirs, strict=False))
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    warnings = []
    if turns and ours["chat_template"] != template:
        warnings.append("the GGUF's chat template differs from the run's (llama.cpp and Ollama would render "
                        "conversations differently from how the model was trained)")
    missing = [i for i in stops if i not in ours["end_of_generation"]]
    if missing:
        warnings.append(f"llama.cpp does not stop at {_names(tokenizer, missing)}, which the run learned to end "
                        "with (the model would never stop)")
    if ours["prompt_tokens"] != prompt:
        at = next((i for i, (a, b) in enumerate(zip(ours["prompt_tokens"], prompt, strict=False)) if a != b),
                  min(len(prompt), len(ours["prompt_tokens"])))
        warnings.append(f"llama.cpp tokenises the prompt differently from position {at} (the check fed it "
                        "transformers' tokens)")
    if not same:
        at = next((i for i, (a, b) in enumerate(zip(ours["tokens"], theirs, strict=False)) if a != b),
                  min(len(ours["tokens"]), len(theirs)))
        warnings.append(f"the generated tokens differ from position {at}: transformers "
                        f"{_names(tokenizer, theirs[at:at + 3])}, llama.cpp "
                        f"{_names(tokenizer, ours['tokens'][at:at + 3])}")
    return {"gguf": gguf.name, "prompt": text, "max_new_tokens": n_tokens, "agree": same,
            "agreement_rate": round(matched / len(theirs), 4) if theirs else 1.0,
            "transformers_tokens": theirs, "llama_cpp_tokens": ours["tokens"],
            "transformers_text": tokenizer.decode(theirs), "llama_cpp_text": tokenizer.decode(ours["tokens"]),
            "transformers_stops": bool(theirs) and theirs[-1] in stops,
            "llama_cpp_stops": bool(ours["tokens"]) and ours["tokens"][-1] in ours["end_of_generation"],
            "template_matches": ours["chat_template"] == template, "warnings": warnings}


def describe_check(report: dict[str, Any]) -> str:
    """The behaviour check in one line (then one line per warning)."""
    n = len(report["transformers_tokens"])
    head = (f"check {report['gguf']}: llama.cpp and transformers agree token for token on {n} greedy tokens"
            if report["agree"] else f"check {report['gguf']}: llama.cpp agrees with transformers on "
            f"{report['agreement_rate']:.0%} of {n} greedy tokens")
    stops = {True: "stops at the end-of-turn token", False: "does not stop within the tokens generated"}
    head += f"; llama.cpp {stops[report['llama_cpp_stops']]}, transformers {stops[report['transformers_stops']]}."
    return "\n".join([head, *(f"warning: {w}" for w in report["warnings"])])


def prompt_turns(run_dir: Path, chat: bool) -> list[dict[str, Any]] | None:
    """The check's prompt: the first conversation of the run's data up to its first reply (a local JSON Lines
    file), else one user turn; None for a run that did not train on conversations (plain text)."""
    if not chat:
        return None
    first = _first_conversation(run_dir)
    if first:
        reply = next((i for i, t in enumerate(first) if t["role"] == "assistant"), len(first))
        if reply and first[reply - 1]["role"] == "user":
            return [{"role": t["role"], "content": str(t.get("content", ""))} for t in first[:reply]]
    return [{"role": "user", "content": "Hello! What can you do?"}]


def _first_conversation(run_dir: Path) -> list[dict[str, Any]] | None:
    config = read_yaml(run_dir / "config.yaml")
    dataset, column = config.get("dataset"), config.get("messages_column")
    if not dataset or not column or Path(dataset).suffix.lower() != ".jsonl" or not Path(dataset).is_file():
        return None
    with open(dataset, encoding="utf-8") as f:
        line = f.readline()
    try:
        return turns_of(json.loads(line).get(column))
    except (json.JSONDecodeError, AttributeError):
        return None


def _system_prompt(plan: ExportPlan) -> str | None:
    """The system turn the data's first conversation starts with, if any (the Modelfile's SYSTEM)."""
    first = _first_conversation(plan.run_dir) if plan.chat else None
    return str(first[0].get("content")) if first and first[0]["role"] == "system" else None


def _check_ollama_template(model_dir: Path) -> None:
    """An `ExportError` when the run's chat template cannot become the Modelfile's TEMPLATE (before any work)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not isinstance(getattr(tokenizer, "chat_template", None), str):
        raise ExportError("--ollama needs the run's chat template, and this run's tokenizer has none: export "
                          "without --ollama (the GGUF still runs in llama.cpp), or train with `chat_template`.")
    ollama.turn_pieces(tokenizer)


def _names(tokenizer: Any, ids: list[int]) -> str:
    return " ".join(repr(tokenizer.convert_ids_to_tokens(i)) for i in ids) or "nothing"


def _base_dtype(model_dir: Path) -> str | None:
    config = _json(model_dir / "config.json")
    return config.get("dtype") or config.get("torch_dtype")


def _architecture(model_dir: Path) -> str:
    archs = _json(model_dir / "config.json").get("architectures") or []
    if not archs:
        raise ModelError(f"{model_dir / 'config.json'} names no architecture: it was not saved by a run.")
    return archs[0]


def _source_stamp(model_dir: Path) -> float:
    """When the run's model was last written (a later training run in the same folder makes exports stale)."""
    return max(p.stat().st_mtime for p in model_dir.iterdir() if p.is_file())


def _reusable(out: Path, model_dir: Path, dtype: str) -> bool:
    """Whether `out` holds a merged folder and f16 GGUF exported from this very model in this dtype."""
    record = _json(out / RECORD)
    return (record.get("source") == _source_stamp(model_dir) and record.get("dtype") == dtype
            and (out / MERGED_DIR / "config.json").is_file() and (out / "model-f16.gguf").is_file()
            and bool(record.get("gguf")))


def _json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _check_disk(out: Path, parameters: int, dtype: str, quant: str | None) -> None:
    """An `ExportError` when the disk that takes `out` has not room for what the export writes."""
    need = parameters * BYTES_PER_PARAM[dtype]
    if quant is not None:
        need += parameters * BYTES_PER_PARAM["f16"] + (parameters * BYTES_PER_PARAM[quant] if quant != "f16" else 0)
    need *= DISK_MARGIN
    existing = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(existing).free
    if free < need:
        # The folder by its last two parts: on a shared server the ones above it are the server's own.
        shown = "/".join(existing.parts[-2:]) or str(existing)
        raise ExportError(f"The export needs about {need / 2**30:.1f} GiB and {shown} has {free / 2**30:.1f} GiB "
                          "free: free some space or give --out on another disk.")
