"""`finetune` command line: train, sweep, plan, eval, predict, export, push, init, ui, jobs.

Exit codes: 0 done, 2 bad input (one sentence, no traceback, nothing overwritten), 130 stopped, 1 internal error,
3 trained and saved but the push to the Hub (or, on Hugging Face Jobs, the fetch from the bucket) failed.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import json
import os
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from finetune import registry as kinds
from finetune.building import BUILDS
from finetune.config.schema import Config, ConfigError, load
from finetune.errors import EXIT_STOPPED, FinetuneError, describe
from finetune.remote import backend
from finetune.remote.args import add_backend_arguments, add_jobs_parser
from finetune.train.stop import StopFlag

# Only the light modules above load at start: each command imports the engine (torch, transformers, …) inside its
# function when it runs, so that `finetune --help` answers at once.

EXIT_OK = 0


@contextlib.contextmanager
def _stop_handlers() -> Iterator[StopFlag]:
    """The flag that SIGINT/SIGTERM set within the block: the first signal finishes the optimizer step, checkpoints
    and exits 130; a second exits at once. The handlers they replace are back after the block."""
    stop = StopFlag()

    def handler(signum: int, frame: Any) -> None:
        if stop.requested:
            os._exit(EXIT_STOPPED)
        stop.request()
        print("\nStopping after this optimizer step (a checkpoint is saved; signal again to quit now).",
              file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _stopped_while_importing(stop: StopFlag) -> bool:
    """Import the engine (torch, accelerate, transformers) with the stop handlers already set, and say whether a
    stop came meanwhile: then the command ends before it loads anything.

    A SIGINT at Python's default raises KeyboardInterrupt wherever the import is, and the libraries do not all let it
    through: one that landed as torch's C extension imported numpy never came out (the run trained to its end), and
    one inside numpy's own import left a half-made module that the next import recursed on (a RecursionError, or
    "cannot load module more than once"): a Stop in a run's first second failed the run."""
    import finetune.train.loop  # noqa: F401  (the engine; its import is what takes the first seconds)

    if stop.requested:
        print("Stopped before training started; nothing was saved.", file=sys.stderr, flush=True)
    return stop.requested


def _load_config(args: argparse.Namespace) -> Config:
    """The config from `CONFIG [key=value …]`, where CONFIG may be left out (then the first word is an override)."""
    path = args.config if args.config and "=" not in args.config else None
    overrides = args.overrides if path or not args.config else [args.config, *args.overrides]
    return load(path, overrides)


def _print_note(event: Any) -> None:
    """Say on stderr what the start event tells a user: what `long_documents` did to the data (and a warning when
    most samples were cut), which conversations were left out (its `dropped_rows`), and when the run does not
    distribute as the launcher asked (its `note`)."""
    if getattr(event, "event", None) != "start":
        return
    for name, counts in (("training data", event.segmentation), ("evaluation data", event.eval_segmentation)):
        if counts is not None:
            print(f"{name}: {counts.sentence()}", file=sys.stderr, flush=True)
            if counts.warning:
                print(f"warning: {counts.warning}", file=sys.stderr, flush=True)
    if event.note:
        print(f"note: {event.note}", file=sys.stderr, flush=True)
    kernels = event.kernels or {}
    if kernels.get("note"):
        print(f"note: {kernels['note']}", file=sys.stderr, flush=True)
    if kernels.get("layers"):
        used = ", ".join(f"{repo} ({n} layer{'s' if n != 1 else ''})" for repo, n in kernels["layers"].items())
        print(f"hub kernels: {used}", file=sys.stderr, flush=True)
    from finetune.rows.chat import describe_dropped

    for what, counts in (("training", event.dropped_rows), ("evaluation", event.dropped_eval_rows)):
        if counts:
            print(f"note: {what} data: {describe_dropped(counts)}", file=sys.stderr, flush=True)


def cmd_train(args: argparse.Namespace) -> int:
    """Run `finetune train CONFIG [key=value …]` here, or on another backend (`--backend hf-jobs|slurm`)."""
    cfg = _load_config(args)
    backend.refuse_foreign_options(args)
    if args.backend != backend.LOCAL:
        return backend.get(args.backend).train(args, cfg)
    with _stop_handlers() as stop:
        if _stopped_while_importing(stop):
            return EXIT_STOPPED
        from finetune.run.events import ProgressBar, log_line
        from finetune.train.loop import train

        if args.doctor and os.environ.get("RANK", "0") == "0":  # one report, not one per process
            from finetune.doctor.report import findings, text

            print(text(findings(self_test=False, device=None, folder=Path.cwd())), file=sys.stderr, flush=True)
        # The notes first: printed after the bar is drawn, they would land on its line.
        callbacks = [_print_note, ProgressBar(disable=args.quiet)]
        if args.log_events:  # one line per event on stdout, for a launcher that reads the logs (a Hugging Face Job)
            callbacks.append(lambda event: print(log_line(event), flush=True))
        result = train(cfg, stop=stop, callbacks=callbacks)
        if result.status == "done" and result.is_main_process and result.config.push_to_hub:
            from finetune.use.hub import push_after_training

            # After `done`, with the stop handlers still on: a failed upload leaves the saved model as it is.
            push_after_training(result.run_dir, result.config, result.log)
    if not result.is_main_process:
        return EXIT_STOPPED if result.status == "stopped" else EXIT_OK
    if result.status == "stopped":
        print(f"Stopped at step {result.step}. Continue with: finetune train {result.run_dir / 'config.yaml'} "
              "resume=true", file=sys.stderr)
        return EXIT_STOPPED
    print(json.dumps({"run_dir": str(result.run_dir), **result.metrics}, indent=2))
    return EXIT_OK


def _say(sentence: str) -> None:
    """A sweep's progress, on stderr."""
    print(f"sweep: {sentence}", file=sys.stderr, flush=True)


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run `finetune sweep CONFIG [key=value …]`: the trials its `sweep:` section asks for, one run each."""
    from finetune.sweep.space import load_sweep

    cfg, spec = load_sweep(args.config, args.overrides)  # every problem of the search before anything is imported
    trials = _sweep_trials(args)
    with _stop_handlers() as stop:
        if _stopped_while_importing(stop):
            return EXIT_STOPPED
        from finetune.run.events import ProgressBar
        from finetune.sweep.study import optuna_module, run_sweep, sweep_folder
        from finetune.train.loop import train

        optuna_module()
        if trials is None:
            result = run_sweep(cfg, spec, sweep_folder(cfg, args.config), train=train, stop=stop, say=_say,
                               callbacks=[ProgressBar(disable=args.quiet)])
        else:
            from finetune.sweep.inflight import run_sweep_in_flight

            result = run_sweep_in_flight(cfg, spec, sweep_folder(cfg, args.config), launcher=trials,
                                         parallel=args.parallel, stop=stop, say=_say)
    best = result.summary["best"]
    _say(f"best: trial {best['number']} ({best['run']}), {spec.objective} {best['value']:.4g}" if best else
        "no trial finished")
    if result.status == "stopped":
        _say(f"stopped; continue with: finetune sweep {args.config}")
        return EXIT_STOPPED
    print(json.dumps({"sweep_dir": str(result.folder), **result.summary}, indent=2))
    return EXIT_OK


def _sweep_trials(args: argparse.Namespace) -> backend.Trials | None:
    """Where `finetune sweep` runs its trials: None for here, one at a time; else the backend `--backend` names,
    with its options, checked before anything runs."""
    backend.refuse_foreign_options(args)
    if args.parallel < 1:
        raise ConfigError([f"--parallel is how many trials run at once, at least 1, not {args.parallel}."])
    if args.backend == backend.LOCAL:
        if args.parallel > 1:
            raise ConfigError([f"--parallel {args.parallel} runs trials at once on another backend, but here they "
                               "train one at a time in this process: add --backend "
                               f"{' or --backend '.join(backend.REGISTRY)}, or drop --parallel."])
        return None
    runner = backend.get(args.backend)
    if not runner.sweeps:
        able = [b.name for b in backend.every() if b.sweeps]
        raise ConfigError([f"{runner.title} (--backend {runner.name}) cannot run a sweep's trials: use --backend "
                           f"{' or --backend '.join(able) or backend.LOCAL}, or leave --backend out."])
    if args.detach:
        raise ConfigError(["--detach starts one job and returns, but a sweep follows its trials to tell Optuna how "
                           "each ended: leave it out (after a stop, `finetune sweep` again re-attaches)."])
    runner.hardware(args)  # the flavor, the partition: one sentence before a trial is asked for
    return backend.Trials(runner, args)


def cmd_eval(args: argparse.Namespace) -> int:
    """Run `finetune eval RUN_OR_MODEL [key=value …]`, `--benchmarks TASK[,TASK…]` through lm-evaluation-harness, or
    `--data FILE`: an encoder's own metrics on an extra evaluation set."""
    if args.benchmarks is not None:
        from finetune.use.benchmarks import run_benchmarks, table

        if args.data is not None:
            raise ConfigError(["--benchmarks scores a language model with lm-evaluation-harness, --data an "
                               "encoder's own metrics: give one of them."])

        if args.overrides:
            raise ConfigError([f"{args.overrides[0]!r}: key=value options choose the data of the run's own metrics; "
                               "--benchmarks takes none."])
        record = run_benchmarks(args.target, args.benchmarks, base=args.base, limit=args.limit,
                                batch_size=args.batch_size, memory_budget_gb=args.memory_budget_gb,
                                progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(table(record), file=sys.stderr)
        print(json.dumps(record, indent=2))
        return EXIT_OK
    if args.data is not None:
        from finetune.use.benchmarks import table
        from finetune.use.heldout import run_heldout

        if args.limit is not None or args.batch_size is not None or args.memory_budget_gb is not None:
            raise ConfigError(["--limit, --batch-size and --memory-budget-gb go with --benchmarks; --data scores "
                               "the whole evaluation set."])
        if any(o.split("=", 1)[0] == "dataset" for o in args.overrides):
            raise ConfigError(["--data names the evaluation set: give it once, without dataset=…."])
        record = run_heldout(args.target, args.data, base=args.base, overrides=args.overrides,
                             progress=lambda s: print(s, file=sys.stderr, flush=True))
        print(table(record), file=sys.stderr)
        print(json.dumps(record, indent=2))
        return EXIT_OK
    if args.base or args.limit is not None:
        raise ConfigError([f"{'--base' if args.base else '--limit'} goes with --benchmarks TASK[,TASK…]"
                           + (" or --data FILE." if args.base else ".")])
    from finetune.use.evaluate import evaluate_target

    print(json.dumps(evaluate_target(args.target, args.overrides), indent=2))
    return EXIT_OK


def cmd_predict(args: argparse.Namespace) -> int:
    """Run `finetune predict MODEL TEXT… | --file F`."""
    from finetune.use.predict import predict

    texts = list(args.texts)
    if args.file:
        p = Path(args.file)
        if not p.is_file():
            raise ConfigError([f"Input file {args.file!r} does not exist."])
        texts += [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    task_name = args.task
    if texts and texts[0].startswith("task="):  # `finetune predict RUN task=<name> TEXT…`, as eval takes it
        task_name, texts = texts[0].removeprefix("task="), texts[1:]
    if not texts:
        raise ConfigError(["Nothing to predict: give texts as arguments or --file with one text per line."])
    tools = None
    if args.tools:
        from finetune.use.toolcalls import read_tools

        tools = read_tools(args.tools)
    for result in predict(args.model, texts, max_new_tokens=args.max_new_tokens, chat=args.chat,
                          task_name=task_name, temperature=args.temperature, top_p=args.top_p,
                          system_prompt=args.system_prompt, tools=tools):
        print(json.dumps(result, ensure_ascii=False))
    return EXIT_OK


def cmd_plan(args: argparse.Namespace) -> int:
    """Run `finetune plan [CONFIG] [key=value …]`: print the plan and optionally write plan.json."""
    from finetune.data.load import load_data
    from finetune.engine.runtime import make_accelerator, requested_mode, resolve_precision
    from finetune.models.pretrained import load_tokenizer
    from finetune.plan.planner import plan_run, render
    from finetune.run.rundir import write_json

    cfg = _load_config(args)
    # As a launcher would run it: FSDP when asked for (or accelerate's variable says so) and more than one process.
    distributed = args.distributed or requested_mode() or "ddp"
    distributed = "single" if args.num_processes == 1 else distributed
    if cfg.tasks:  # multi-task: the largest single task's graph (finetune.train.multitask)
        from finetune.data.mixing import MultiData, load_tasks
        from finetune.train.multitask import plan_tasks

        data = MultiData(cfg, load_tasks(cfg, load_tokenizer(cfg)))
        plan = plan_tasks(cfg, data, num_processes=args.num_processes, distributed=distributed)
        train_data = eval_data = None
    else:
        planned = _planned_device(args.device, cfg)
        host = _stated_host(args.host_memory_gb)
        train_data, eval_data, label_names = load_data(cfg, load_tokenizer(cfg), num_processes=args.num_processes)
        # Where `finetune train` would probe (not for a device elsewhere: the dry run alone plans for it).
        device = None if planned else make_accelerator(resolve_precision(cfg.precision)).device
        if args.longest:  # before the plan, so that a refusal still answers it
            from finetune.plan.planner import HostMemory, explain_longest, longest_context

            terms: dict[str, int] = {}
            tokens, rung = longest_context(cfg, len(label_names or []), device=planned, host=host,
                                           explain=terms if args.explain else None)
            print(f"longest context: fits {cfg.memory_budget_gb:g} GiB up to {tokens} tokens at micro-batch 1 "
                  f"({rung})")
            if "activation offload" in rung or cfg.activation_offload == "true":  # the RAM they were checked against
                print(f"offloaded activations checked against {(host or HostMemory.here()).words}")
            if args.explain and tokens:
                print(explain_longest(cfg, len(label_names or []), tokens, terms, device=planned))
        plan, _ = plan_run(cfg, train_data.widths, label_names, num_processes=args.num_processes, device=device,
                           distributed=distributed, planned_device=planned, host=host)
        plan = dataclasses.replace(plan, time=_predicted_time(cfg, plan, train_data, eval_data, device, args.gpu))
    print(render(plan))
    # What long_documents does to the data, beside the plan (the GUI shows it before a run starts).
    data = {"segmentation": getattr(train_data, "segmentation", None),
            "eval_segmentation": getattr(eval_data, "segmentation", None)}
    for name, counts in zip(("training data", "evaluation data"), data.values(), strict=True):
        if counts is not None:
            print(f"{name}: {counts.sentence()}" + (f"\nwarning: {counts.warning}" if counts.warning else ""))
    if args.json:
        write_json(Path(args.json), {**plan.to_dict(),
                                     **{k: dataclasses.asdict(v) for k, v in data.items() if v is not None}})
    return EXIT_OK


def _predicted_time(cfg: Any, plan: Any, train_data: Any, eval_data: Any, device: Any, gpu: str | None
                    ) -> dict[str, Any]:
    """The plan's predicted time (`finetune.plan.timing`): on this machine, or on `gpu` (a GPU model of
    `finetune.plan.timing.PEAK_TFLOPS`, a Jobs flavor's); {} where the data's lengths are not known (a stream)."""
    import torch
    from transformers import AutoConfig

    from finetune.data.load import Encoded
    from finetune.models.pretrained import auto_class, resolve_model_path
    from finetune.plan import timing
    from finetune.train.loop import run_length

    if not isinstance(train_data, Encoded) or not len(train_data) or (device is None and not gpu):
        return {}  # a stream, or a GPU elsewhere whose model is not named (`--device cuda` without `--gpu`)
    _, steps = run_length(cfg, plan.batch, len(train_data))
    config = AutoConfig.from_pretrained(resolve_model_path(cfg.model), trust_remote_code=cfg.trust_remote_code)
    with BUILDS, torch.device("meta"):  # its size, not its weights
        params, width = timing.model_size(auto_class(cfg.task).from_config(config,
                                                                           trust_remote_code=cfg.trust_remote_code))
    return timing.for_run(plan, lengths=train_data.lengths, steps=steps, eval_every=cfg.eval_every,
                          eval_lengths=eval_data.lengths if isinstance(eval_data, Encoded) else None, params=params,
                          width=width, device=str(device or "cpu"),
                          gpu=(gpu, plan.batch.num_processes) if gpu else None, kind=cfg.task,
                          model=cfg.model).to_dict()


def _stated_host(gib: float | None) -> Any:
    """`--host-memory-gb`: the RAM of the machine the plan is for (a `HostMemory`), or None for this machine's."""
    if gib is None:
        return None
    if not gib > 0:
        raise ConfigError([f"--host-memory-gb must be a positive number of GiB (the RAM of the machine the plan is "
                           f"for), not {gib:g}."])
    from finetune.plan.planner import HostMemory

    return HostMemory.stated(gib)


def _planned_device(device: str, cfg: Any) -> tuple[str, int] | None:
    """`--device cuda`: (name, bytes) of the CUDA GPU the budget describes, planned for from any machine."""
    if device != "cuda":
        return None
    if not cfg.memory_budget_gb:
        raise ConfigError(["`--device cuda` plans for a GPU of memory_budget_gb GiB: set memory_budget_gb to that "
                           "GPU's memory (for example memory_budget_gb=24)."])
    return f"cuda (planned for a {cfg.memory_budget_gb:g} GiB GPU)", int(cfg.memory_budget_gb * 2**30)


def cmd_push(args: argparse.Namespace) -> int:
    """Run `finetune push RUN_DIR REPO`: the run's model and its model card to the Hub."""
    from finetune.config.schema import repo_id_problem
    from finetune.errors import PushError
    from finetune.models.pretrained import resolve_model_dir
    from finetune.use import hub

    if problem := repo_id_problem(args.repo):
        raise ConfigError([problem.replace("`push_to_hub`", "REPO")])
    model_dir, run_dir = resolve_model_dir(args.run_dir)  # no final model: one sentence, before any network call
    export_dir = None
    if args.export is not None:  # the export: one sentence when there is none, before any network call
        export_dir = Path(args.export) if args.export else (run_dir or model_dir.parent) / "export"
        hub.export_uploads(run_dir or model_dir.parent, export_dir)
        model_dir = export_dir
    token = hub.token()
    hub.check_can_push(args.repo, token)
    try:
        if export_dir is not None:
            result = hub.push_export(Path(args.run_dir), args.repo, export_dir=export_dir, private=not args.public,
                                     hub_token=token)
        else:
            result = hub.push_run(Path(args.run_dir), args.repo, private=not args.public, hub_token=token)
    except hub.UPLOAD_ERRORS as e:
        raise PushError(f"Pushing {model_dir} to {args.repo} failed ({hub.describe_failure(e, token)}); the model "
                        "is unchanged: try again.") from None
    print(json.dumps({"repo_id": result.repo_id, "url": result.url, "commit": result.commit}, indent=2))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    """Run `finetune export RUN [--format merged|gguf] [--quant …] [--ollama] [--out DIR]`."""
    from finetune.use.export import describe_check, export
    from finetune.use.ollama import create_command

    result = export(args.run_dir, fmt=args.format, quant=args.quant, out=args.out, ollama_file=args.ollama,
                    dtype=args.dtype, check=args.check, check_tokens=args.check_tokens, llama_cpp=args.llama_cpp,
                    progress=lambda stage: print(f"export: {stage}…", file=sys.stderr, flush=True))
    if result.check is not None:
        print(describe_check(result.check), file=sys.stderr)
    if result.modelfile is not None:
        name = Path(args.run_dir).resolve().name
        print(f"Make it an Ollama model with: {create_command(result.modelfile, name)}", file=sys.stderr)
    print(json.dumps(result.to_dict(), indent=2))
    return EXIT_OK


def cmd_init(args: argparse.Namespace) -> int:
    """Write a commented example config."""
    from finetune.config.schema import template

    out = Path(args.path)
    if out.exists() and not args.force:
        raise ConfigError([f"{args.path!r} already exists: choose another path or pass --force."])
    out.write_text(template(), encoding="utf-8")
    print(f"Wrote {out}; edit it, then run: finetune train {out}")
    return EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    """Run `finetune jobs follow|status|cancel|fetch|flavors` (runs on Hugging Face Jobs)."""
    from finetune.remote.cli import jobs_command

    return jobs_command(args)


def cmd_ui(args: argparse.Namespace) -> int:
    """Run `finetune ui`: serve the GUI (the `app` package, a thin client of this CLI)."""
    from app.serve import serve

    return serve(args)


def kind_options_help() -> str:
    """The options each task kind brings, by kind (their registry entries' declarations), for `train --help`."""
    lines = ["options a task kind brings (every option, with its help: `finetune init`, docs/configuration.md):"]
    for e in kinds.ENTRIES.values():
        if e.declares:
            names = ", ".join(o.name for o in e.declares)
            lines += textwrap.wrap(f"task={e.name}: {names}", width=100, initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `finetune` command."""
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune Transformers models within a memory "
                                     "budget, with exact gradient accumulation.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_sweep(sub)
    _add_plan(sub)
    _add_eval(sub)
    _add_predict(sub)
    _add_push(sub)
    _add_export(sub)
    _add_init(sub)
    add_jobs_parser(sub, cmd_jobs)
    add_doctor_parser(sub)
    try:
        from app.door.server import build_parser as ui_parser  # argparse only: gradio is imported when `ui` runs
    except ImportError:  # installed without the GUI package: every other command still works
        return parser
    p = sub.add_parser("ui", parents=[ui_parser()], add_help=False, help="Open the GUI (the same as `python -m app`).",
                       description="Serve the fine-tuning GUI; every run it starts is a `finetune train` command.")
    p.set_defaults(func=cmd_ui)
    return parser


def _add_train(sub: Any) -> None:
    """`finetune train`: fine-tune as a config says."""
    p = sub.add_parser("train", help="Fine-tune a model.", description="Fine-tune as CONFIG says; key=value "
                       "arguments override its options (CONFIG may be left out).", epilog=kind_options_help(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", nargs="?", help="YAML config file (see `finetune init`).")
    p.add_argument("overrides", nargs="*", help="key=value options, e.g. learning_rate=2e-5 epochs=1")
    p.add_argument("-q", "--quiet", action="store_true", help="No progress bar.")
    p.add_argument("--log-events", action="store_true", help="Also print each event on stdout as one line "
                   "(`finetune-event: {json}`, its events.jsonl record), for a launcher that reads the logs.")
    p.add_argument("--doctor", action="store_true", help="First print what `finetune doctor --no-self-test` finds "
                   "(versions, devices, memory) on stderr: how a Hugging Face Job's log starts.")
    add_backend_arguments(p)
    p.set_defaults(func=cmd_train)


def _add_sweep(sub: Any) -> None:
    """`finetune sweep`: one run per trial of the config's `sweep:` section."""
    p = sub.add_parser("sweep", help="Search hyper-parameters: one run per trial (the config's `sweep:` section).",
                       description="Run the trials the config's `sweep:` section asks for (objective, direction, "
                       "trials, sampler, space), one after another, each planned into memory_budget_gb and trained "
                       "as a run beside the sweep's folder; with --backend hf-jobs|slurm, --parallel N of them at "
                       "once as remote runs, each planned for the backend's GPUs. Again after a stop or crash, it "
                       "runs only what is left and re-attaches to trials still running (docs/sweeps.md).")
    p.add_argument("config", help="YAML config file with a `sweep:` section.")
    p.add_argument("overrides", nargs="*", help="key=value options of the runs, e.g. max_steps=20")
    p.add_argument("-q", "--quiet", action="store_true", help="No progress bar.")
    p.add_argument("--parallel", type=int, default=1, help="Trials in flight at once, each a run on --backend "
                   "hf-jobs or slurm (default 1; here, trials train one at a time).")
    add_backend_arguments(p)
    p.set_defaults(func=cmd_sweep)


def _add_plan(sub: Any) -> None:
    """`finetune plan`: how a config would train within its memory budget."""
    p = sub.add_parser("plan", help="Show how a config would train within its memory budget.",
                       description="Predict peak memory and choose micro-batch, accumulation, checkpointing and "
                       "LoRA for memory_budget_gb; exit 2 when nothing fits.")
    p.add_argument("config", nargs="?", help="YAML config file.")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. memory_budget_gb=8 effective_batch_size=64")
    p.add_argument("--json", help="Also write the plan here (plan.json).")
    p.add_argument("--num-processes", type=int, default=int(os.environ.get("WORLD_SIZE", "1")),
                   help="Processes the run will use (default: 1, or WORLD_SIZE under a launcher).")
    p.add_argument("--distributed", choices=["ddp", "fsdp"], default=None,
                   help="How the processes share the model: ddp (each holds all of it) or fsdp (weights, gradients "
                   "and optimizer state sharded); default: fsdp when ACCELERATE_USE_FSDP says so, else ddp.")
    p.add_argument("--device", choices=["here", "cuda"], default="here",
                   help="Plan for this machine (default) or for a CUDA GPU of memory_budget_gb GiB, from any machine "
                   "(its bf16 precision, CUDA context and allocator overhead counted).")
    p.add_argument("--gpu", metavar="MODEL", help="Predict the run's time on this GPU model (T4, L4, A10G, A100, "
                   "H100, …: finetune/plan/timing.py's PEAK_TFLOPS) instead of measuring this machine.")
    p.add_argument("--host-memory-gb", type=float, default=None, metavar="GIB",
                   help="The RAM of the machine the plan is for, which activation offload's host copies must fit "
                   "(80 %% of it; default: this machine's). Plans for another machine from this one.")
    p.add_argument("--longest", action="store_true",
                   help="Also print the largest max_length whose sample fits memory_budget_gb at micro-batch 1, on "
                   "the cheapest rung of the ladder the config allows.")
    p.add_argument("--explain", action="store_true",
                   help="With --longest: the predicted memory terms at that length, largest first, and which of "
                   "the ladder's last steps (tiled MLP, activation offload) it needed.")
    p.set_defaults(func=cmd_plan)


def _add_eval(sub: Any) -> None:
    """`finetune eval`: a run's or a saved model's evaluation, or benchmarks."""
    p = sub.add_parser("eval", help="Evaluate a run's model or a saved model.")
    p.add_argument("target", help="A run directory or a model folder.")
    p.add_argument("overrides", nargs="*", help="key=value, e.g. dataset=val.csv eval_split=validation")
    p.add_argument("--benchmarks", metavar="TASK[,TASK…]", help="Score the model with EleutherAI's "
                   "lm-evaluation-harness instead: registry tasks (hellaswag, mmlu, …) or task YAML files; the scores "
                   "go to RUN/benchmarks.json (docs/evaluations.md).")
    p.add_argument("--data", metavar="FILE", help="An encoder run (classification, regression, token "
                   "classification, embedding): its own metrics on this extra evaluation set, read with the run's "
                   "columns; the scores go to RUN/benchmarks.json (docs/evaluations.md).")
    p.add_argument("--base", action="store_true", help="Benchmarks or --data: also score the model the run started "
                   "from (a classifier's with a random, untrained head).")
    p.add_argument("--limit", type=int, metavar="N", help="Benchmarks: score only the first N examples of each task.")
    p.add_argument("--batch-size", type=lambda v: v if v == "auto" else int(v), metavar="N|auto",
                   help="Benchmarks: the harness's batch size, or auto for the harness's own search (default: the "
                   "largest, up to 64, that the planner fits in the memory budget at the longest request).")
    p.add_argument("--memory-budget-gb", type=float, metavar="GIB", help="Benchmarks: the device memory the "
                   "evaluation's batch must fit (default: the run's memory_budget_gb, else the whole device).")
    p.set_defaults(func=cmd_eval)


def _add_predict(sub: Any) -> None:
    """`finetune predict`: a trained model on texts."""
    p = sub.add_parser("predict", help="Run a trained model on texts.")
    p.add_argument("model", help="A run directory, one of its checkpoints (RUN/checkpoints/step-0000040) or a model "
                   "folder.")
    p.add_argument("texts", nargs="*", help="Texts to classify or continue.")
    p.add_argument("--file", help="A file with one text (or JSON conversation) per line.")
    p.add_argument("--max-new-tokens", type=int, help="Generating models: the most tokens to generate (default: the "
                   "model's generation_config, else 40).")
    p.add_argument("--temperature", type=float, help="Generating models: 0 for greedy, above 0 to sample (default: "
                   "the model's generation_config, else greedy).")
    p.add_argument("--top-p", type=float, help="Sampling: draw from the likeliest tokens whose probabilities add up "
                   "to this (default: the model's generation_config, else 1).")
    p.add_argument("--system-prompt", default="", help="Chat: a system turn before each conversation.")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="Causal LM: answer each text (or JSON conversation) as the assistant, through the model's "
                   "chat template, or continue it as plain text (--no-chat). Default: chat with a run that trained "
                   "on conversations, or with a model folder that has a chat template.")
    p.add_argument("--task", help="Multi-task model: the task to use (also given as task=<name> before the texts).")
    p.add_argument("--tools", metavar="FILE", help="Chat: a JSON file with a list of tools (function schemas) "
                   "offered to the model through its chat template's tools support; each record then holds the raw "
                   "reply and the tool calls parsed from it (Qwen/Hermes, Mistral and Llama 3.1 formats).")
    p.set_defaults(func=cmd_predict)


def _add_push(sub: Any) -> None:
    """`finetune push`: a run's model and its card to the Hub."""
    p = sub.add_parser("push", help="Push a run's model, with a generated model card, to the Hugging Face Hub.",
                       description="Upload RUN_DIR's model/ (or LoRA adapter) and a generated README.md model card "
                       "to the Hub repository REPO (created if needed); the token comes from HF_TOKEN or `hf auth "
                       "login`. Exit 3 when the upload fails.")
    p.add_argument("run_dir", help="A finished run's directory, or one of a stopped run's checkpoints "
                   "(RUN/checkpoints/step-0000040, exported to its own export/ folder).")
    p.add_argument("repo", help="Hub repository id, e.g. your-name/my-model.")
    p.add_argument("--public", action="store_true", help="Create the repository as public (default: private).")
    p.add_argument("--export", nargs="?", const="", default=None, metavar="DIR",
                   help="Push the run's export instead (`finetune export`; default RUN/export/): the merged folder, "
                   "or the GGUF(s) and Modelfile, with a card that says how to run them in Ollama and llama.cpp.")
    p.set_defaults(func=cmd_push)


def _add_export(sub: Any) -> None:
    """`finetune export`: merged weights or a GGUF for local inference."""
    p = sub.add_parser("export", help="Export a finished run for local inference: merged weights or a GGUF.",
                       description="Write RUN's model as a plain transformers folder with the adapter merged in "
                       "(--format merged), or as a GGUF for llama.cpp and Ollama made by llama.cpp's own converter "
                       "and quantizer (--format gguf), with the chat template and end-of-turn token it trained "
                       "with; a GGUF is then checked against transformers (greedy tokens, stopping).")
    p.add_argument("run_dir", help="A finished run's directory, or one of a stopped run's checkpoints "
                   "(RUN/checkpoints/step-0000040, exported to its own export/ folder).")
    p.add_argument("--format", choices=["merged", "gguf"], default="merged", help="What to write (default: merged).")
    p.add_argument("--quant", choices=["f16", "q8_0", "q4_k_m"], default=None,
                   help="GGUF: the number format (default: f16; q8_0 and q4_k_m are quantized from it).")
    p.add_argument("--ollama", action="store_true", help="GGUF: also write an Ollama Modelfile beside it.")
    p.add_argument("--out", help="Where to write (default: RUN/export/, a checkpoint's CHECKPOINT/export/).")
    p.add_argument("--dtype", choices=["auto", "float16", "bfloat16", "float32"], default="auto",
                   help="The merged weights' dtype (default: the base model's half dtype, else float16).")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="GGUF: compare llama.cpp's greedy tokens with transformers' (default: on).")
    p.add_argument("--check-tokens", type=int, default=32, help="GGUF: tokens the check generates (default: 32).")
    p.add_argument("--llama-cpp", help="A llama.cpp checkout whose convert_hf_to_gguf.py to use (default: the one "
                   "of the installed llama-cpp-python release).")
    p.set_defaults(func=cmd_export)


def _add_init(sub: Any) -> None:
    """`finetune init`: a commented example config."""
    p = sub.add_parser("init", help="Write a commented example config.")
    p.add_argument("path", nargs="?", default="finetune.yaml")
    p.add_argument("--force", action="store_true", help="Replace an existing file.")
    p.set_defaults(func=cmd_init)


def add_doctor_parser(sub: Any) -> None:
    """The `finetune doctor` command."""
    p = sub.add_parser("doctor", help="Check this machine: package versions, devices, memory, a short self-test.",
                       description="Print every dependency's version against the supported range, the devices and "
                       "their memory, bf16/fp16 support, bitsandbytes' backend, hub kernels, RAM and free disk; then "
                       "train one window of a tiny model in each precision the device has and check that k "
                       "micro-batches of B equal one batch of k·B and that the planner's predicted peak holds. Exit "
                       "0 when all is well, else 2 with one sentence per problem.")
    p.add_argument("--json", action="store_true", help="Print the findings as one JSON object.")
    p.add_argument("--no-self-test", dest="self_test", action="store_false",
                   help="Only report the versions and the machine (no training).")
    p.add_argument("--device", default=None, help="The device to test (default: cuda when there is one, else cpu).")
    p.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    """Run `finetune doctor [--json] [--no-self-test]`."""
    from finetune.doctor.report import run_doctor

    return run_doctor(json_output=args.json, self_test=args.self_test, device=args.device)


# Commands that run without the engine's packages, so that a machine with a too-old one can still be checked.
WITHOUT_PACKAGE_CHECK = {"init", "doctor"}


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, and map failures to exit codes with one clear message."""
    try:
        args = build_parser().parse_args(argv)  # building the parser imports modules: a Stop may land there
        if args.command not in WITHOUT_PACKAGE_CHECK:
            from finetune.config.versions import require

            require()  # before any command imports torch or transformers: a too-old one is a sentence, not a crash
        return args.func(args)
    except FinetuneError as e:  # bad input exits 2, a training failure 1: each class carries its code
        print(f"error: {describe(e)}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_STOPPED


def run() -> None:
    """The `finetune` command (`python -m finetune`): `main`, then exit without tearing the interpreter down."""
    code = main()
    # Once a command has returned, every file it wrote is closed; what is left is unloading torch, transformers and
    # thousands of modules one by one, which took longer than a whole optimizer step (docs/benchmarks.md, "Step 1
    # against a bare transformers script"). Threads are waited for and exit handlers (logging, multiprocessing,
    # temporary folders) run as at a normal exit; only that teardown is skipped.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
