"""llama.cpp's own tools, used as they are: its converter (`convert_hf_to_gguf.py`), its quantizer and its runtime,
through the maintained packages (`llama-cpp-python`, built from source with the machine's compiler, and llama.cpp's
`gguf` package). Nothing here converts a tensor or a vocabulary itself.

The converter is a script of the llama.cpp source tree, not part of either package's installed files: it is taken
from the source package of the installed `llama-cpp-python` release (so that the converter and the runtime are the
same llama.cpp), fetched once with pip and kept in `~/.cache/finetune/llama.cpp/<version>/`, or from a llama.cpp
checkout given as `--llama-cpp DIR`, with the `gguf-py` of the same tree (PyPI's `gguf` reads the files).

llama.cpp's runtime and quantizer run in a child Python (`_in_child`), never in the process that asked: a build of
llama.cpp that uses instructions this processor does not allow dies of SIGILL, which would otherwise kill the CLI,
the app's export or a test worker; here it becomes one sentence that says how to reinstall it portable.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from finetune.errors import InputError, TrainingError

CONVERTER = "convert_hf_to_gguf.py"
QUANT_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json", "config.json",
                   "generation_config.json")
# llama.cpp built for any x86-64 processor of the last decade, not for the build machine's own instruction set: a
# native build on a virtual machine whose processor advertises AVX-512 and AMX died of SIGILL in `decode`.
PORTABLE = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
REINSTALL = f'CMAKE_ARGS="{PORTABLE}" pip install --force-reinstall --no-cache-dir llama-cpp-python'
INSTALL = (f'CMAKE_ARGS="{PORTABLE}" pip install "finetune[export]" (it builds llama-cpp-python from source with '
           "your C++ compiler)")
# What the child Python runs: the call named in the request file (`_serve`). Tests replace it to crash the child.
# (This package's folder is appended to its path, behind the ones the child has, for a checkout that is not installed.)
CHILD = "import sys; sys.path.append(sys.argv[2]); from finetune.use.llamacpp import _serve; _serve(sys.argv[1])"


class LlamaCppError(InputError):
    """llama.cpp's tools are missing, or refuse this model: one sentence saying what to do (exit 2)."""


class LlamaCppCrash(LlamaCppError):
    """llama.cpp died of a signal (an instruction this processor does not allow, most often): reinstall it portable."""


def crash_sentence(signum: int, what: str) -> str:
    """The sentence for a llama.cpp process that died of signal `signum` while doing `what`."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum == getattr(signal, "SIGKILL", None):
        return (f"llama.cpp was killed (SIGKILL, most often for lack of memory) while {what}: free some memory, or "
                "export a smaller quant.")
    return (f"llama.cpp crashed on this processor ({name}) while {what}: reinstall it built for any x86-64 "
            f"processor with {REINSTALL}.")


def runtime_version() -> str:
    """The installed llama-cpp-python release, or a `LlamaCppError` saying how to install it."""
    try:
        return version("llama_cpp_python")
    except PackageNotFoundError:
        raise LlamaCppError(f"GGUF export needs llama.cpp, which is not installed: {INSTALL}.") from None


def converter(llama_cpp_dir: str | None = None, say: Callable[[str], None] | None = None) -> Path:
    """llama.cpp's `convert_hf_to_gguf.py` (with the `conversion` package beside it) for the installed runtime;
    `say` is told when it has to be fetched first (once per machine: 130 s of a first export on a 2-core machine)."""
    if llama_cpp_dir:
        script = Path(llama_cpp_dir).expanduser() / CONVERTER
        if not script.is_file():
            raise LlamaCppError(f"--llama-cpp {llama_cpp_dir!r} has no {CONVERTER}: give the root of a llama.cpp "
                                "checkout.")
        return script
    release = runtime_version()
    _require_gguf()
    folder = cache_dir() / release
    if (folder / CONVERTER).is_file():
        return folder / CONVERTER
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One fetch at a time, across processes: the app's fetch ahead and an export started meanwhile would each
    # replace the other's half-unpacked folder; the second waits, then finds the first one's.
    with open(folder.parent / f".{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / CONVERTER).is_file():
            if say is not None:
                say(f"fetching llama.cpp's converter (llama-cpp-python {release}'s source package, once per machine)")
            _fetch_converter(release, folder)
    return folder / CONVERTER


def fetch_ahead() -> threading.Thread | None:
    """Fetch the converter in the background when GGUF export is installed and the converter is not kept yet, so
    that the first export does not wait for it (the app's first GGUF export took 219 s, the CLI's with a kept
    converter 24 s); None when there is nothing to fetch. A failure is left to the export, which says it."""
    try:
        release = runtime_version()
        _require_gguf()
    except LlamaCppError:
        return None
    if (cache_dir() / release / CONVERTER).is_file():
        return None

    def fetch() -> None:
        with contextlib.suppress(LlamaCppError, OSError):
            converter()

    thread = threading.Thread(target=fetch, name="llama.cpp converter", daemon=True)
    thread.start()
    return thread


def cache_dir() -> Path:
    """Where fetched converters are kept."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "finetune" / "llama.cpp"


def _require_gguf() -> None:
    try:
        version("gguf")
    except PackageNotFoundError:
        raise LlamaCppError(f"GGUF export needs llama.cpp's gguf package, which is not installed: {INSTALL}.") from None


def _fetch_converter(release: str, folder: Path) -> None:
    """Take convert_hf_to_gguf.py and its packages from llama-cpp-python's source package on PyPI (with pip)."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "--disable-pip-version-check", "-q", "-d", tmp, f"llama-cpp-python=={release}"],
                              capture_output=True, text=True)
        archives = list(Path(tmp).glob("*.tar.gz"))
        if proc.returncode != 0 or not archives:
            reason = (proc.stderr.strip().splitlines() or ["no source package"])[-1][:200]
            raise LlamaCppError(f"llama.cpp's converter comes from the llama-cpp-python {release} source package, "
                                f"which pip could not download ({reason}): connect to PyPI once, or give a "
                                "llama.cpp checkout with --llama-cpp DIR.")
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if _wanted(m.name)]
            tar.extractall(partial, members=members, filter="data")
        roots = list(partial.glob(f"*/vendor/llama.cpp/{CONVERTER}"))
        if not roots:
            raise LlamaCppError(f"The llama-cpp-python {release} source package has no {CONVERTER}: give a llama.cpp "
                                "checkout with --llama-cpp DIR.")
        folder.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
        roots[0].parent.replace(folder)
        shutil.rmtree(partial, ignore_errors=True)


def _wanted(name: str) -> bool:
    """The converter, its `conversion` package, the gguf-py it is written against and the templates it reads; not
    the C++ sources."""
    inner = name.split("/vendor/llama.cpp/", 1)[1] if "/vendor/llama.cpp/" in name else None
    return inner is not None and (inner == CONVERTER or inner.startswith(("conversion/", "gguf-py/",
                                                                           "models/templates/")))


@cache
def supported_architectures(script: Path) -> frozenset[str]:
    """The Transformers architectures the converter registers (`@ModelBase.register("LlamaForCausalLM", …)`)."""
    names: set[str] = set()
    for path in [script, *sorted((script.parent / "conversion").glob("*.py"))]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "register":
                names.update(a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str))
    return frozenset(names)


def _env(script: Path) -> dict[str, str]:
    # The converter imports the gguf-py of its own source tree (it puts it first on sys.path): the gguf release on
    # PyPI can be older than the converter (0.19.0 lacks the LazyChunkedTensor that llama.cpp's converter of
    # llama-cpp-python 0.3.36 uses). gguf's own scripts run from that same copy.
    gguf_py = str(script.parent / "gguf-py")
    path = os.pathsep.join(p for p in (gguf_py, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def _run_converter(script: Path, model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    # The converter runs in its own folder (it reads its templates from there): every path it is given is
    # absolute, or a relative one (the app's runs/…) would be read from that folder instead of ours.
    proc = subprocess.run([sys.executable, str(script.resolve()), str(model.resolve()), "--outfile",
                           str(out.resolve()), *extra], capture_output=True, text=True, env=_env(script),
                          cwd=script.parent)
    if proc.returncode < 0:
        raise LlamaCppCrash(crash_sentence(-proc.returncode, "converting the model to GGUF"))
    return proc


def tokenizer_problem(script: Path, model_dir: Path) -> str | None:
    """Why the converter refuses this tokenizer (one sentence), found by running it on the vocabulary alone; None
    when it converts."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "vocab"
        folder.mkdir()
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copy(model_dir / name, folder / name)
        proc = _run_converter(script, folder, Path(tmp) / "vocab.gguf", "--vocab-only")
    if proc.returncode == 0:
        return None
    if "pre-tokenizer was not recognized" in proc.stderr:
        return ("llama.cpp's converter does not recognise this run's tokenizer (a byte-level BPE whose "
                "pre-tokenizer is not one it lists), so it cannot become a GGUF: SentencePiece tokenizers (Llama 2, "
                "Mistral, Gemma style) and the BPE tokenizers of the models llama.cpp knows convert; --format "
                "merged still works.")
    return (f"llama.cpp's converter refused this run's tokenizer ({_last_error(proc.stderr)}): --format merged "
            "still works.")


def convert(script: Path, merged: Path, out: Path) -> Path:
    """`convert_hf_to_gguf.py merged --outtype f16`: the merged folder as an f16 GGUF, with its tokenizer, chat
    template and special tokens."""
    partial = out.with_name(out.name + ".partial")
    proc = _run_converter(script, merged, partial, "--outtype", "f16")
    if proc.returncode != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise TrainingError(f"llama.cpp's converter failed on {_shown(merged)} ({_last_error(proc.stderr)}).")
    partial.replace(out)
    return out


def _shown(path: Path) -> str:
    """A path as messages show it: its last two parts (`export/merged`), not the server's folders above the run."""
    return "/".join(path.parts[-2:])


def _last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"error|Error|not supported|not recognized", line)]
    return ((errors or lines or ["no output"])[-1]).strip()[:240]


def metadata(gguf_path: Path) -> dict[str, Any]:
    """The GGUF's key-value metadata (strings, numbers, and lists of numbers), read with llama.cpp's gguf package."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf_path))
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if not field.types or name.startswith("tokenizer.ggml.") and field.types[0] == GGUFValueType.ARRAY:
            continue  # the vocabulary itself: large, and not what a check compares
        out[name] = field.contents()
    return out


def mark_end_of_turn(script: Path, gguf_path: Path, stops: list[int]) -> None:
    """Make sure llama.cpp ends generation at every token the run learned to stop at: llama.cpp knows common
    end-of-turn tokens by their text (<|im_end|>, <|eot_id|>, …); another is recorded as the GGUF's end-of-turn
    token with the gguf package's own `gguf-new-metadata`."""
    missing = [i for i in stops if i not in end_of_generation(gguf_path)]
    if not missing:
        return
    partial = gguf_path.with_name(gguf_path.name + ".eot")
    proc = subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(gguf_path), str(partial),
                           "--special-token-by-id", "eot", str(missing[0]), "--force"], capture_output=True,
                          text=True, env=_env(script))
    if proc.returncode < 0:
        partial.unlink(missing_ok=True)
        raise LlamaCppCrash(crash_sentence(-proc.returncode, f"recording the end-of-turn token in {gguf_path.name}"))
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise TrainingError(f"Recording the end-of-turn token in {gguf_path.name} failed ({_last_error(proc.stderr)}).")
    partial.replace(gguf_path)


@contextlib.contextmanager
def quiet(log: Path | None = None) -> Any:
    """llama.cpp's C code writes its notes (and the quantizer its fallbacks) straight to file descriptor 2: send them
    to `log` (appended), or nowhere, while inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    target = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 2)
    try:  # llama-cpp-python also forwards some of llama.cpp's notes to Python's sys.stderr
        with open(os.dup(target), "a", encoding="utf-8") as python_side, contextlib.redirect_stderr(python_side):
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(target)


def end_of_generation(gguf_path: Path) -> list[int]:
    """The token ids llama.cpp ends generation at for this GGUF (its end-of-generation set)."""
    return _in_child("end_of_generation", f"reading {gguf_path.name}", gguf_path=str(gguf_path))


def quantize(f16: Path, out: Path, quant: str) -> Path:
    """llama.cpp's quantizer (`llama_model_quantize`, what `llama-quantize` runs) from the f16 GGUF to `quant`."""
    _in_child("quantize", f"quantizing {f16.name} to {quant}", f16=str(f16), out=str(out), quant=quant)
    return out


def greedy(gguf_path: Path, text: str, prompt: list[int], n_tokens: int, teacher: list[int]) -> dict[str, Any]:
    """llama.cpp on `prompt`: its greedy tokens (until an end-of-generation token or `n_tokens`), its argmax at
    each position of `teacher` given the tokens before it, how it tokenises `text` by itself, its chat template and
    its end-of-generation set."""
    return _in_child("greedy", f"generating with {gguf_path.name}", gguf_path=str(gguf_path), text=text,
                     prompt=prompt, n_tokens=n_tokens, teacher=teacher)


def _in_child(call: str, what: str, **kwargs: Any) -> Any:
    """`_CALLS[call](**kwargs)` in a child Python: its answer, its own error (re-raised here as the same sentence),
    or a `LlamaCppCrash` sentence when llama.cpp killed it."""
    import finetune

    root = str(Path(finetune.__file__).resolve().parents[1])
    with tempfile.TemporaryDirectory() as tmp:
        request, answer = Path(tmp) / "request.json", Path(tmp) / "answer.json"
        request.write_text(json.dumps({"call": call, "kwargs": kwargs, "answer": str(answer)}), encoding="utf-8")
        proc = subprocess.run([sys.executable, "-c", CHILD, str(request), root], capture_output=True, text=True)
        if proc.returncode < 0:
            raise LlamaCppCrash(crash_sentence(-proc.returncode, what))
        if not answer.is_file():
            raise TrainingError(f"llama.cpp's child process ended without an answer while {what} (exit "
                                f"{proc.returncode}: {_last_error(proc.stderr)}).")
        result = json.loads(answer.read_text(encoding="utf-8"))
    if "error" in result:
        raise (LlamaCppError if result["input"] else TrainingError)(result["error"])
    return result["value"]


def _serve(request_path: str) -> None:
    """The child's side of `_in_child`: run the call, write its value (or the sentence of its failure)."""
    request = json.loads(Path(request_path).read_text(encoding="utf-8"))
    try:
        result: dict[str, Any] = {"value": _CALLS[request["call"]](**request["kwargs"])}
    except InputError as e:
        result = {"error": str(e), "input": True}
    except TrainingError as e:
        result = {"error": str(e), "input": False}
    Path(request["answer"]).write_text(json.dumps(result), encoding="utf-8")


# --- What the child runs (`_serve`): llama.cpp's runtime and quantizer, in this process.

def _load(gguf_path: Path, *, vocab_only: bool = False, n_ctx: int = 512, logits_all: bool = False) -> Any:
    from llama_cpp import Llama

    log = gguf_path.with_name("llama.cpp.log")
    with quiet(log):
        try:
            return Llama(model_path=str(gguf_path), vocab_only=vocab_only, n_ctx=n_ctx, logits_all=logits_all,
                         n_threads=max(1, min(4, os.cpu_count() or 1)), verbose=False, seed=0)
        except (ValueError, RuntimeError, OSError) as e:  # llama-cpp-python's "Failed to load model from file"
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].replace(str(gguf_path.parent) + "/", "")
            raise LlamaCppError(f"llama.cpp could not load {gguf_path.name} ({reason[:200]}; its notes are in "
                                f"{log.name} beside it): export with --no-check to keep the GGUF unchecked, or "
                                f"reinstall llama.cpp with {REINSTALL}.") from None


def _end_of_generation(gguf_path: str) -> list[int]:
    import llama_cpp

    path = Path(gguf_path)
    model = _load(path, vocab_only=True)
    vocab = model._model.vocab
    found = [i for i in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    with quiet(path.with_name("llama.cpp.log")):
        model.close()
    return found


def _quantize(f16: str, out: str, quant: str) -> None:
    import llama_cpp

    source, target = Path(f16), Path(out)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANT_TYPES[quant])
    params.nthread = max(1, min(4, os.cpu_count() or 1))
    partial = target.with_name(target.name + ".partial")
    with quiet(target.with_name("llama.cpp.log")):
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
    if code != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise TrainingError(f"llama.cpp's quantizer failed to make {target.name} from {source.name} (code {code}).")
    partial.replace(target)


def _greedy(gguf_path: str, text: str, prompt: list[int], n_tokens: int, teacher: list[int]) -> dict[str, Any]:
    import llama_cpp
    import numpy as np

    path = Path(gguf_path)
    model = _load(path, n_ctx=max(64, len(prompt) + max(n_tokens, len(teacher)) + 8), logits_all=True)
    try:
        vocab = model._model.vocab
        eog = [i for i in range(model.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
        tokens: list[int] = []
        with quiet(path.with_name("llama.cpp.log")):
            model.reset()
            model.eval(prompt)
            for _ in range(n_tokens):
                token = int(np.argmax(model.scores[model.n_tokens - 1]))
                tokens.append(token)
                if token in eog:
                    break
                model.eval([token])
            model.reset()
            forced: list[int] = []
            if teacher:
                model.eval(prompt + teacher[:-1])
                rows = model.scores[len(prompt) - 1: len(prompt) - 1 + len(teacher)]
                forced = [int(t) for t in np.argmax(rows, -1)]
        # As llama-server and Ollama tokenise a rendered prompt: with the special tokens the GGUF asks for (BOS).
        return {"tokens": tokens, "forced": forced, "end_of_generation": eog,
                "prompt_tokens": model.tokenize(text.encode("utf-8"), add_bos=True, special=True),
                "chat_template": model.metadata.get("tokenizer.chat_template")}
    finally:
        with quiet(path.with_name("llama.cpp.log")):
            model.close()


_CALLS = {"end_of_generation": _end_of_generation, "quantize": _quantize, "greedy": _greedy}
