"""`finetune eval RUN --benchmarks TASK[,TASK…]`: EleutherAI's lm-evaluation-harness on a run's model, and with
`--base` on the model it started from, its scores kept in RUN/benchmarks.json.

The harness does the scoring: a benchmark is a task of its registry (`hellaswag`, `mmlu`, …) or a task YAML file,
and each model is evaluated through its own entry point (`lm_eval.simple_evaluate` with its `hf` model), so the
numbers are the ones `lm_eval --model hf --model_args pretrained=RUN/model` prints. A LoRA run is scored as its
base with the adapter applied (the `peft` argument), nothing merged or written. What this module adds is the order
of the checks: the names, the task files and each task's data are checked and loaded before a model loads, and each
failure is one sentence (a hub task offline names the dataset it needs).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.config.schema import ConfigError, from_dict, read_yaml
from finetune.config.versions import require
from finetune.engine.runtime import device_memory
from finetune.errors import DataError, ModelError, PackageError
from finetune.models.pretrained import is_adapter, load_failure, resolve_model_dir, resolve_model_path, task_of
from finetune.plan.evaluation import EvalPlan, eval_batch_size, render_eval
from finetune.plan.plan import GIB
from finetune.registry import entry, kind_of_model_config
from finetune.run.rundir import write_json

RESULTS = "benchmarks.json"  # in the run directory, beside metrics.json
# The harness's model classes: a kind whose model is neither is not a language model it can score.
SCORED_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM")
TASK_FILE_SUFFIXES = (".yaml", ".yml")
GENERATED_TOKENS = 256  # the harness's `max_gen_toks` when a task sets none


@dataclass(frozen=True)
class Scored:
    """One model to score: "model" (the run's) or "base", and the harness's `hf` model arguments for it."""

    name: str
    model_args: dict[str, str]


def harness() -> Any:
    """The `lm_eval` package, or one sentence on how to install it (or a release of it this module can use)."""
    try:
        import lm_eval
    except ImportError:
        raise PackageError("`--benchmarks` runs EleutherAI's lm-evaluation-harness, which is not installed: "
                           "pip install 'finetune[evals]'.") from None
    require(("evals",))  # an older release lacks the task loading used here: one sentence, not an AttributeError
    return lm_eval


def parse_names(text: str) -> list[str]:
    """`TASK[,TASK…]` as a list, each a registry name or a task YAML file."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError(["--benchmarks names no task: give one or more, e.g. --benchmarks hellaswag,arc_easy or "
                           "--benchmarks my_task.yaml."])
    return names


def is_task_file(name: str) -> bool:
    """Whether a benchmark is given as a task YAML file rather than a registry name."""
    return name.lower().endswith(TASK_FILE_SUFFIXES)


def scored_models(target: str, model_dir: Path, run_dir: Path | None, *, base: bool) -> list[Scored]:
    """The run's model (and its base with `base`) as the harness's `hf` arguments; a model it cannot score, or a
    base that cannot be told, is one sentence."""
    if (model_dir / "tasks.json").is_file():
        raise ModelError(f"{target!r} is a multi-task model: benchmarks score one language model; evaluate a task "
                         "with `finetune eval RUN task=<name>`.")
    kind = task_of(model_dir)
    if entry(kind).auto_model not in SCORED_CLASSES:
        raise ModelError(f"{target!r} holds a {entry(kind).summary} model, which lm-evaluation-harness does not "
                         "score (it scores language models): evaluate it with `finetune eval RUN dataset=<file>`.")
    if is_adapter(model_dir):  # the adapter on its base, as peft applies it in memory: nothing merged to disk
        base_path = json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        folder = str(model_dir.resolve())
        models = [Scored("model", {"pretrained": _absolute(base_path), "peft": folder, "tokenizer": folder})]
    else:
        models, base_path = [Scored("model", {"pretrained": str(model_dir.resolve())})], _run_base(run_dir)
    if base:
        if base_path is None:
            raise ConfigError([f"--base scores the model a run started from, but {target!r} is a model folder "
                               "without its run: point at the run directory."])
        models.append(Scored("base", {"pretrained": _absolute(base_path)}))
    return models


def _absolute(model: str) -> str:
    """A local folder as its absolute path (kept in benchmarks.json, read from any folder); a hub id as it is."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def _run_base(run_dir: Path | None) -> str | None:
    """The model a run started from (its config's `model`, a bundled one as its folder), None without a run."""
    if run_dir is None:
        return None
    return resolve_model_path(str(read_yaml(run_dir / "config.yaml")["model"]))


def task_manager(names: list[str]) -> Any:
    """The harness's task manager: with its registry (thousands of YAML files, seconds to index) only when a name
    needs it."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=not all(is_task_file(name) for name in names))


def check_names(names: list[str], manager: Any) -> list[str | dict[str, Any]]:
    """Each benchmark as the harness loads it (a registry name, or a task file's config with its data files found
    beside it); an unknown name or a missing file is one sentence."""
    specs: list[str | dict[str, Any]] = []
    for name in names:
        if is_task_file(name):
            specs.append(task_file_config(Path(name)))
        elif name in manager.task_index:
            specs.append(name)
        else:
            near = difflib.get_close_matches(name, manager.all_tasks, n=1)
            raise ConfigError([f"Unknown benchmark {name!r}: it is no task of lm-evaluation-harness"
                               + (f" (did you mean {near[0]!r}?)" if near else "")
                               + "; give a registry name (`lm-eval ls tasks`) or a task YAML file."])
    return specs


def task_file_config(path: Path) -> dict[str, Any]:
    """A task YAML file as the harness reads it, its relative data files made relative to the file's folder (the
    harness would read them from the working folder, so a task file would work from one folder only)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    if not path.is_file():
        raise ConfigError([f"Task file {str(path)!r} does not exist: check the path."])
    try:
        cfg = load_yaml(path.resolve(), resolve_func=True, recursive=True)
    except Exception as e:  # yaml's parse errors and the harness's include/function errors all mean "fix the file"
        raise ConfigError([f"Task file {str(path)!r} could not be read ({_first_line(e)}): check it."]) from None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), str):
        raise ConfigError([f"Task file {str(path)!r} is not an lm-evaluation-harness task: it needs a `task:` name "
                           "(a group of tasks is given by its registry name)."])
    folder = path.resolve().parent
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    if "data_files" in kwargs:
        kwargs["data_files"] = _beside(kwargs["data_files"], folder)
    if isinstance(kwargs.get("data_dir"), str):
        kwargs["data_dir"] = _beside(kwargs["data_dir"], folder)
    return {**cfg, "dataset_kwargs": kwargs} if kwargs else cfg


def _beside(files: Any, folder: Path) -> Any:
    """`data_files` (a path, a list, or a dict of splits) with each relative path made relative to `folder`."""
    if isinstance(files, dict):
        return {split: _beside(value, folder) for split, value in files.items()}
    if isinstance(files, list):
        return [_beside(value, folder) for value in files]
    if isinstance(files, str) and "://" not in files and not Path(files).expanduser().is_absolute():
        return str(folder / files)
    return files


def load_tasks(specs: list[str | dict[str, Any]], manager: Any) -> list[Any]:
    """The harness's task objects, their data read (downloaded for a hub task): a task whose data cannot be had is
    one sentence naming the download it needs."""
    import datasets

    tasks = []
    for spec in specs:
        name = spec if isinstance(spec, str) else spec["task"]
        try:
            loaded = manager.load([spec])
        except (ConnectionError, OSError, datasets.exceptions.DatasetNotFoundError) as e:
            raise DataError(_unreachable(name, spec, manager, e)) from None
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"Benchmark {name!r} could not be loaded ({_first_line(e)}): check its task file and "
                            "data.") from None
        tasks += loaded["tasks"].values()
    return tasks


def _unreachable(name: str, spec: str | dict[str, Any], manager: Any, error: Exception) -> str:
    """The sentence for a task whose data could not be read: the hub dataset it needs, or the file it misses."""
    cfg = spec if isinstance(spec, dict) else (manager.task_index[name].cfg or {})
    quoted = re.search(r"Couldn't reach '([^']+)'", str(error))  # datasets: "… 'Rowan/hellaswag' on the Hub (…)"
    dataset = quoted.group(1) if quoted else cfg.get("dataset_path")
    if isinstance(spec, dict) or dataset is None:
        return f"Benchmark {name!r} could not read its data ({_first_line(error)}): check its task file's data files."
    subset = f" (subset {cfg['dataset_name']!r})" if cfg.get("dataset_name") and dataset == cfg.get("dataset_path") \
        else ""
    return (f"Benchmark {name!r} needs the dataset {dataset!r}{subset} from the Hugging Face Hub, which could not be "
            "downloaded (offline?): run it once with the network to cache it, or evaluate on a local task YAML file.")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def evaluate(model: Scored, tasks: list[Any], manager: Any, *, limit: int | None, batch_size: int | str,
             device: str) -> dict[str, Any]:
    """The harness's results for one model: its own entry point, on the tasks loaded before."""
    lm_eval = harness()
    try:
        return lm_eval.simple_evaluate(model="hf", model_args=model.model_args, tasks=tasks, task_manager=manager,
                                       limit=limit, batch_size=batch_size, device=device)
    except OSError as e:  # transformers' "not a folder nor reachable on the Hub", a missing weights file, …
        raise ModelError(load_failure(model.model_args["pretrained"], e)) from None


def scores(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task: each metric's value and the harness's standard error (None where it has none), the samples
    scored, few-shot count and task version."""
    out = {}
    for task, row in results["results"].items():
        metrics = {}
        for key, value in row.items():
            metric, comma, filtered = key.partition(",")
            if not comma or metric.endswith("_stderr") or not isinstance(value, int | float):
                continue
            stderr = row.get(f"{metric}_stderr,{filtered}")
            metrics[metric if filtered == "none" else key] = {
                "value": float(value), "stderr": float(stderr) if isinstance(stderr, int | float) else None}
        out[task] = {"metrics": metrics, "samples": results.get("n-samples", {}).get(task, {}).get("effective"),
                     "num_fewshot": results.get("n-shot", {}).get(task), "version": results["versions"].get(task)}
    return out


def run_benchmarks(target: str, benchmarks: str, *, base: bool = False, limit: int | None = None,
                   batch_size: int | str | None = None, memory_budget_gb: float | None = None,
                   progress: Any = None) -> dict[str, Any]:
    """Score a run's model (and with `base` its base model) on the benchmarks, each model at the batch size the
    planner chooses within the budget (`planned_batch`) unless `batch_size` is given; kept in RUN/benchmarks.json
    (merged with the tasks scored before) and returned."""
    lm_eval = harness()
    if limit is not None and limit < 1:
        raise ConfigError([f"--limit {limit}: give a number of examples per task of at least 1."])
    if memory_budget_gb is not None and memory_budget_gb <= 0:
        raise ConfigError([f"--memory-budget-gb {memory_budget_gb:g}: give a positive number of GiB."])
    names = parse_names(benchmarks)
    model_dir, run_dir = resolve_model_dir(target)
    models = scored_models(target, model_dir, run_dir, base=base)  # before the registry is indexed (seconds)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its INFO lines would bury the result
    manager = task_manager(names)
    tasks = load_tasks(check_names(names, manager), manager)
    device_name, budget = _budget(memory_budget_gb, run_dir)
    device = "cuda" if device_name.startswith("cuda") else "cpu"
    # Every model planned before the first is scored: a base that cannot fit is said before any work.
    plans = {model.name: None if batch_size == "auto" else planned_batch(
        model, tasks, limit=limit, budget=budget, device=device_name, given=batch_size) for model in models}
    scored = {}
    for model in models:
        plan = plans[model.name]
        if progress:
            progress(f"scoring the {'fine-tuned model' if model.name == 'model' else 'base model'} "
                     f"({model.model_args['pretrained']})" + (f": {render_eval(plan)}" if plan else ""))
        results = evaluate(model, tasks, manager, limit=limit, device=device,
                           batch_size=plan.batch_size if plan else "auto")
        scored[model.name] = {"model_args": model.model_args, "limit": limit,
                              "batch_size": plan.batch_size if plan else "auto",
                              **({"plan": plan.to_dict()} if plan else {}), "tasks": scores(results)}
    record = {"harness": f"lm-eval {lm_eval.__version__}", **scored}
    if run_dir is not None:
        write_json(run_dir / RESULTS, merged(run_dir / RESULTS, record))
    return record


def _budget(memory_budget_gb: float | None, run_dir: Path | None) -> tuple[str, int]:
    """(device, bytes) the evaluation plans for: `--memory-budget-gb`, else the run's `memory_budget_gb`, else
    the whole device (the first GPU, or this machine's RAM)."""
    device_name, total = device_memory()
    if memory_budget_gb is None and run_dir is not None:
        memory_budget_gb = read_yaml(run_dir / "config.yaml").get("memory_budget_gb")
    return device_name, int(float(memory_budget_gb) * GIB) if memory_budget_gb else total


def planned_batch(model: Scored, tasks: list[Any], *, limit: int | None, budget: int, device: str,
                  given: int | None = None) -> EvalPlan:
    """The harness's batch size for one model: the largest that fits the budget at its longest request
    (`eval_batch_size`), or the plan of the one `given`."""
    from transformers import AutoConfig, AutoTokenizer

    args = model.model_args
    tokenizer = AutoTokenizer.from_pretrained(args.get("tokenizer", args["pretrained"]))
    model_config = AutoConfig.from_pretrained(args["pretrained"])
    tokens = longest_request(tasks, tokenizer, model_config, limit=limit)
    if "peft" in args:  # the adapter on its base, shaped as it was trained
        adapter = json.loads((Path(args["peft"]) / "adapter_config.json").read_text(encoding="utf-8"))
        targets = adapter.get("target_modules")
        c = from_dict({"model": args["pretrained"], "task": task_of(Path(args["peft"])), "lora": "true",
                       "lora_r": adapter["r"], "lora_alpha": adapter["lora_alpha"],
                       "lora_target_modules": ",".join(sorted(targets)) if isinstance(targets, list) else
                       str(targets or "all-linear")})
        return eval_batch_size(c, tokens=tokens, budget=budget, device=device, lora=True, given=given)
    c = from_dict({"model": args["pretrained"], "task": kind_of_model_config(model_config.to_dict())})
    return eval_batch_size(c, tokens=tokens, budget=budget, device=device, given=given)


def longest_request(tasks: list[Any], tokenizer: Any, model_config: Any, *, limit: int | None) -> int:
    """The tokens of the longest request the harness will give the model for these tasks: a context with its
    continuation, a context with the tokens it may generate, or a rolling window, cut to the model's context
    (the harness's `max_length`) as the harness cuts it."""
    from lm_eval.evaluator_utils import get_sample_size
    from lm_eval.models.utils import resolve_max_length

    most = resolve_max_length(model_config, tokenizer)
    scored, prompts, generated = [], [], 0
    for task in tasks:
        with contextlib.redirect_stderr(io.StringIO()):  # its progress bar: the harness shows it again as it scores
            task.build_all_requests(limit=get_sample_size(task, limit), rank=0, world_size=1)
        for instance in task.instances:
            context, second = (instance.args + ("",))[:2]
            if instance.request_type == "generate_until":
                prompts.append(context)
                generated = max(generated, int((second or {}).get("max_gen_toks", GENERATED_TOKENS)))
            else:  # loglikelihood (multiple choice too): the context and its continuation in one forward
                scored.append(context + (second if isinstance(second, str) else ""))
    # A scored request's last token is only predicted, never fed (the harness's `[:-1]`).
    longest = max([len(ids) - 1 for ids in (tokenizer(scored)["input_ids"] if scored else [])]
                  + [len(ids) + generated for ids in (tokenizer(prompts)["input_ids"] if prompts else [])], default=1)
    return max(1, min(longest, most))


def merged(path: Path, record: dict[str, Any]) -> dict[str, Any]:
    """The run's benchmarks.json with this evaluation's tasks added (a task scored again replaces its entry)."""
    try:
        kept = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):  # a damaged file is replaced rather than blocking a new result
        kept = {}
    out = {**kept, "harness": record["harness"]}
    for name in ("model", "base"):
        if name in record:
            before = kept.get(name) if isinstance(kept.get(name), dict) else {}
            same = before.get("model_args") == record[name]["model_args"]
            tasks = {**(before.get("tasks", {}) if same else {}), **record[name]["tasks"]}
            out[name] = {**record[name], "tasks": tasks}
    return out


def table(record: dict[str, Any]) -> str:
    """The scores as a small text table, the fine-tuned model beside its base: value ± standard error."""
    rows = [("task", "metric", "fine-tuned", *(["base"] if "base" in record else []))]

    def cell(side: str, task: str, metric: str) -> str:
        m = record[side]["tasks"].get(task, {}).get("metrics", {}).get(metric)
        if m is None:
            return "-"
        return f"{m['value']:.4f}" + (f" ± {m['stderr']:.4f}" if m["stderr"] is not None else "")

    for task, result in record["model"]["tasks"].items():
        for metric in result["metrics"]:
            rows.append((task, metric, cell("model", task, metric),
                         *([cell("base", task, metric)] if "base" in record else [])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(text.ljust(w) for text, w in zip(row, widths, strict=True)).rstrip() for row in rows)
