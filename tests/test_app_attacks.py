"""The shared server tried as an attacker would (issue #18): each reproduction of the second attack pass now fails
safely, with its sentence, through the route a visitor uses (the page's events as Gradio calls them, the scripting
API, HTTP). Two accounts, alice and bob, as in tests/test_app_access.py; a Space for the anonymous visitor."""

from __future__ import annotations

import time
from pathlib import Path

import gradio as gr
import pytest
import test_app_access
from test_app_access import ALICE, ANON, BOB, _config, _signed_in, _space

from app.api import ScriptApi
from app.door.access import AccessError, resolve_output_dir
from app.door.policy import GATES
from app.local.training import JobBusy, JobManager
from app.mapping import COLUMN_FIELDS, in_form_words, parse_config
from app.page import build
from app.tabs import Handlers, handlers
from app.train import preview
from finetune.config.schema import ConfigError, from_dict, sources
from finetune.data.load import builder_names, is_local
from finetune.errors import DataError

shared = test_app_access.shared  # the fixture: two password accounts, an upload each
SECRET = "alice secret sentence one"
# Nine times more values per level: `epochs: *l8` is 9**9 = 387 million strings, written in 480 bytes.
BOMB = "\n".join(["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
                 + [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9)]) + "\nepochs: *l8\n"


@pytest.fixture
def space_env(monkeypatch):
    """What a Space with `hf_oauth: true` sets, so that a page with the Sign-in button can be built here."""
    from gradio import oauth

    monkeypatch.setenv("SPACE_ID", "owner/finetune")
    monkeypatch.setenv("SYSTEM", "spaces")
    for name in ("OAUTH_CLIENT_ID", "OAUTH_CLIENT_SECRET", "OAUTH_SCOPES", "OPENID_PROVIDER_URL"):
        monkeypatch.setattr(oauth, name, "https://huggingface.co" if name == "OPENID_PROVIDER_URL" else "x")


def _secret_upload(ctl: Handlers, tmp_path: Path) -> str:
    """A file of alice's, kept as her upload, whose one class is a sentence only she knows."""
    src = tmp_path / "gradio-secret" / "train.csv"
    src.parent.mkdir()
    src.write_text("text,label\n" + "".join(f"{SECRET},{SECRET}\n" for _ in range(4)))
    none = [""] * len(COLUMN_FIELDS)
    return ctl.dataset.on_upload(str(src), "", "train", "classification", *none, request=ALICE).dataset


def _timed(work):
    start = time.perf_counter()
    out = work()
    return out, time.perf_counter() - start


# --- 1. every file a config names, anywhere, goes through one policy
def test_the_schema_walk_finds_every_source_each_task_included():
    config = from_dict({"tasks": [{"name": "a", "dataset": "a.csv", "eval_dataset": "e.csv"},
                                  {"name": "b", "dataset": "b.csv"}], "chat_template": "t.jinja"})
    assert [(where, kind) for where, kind, _ in sources(config)] == [
        ("model", "model"), ("chat_template", "file"), ("tasks[a].dataset", "data"),
        ("tasks[a].eval_dataset", "data"), ("tasks[b].dataset", "data")]
    # A field that names a file and forgets to say so would escape the walk: every field whose help speaks of a
    # file, folder or hub id is marked.
    from finetune.config.schema import FIELDS

    unmarked = [name for name, f in FIELDS.items() if not f.metadata.get("source")
                and any(w in f.metadata["help"].lower() for w in ("file", "folder", " id ", "directory"))]
    assert unmarked == []


def test_a_task_dataset_of_someone_else_is_refused_on_plan_start_and_the_tasks_table(shared, tmp_path):
    ctl, uploads = shared
    secret = _secret_upload(ctl, tmp_path)
    tasks = [{"name": "a", "dataset": secret, "label_column": "text", "max_train_samples": 1},
             {"name": "b", "dataset": uploads["bob"]}]
    refusal = f"`tasks[a].dataset` {secret!r} is not one of your uploads"
    with pytest.raises(Exception, match=r"tasks\[a\]\.dataset") as plan:
        ctl.plan.make_plan(_config(tasks=tasks), request=BOB)
    assert SECRET not in str(plan.value) and str(plan.value).startswith(refusal)
    started = ctl.run.start_run(_config(tasks=tasks), request=BOB)
    assert not started.started and started.message.startswith(refusal) and SECRET not in started.message
    # The app's own run state is no dataset either.
    state = [{"name": "a", "dataset": "runs/current.json", "text_column": "owner", "label_column": "run_dir"},
             {"name": "b", "dataset": uploads["bob"]}]
    with pytest.raises(Exception, match="is not one of your uploads"):
        ctl.plan.make_plan(_config(tasks=state), request=BOB)
    # The private Tasks-table event: refused for bob, shown for alice.
    yaml_text = f"- name: a\n  dataset: {secret}\n- name: b\n  dataset: {uploads['bob']}\n"
    table = ctl.dataset.tasks_table(yaml_text, "proportional", 2.0, None, request=BOB)
    assert table.note.startswith(f"⚠️ {refusal}") and table.table.empty
    mine = ctl.dataset.tasks_table(f"- name: a\n  dataset: {secret}\n- name: b\n  dataset: {uploads['alice']}\n",
                                   "proportional", 2.0, None, request=ALICE)
    assert list(mine.table["rows"]) == [4, 37] and mine.note == ""
    assert ctl.dataset.tasks_table(yaml_text, "proportional", 2.0, None, request=ANON).note == "⚠️ Sign in to train."


def test_a_chat_template_anywhere_but_the_users_uploads_is_refused(shared):
    ctl, uploads = shared
    for template in ("tmpl", "/etc/hostname", "runs/current.json"):
        started = ctl.run.start_run(_config(dataset=uploads["bob"], chat_template=template), request=BOB)
        assert not started.started and started.message == (f"`chat_template` {template!r} is not one of your "
                                                           "uploads: upload the file.")


# --- 2. datasets' builder names are not hub ids
def test_builder_names_are_never_hub_ids(shared, tmp_path):
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    assert set(_PACKAGED_DATASETS_MODULES) <= builder_names()
    assert is_local("csv") and is_local("Text") and not is_local("glue") and not is_local("csv/reviews")
    ctl, _ = shared
    for name in ("csv", "json", "text", "parquet", "imagefolder"):
        message = (f"`dataset` {name!r} is the name of a `datasets` file builder, which reads files from the "
                   "server's folders: upload your file, or give a Hugging Face hub dataset id.")
        shown = ctl.dataset.refresh_dataset(name, "", "train", "classification", *[""] * len(COLUMN_FIELDS),
                                            request=BOB)
        assert shown.error == f"⚠️ {in_form_words(message)}" and shown.preview.empty
        started = ctl.run.start_run(_config(dataset=name), request=BOB)
        assert not started.started and started.message == message
    # On the command line too, `dataset: csv` is a mistake worded as one, not a search of the working folder.
    from finetune.data.load import load_table

    with pytest.raises(DataError, match="is the name of a `datasets` file builder, not a dataset"):
        load_table("csv")


# --- 3. bounded work: the alias bomb, summaries, caps
def test_the_alias_bomb_is_refused_at_once_through_the_api_and_the_tasks_box(tmp_path):
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"), access=_space())
    api = ScriptApi(ctl)
    out, seconds = _timed(lambda: api.plan(BOMB, _signed_in("alice")))
    assert seconds < 1.0 and out == {"error": "The config's YAML expands to more than 10,000 values (through "
                                              "`&anchor`/`*alias` references): write the values out."}
    out, seconds = _timed(lambda: api.start(BOMB, _signed_in("alice")))
    assert seconds < 1.0 and not out["started"] and "expands to more than 10,000 values" in out["message"]
    # The Tasks text box of the page, as the anonymous visitor of a Space and as a signed-in user.
    tasks_yaml = "- &t {name: a, dataset: x.csv, weight: &w [" + ", ".join(["1"] * 9) + "]}\n" + "\n".join(
        f"- {{name: b{i}, dataset: x.csv, weight: &w{i} [{', '.join(['*w' if i == 0 else f'*w{i - 1}'] * 9)}]}}"
        for i in range(8))
    for request in (ANON, _signed_in("alice")):
        shown, seconds = _timed(lambda r=request: ctl.dataset.tasks_table(tasks_yaml, "proportional", 2.0, None,
                                                                          request=r))
        assert seconds < 1.0 and len(shown.note) < 300, shown.note
    assert "expands to more than 10,000" in ctl.dataset.tasks_table(tasks_yaml, "proportional", 2.0, None,
                                                                    request=_signed_in("alice")).note


def test_errors_show_a_bounded_summary_of_a_value_never_its_repr():
    nested = ["x" * 1000] * 100_000  # what a JSON mapping of the API can hold without aliases
    with pytest.raises(ConfigError) as e:
        from_dict({"epochs": nested, "lora": nested, "report_to": nested, "tasks": [nested, "y" * 10**6],
                   "max_steps": "9" * 10**6, "text_column": "a\x00b"})
    assert max(len(p) for p in e.value.problems) < 200, e.value.problems
    assert "`epochs` must be a single value, not a list of 100,000 items." in e.value.problems
    assert "`text_column` may not contain a null character." in e.value.problems


def test_oversized_inputs_null_bytes_and_long_run_names_are_refused_with_a_sentence(tmp_path):
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"), access=_space())
    admit = ctl.state.policy.admit
    assert admit(_signed_in("alice"), ("x" * 70_000,)).startswith("A text field holds 70,000 characters")
    assert admit(_signed_in("alice"), (["x" * 60_000] * 5,)).startswith("The form holds more than 262,144")
    assert admit(_signed_in("alice"), ("x" * 1000,)) == ""
    for typed in ("a\x00b", "x" * 300):
        with pytest.raises(AccessError, match="must be a name of at most 100 characters without control"):
            resolve_output_dir(typed, tmp_path / "runs" / "alice")
    with pytest.raises(ConfigError, match="`dataset` may not contain a null character"):
        parse_config({"dataset": "train\x00.csv"})


# --- 4. every event of the page behind the door
def _event_args(block_fn, value: str) -> list:
    """Inputs for one event: every text-like input set to `value`, the others at their defaults."""
    args = []
    for c in block_fn.inputs:
        if isinstance(c, (gr.Textbox, gr.Dropdown)) and not isinstance(getattr(c, "value", None), (int, float)):
            args.append(value)
        elif isinstance(c, (gr.File, gr.UploadButton, gr.State, gr.Chatbot)):
            args.append(None)
        else:
            args.append(c.value)
    return args


def test_every_event_refuses_an_anonymous_visitor_and_a_new_one_cannot_forget(tmp_path, monkeypatch, cls_csv,
                                                                             space_env):
    monkeypatch.chdir(tmp_path)
    app = build(Path("runs"), access=_space())
    api_names = {"start", "plan", "status", "stop", "cancel", "predict", "push", "export", "export_status"}
    seen = set()
    for block_fn in app.demo.fns.values():
        fn = block_fn.fn
        if fn is None:  # a browser-side function (the chat's New chat button): nothing runs on the server
            continue
        if fn.__module__ == "gradio.components.login_button":  # Gradio's own Sign-in button: reads the session only
            continue
        if getattr(fn, "__self__", None).__class__ is ScriptApi:  # the scripting API: its own answers, below
            seen.add(fn.__name__)
            continue
        assert getattr(fn, "gate", None) in GATES, f"event {block_fn.name} does not go through RequestPolicy.on"
        args = _event_args(block_fn, cls_csv)
        if fn.gate == "signed_in":
            with pytest.raises(gr.Error, match="Sign in with Hugging Face to train"):
                fn(ANON, *args)
        elif fn.gate == "quiet":
            assert fn(ANON, *args) == gr.skip(), block_fn.name
        else:  # public: progress, Stop, the own run's form: nothing but the refusal, or nothing at all
            assert fn.handler.__name__ in {"poll", "stop", "running_config", "clear_note", "form_fields"}, \
                fn.handler.__name__
            out = fn(ANON, *args)
            shown = str(out)
            assert cls_csv not in shown and "runs/" not in shown
        # Too much text is refused for everyone, before any handler reads it.
        if args and any(isinstance(a, str) for a in args):
            big = ["x" * 70_000 if isinstance(a, str) else a for a in args]
            if fn.gate == "quiet":
                assert fn(_signed_in("owner"), *big) == gr.skip()
            else:
                with pytest.raises(gr.Error, match="A text field holds 70,000 characters"):
                    fn(_signed_in("owner"), *big)
    assert seen == api_names
    api = ScriptApi(handlers(Path("runs"), app.jobs, access=_space()))
    refusal = "Sign in with Hugging Face to train."
    assert api.start("dataset: x.csv", ANON)["message"] == refusal
    assert api.plan("dataset: x.csv", ANON) == {"error": refusal}
    assert api.stop(ANON)["message"] == refusal
    assert api.cancel(request=ANON)["message"] == refusal
    assert api.predict("hi", ANON) == {"error": refusal}
    assert api.status(ANON)["message"] == refusal and api.status(ANON)["run_dir"] is None
    assert not api.push("a/b", True, ANON)["pushed"]
    assert api.export(request=ANON)["message"] == refusal and not api.export(request=ANON)["started"]
    assert api.export_status(ANON)["state"] == "idle"


def test_every_event_given_alices_file_by_bob_shows_nothing_of_it(shared, tmp_path):
    ctl, _ = shared
    secret = _secret_upload(ctl, tmp_path)
    app = build(Path("runs"), access=ctl.state.access, jobs=ctl.state.jobs.training)
    app.handlers.state.policy.runs_dir = ctl.state.runs_dir
    called = set()
    for block_fn in app.demo.fns.values():
        fn = block_fn.fn
        if not hasattr(fn, "handler"):
            continue
        for value in (secret, f"- name: a\n  dataset: {secret}\n  label_column: text\n"):
            try:
                out = fn(BOB, *_event_args(block_fn, value))
            except gr.Error as e:
                out = str(e)
            assert SECRET not in str(out), (block_fn.name, str(out)[:300])
        called.add(fn.handler.__name__)
    assert {"refresh_dataset", "tasks_table", "plan_for", "model_fit", "form_fields", "start_on", "chat_example",
            "export"} <= called


# --- 8. the multi-task Start
def test_start_takes_a_multi_task_config(shared):
    ctl, uploads = shared
    tasks = [{"name": "a", "dataset": uploads["alice"]}, {"name": "b", "dataset": uploads["alice"], "weight": 0.5}]
    started = ctl.run.start_run(_config(tasks=tasks), request=ALICE)
    assert started.started, started.message
    assert "tasks:" in Path(started.run_dir, "launch.yaml").read_text()
    ctl.run.stop(request=ALICE)
    deadline = time.time() + 30
    while ctl.state.jobs.status().active:
        assert time.time() < deadline
        time.sleep(0.1)
    # Each task's data is checked as the preview checks one dataset, and the message names the task.
    missing = "runs/uploads/bob/missing.csv"
    bad = ctl.run.start_run(_config(tasks=[{"name": "a", "dataset": uploads["bob"]},
                                           {"name": "b", "dataset": missing}]), request=BOB)
    assert not bad.started and bad.message == f"Task 'b': Dataset file {missing!r} does not exist: check the path."


# --- 4. a chat template that loops
LOOPING = ("{% for m in messages %}{% for i in range(100000) %}{% for j in range(400) %}{% endfor %}{% endfor %}"
           "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_a_looping_chat_template_is_stopped_within_seconds(tmp_path, tiny_gpt2):
    import multiprocessing

    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))

    def example(template: str):
        path = tmp_path / f"template-{len(template)}.csv"  # uploaded under a data extension: its text is Jinja
        path.write_text(template)
        return ctl.dataset.chat_example(str(data), "", "train", "causal_lm", "messages", tiny_gpt2, str(path),
                                        "assistant", 64)

    assert example(CHATML).note.endswith("tokens are learned (highlighted): `train_on: assistant`.")
    shown, seconds = _timed(lambda: example(LOOPING))
    # Stopped at its 0.5 s limit; the bound leaves room for a loaded machine (1.03 s was seen with six test
    # processes on two cores), and the loop itself would run for minutes.
    assert seconds < 5.0 and shown.note == (
        "⚠️ Rendering the first conversation with the chat template took longer than 0.5 s and was stopped. A "
        "template that loops this long would not finish a dataset: simplify it.")
    assert not [c for c in multiprocessing.active_children() if c.name == "finetune-bounded"]


# --- 7. wide files and huge cells
@pytest.mark.slow  # a 2 MB cell and 200,000 columns (66 s at load 9)
def test_a_wide_file_is_refused_before_its_rows_are_read_and_cells_are_cut(shared, tmp_path):
    ctl, _ = shared
    none = [""] * len(COLUMN_FIELDS)

    def upload(name: str, text: str):
        src = tmp_path / f"gradio-{name}" / name
        src.parent.mkdir()
        src.write_text(text)
        return _timed(lambda: ctl.dataset.on_upload(str(src), "", "train", "classification", *none, request=BOB))

    n = 200_000
    shown, seconds = upload("wide.csv", ",".join(f"c{i}" for i in range(n)) + "\n" + ",".join(["1"] * n) + "\n")
    kept = Path(shown.dataset).name  # the upload's kept name: wide-<hash>.csv
    assert seconds < 2.0 and shown.data.error == (
        f"⚠️ The first line of {kept!r} is longer than 64 KB: the app previews files with a header (CSV) or a first "
        "record (JSON lines) shorter than that.")
    n = 5000
    shown, _ = upload("wide2.csv", ",".join(f"c{i}" for i in range(n)) + "\n" + ",".join(["1"] * n) + "\n")
    assert shown.data.error == (f"⚠️ {Path(shown.dataset).name!r} has 5,000 columns; the app reads files of at "
                                "most 1,000 columns: keep only the columns you train on.")
    labels = "".join(f"row {i},label-{i}\n" for i in range(500))
    shown, _ = upload("cell.csv", "text,label\n" + "x" * 2_000_000 + ",a\n" + labels)
    cells = shown.data.preview.to_numpy().ravel()
    assert max(len(str(c)) for c in cells) == preview.MAX_CELL_CHARS and str(cells[0]).endswith("…")
    assert len(shown.data.labels) < 2000 and "(471 more)" in shown.data.labels
    n = 800  # within the limit, but only the first 50 columns are previewed and 30 named
    shown, _ = upload("many.csv", ",".join(f"c{i}" for i in range(n)) + ",text\n" + "1," * n + "hello\n")
    assert shown.data.preview.shape[1] == preview.MAX_PREVIEW_COLUMNS
    assert len(shown.data.error.removeprefix("⚠️ ")) == preview.MAX_ERROR_CHARS


# --- issue 28: the third attack pass
def _wait_for(check, seconds: float = 30.0) -> None:
    deadline = time.time() + seconds
    while not check():
        assert time.time() < deadline
        time.sleep(0.05)


def test_a_config_of_20000_tasks_is_refused_fast_anonymous_and_signed_in(tmp_path):
    import json

    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"), access=_space())
    api = ScriptApi(ctl)
    tasks = {"tasks": [{"name": f"t{i}", "dataset": f"d{i}.csv"} for i in range(20_000)]}
    assert 700_000 < len(json.dumps(tasks)) < 900_000  # about the 789 KB of the attack
    # Each refusal takes milliseconds; the bound leaves room for a loaded machine (2.07 s was seen with six test
    # processes on two cores) and still catches the 11.5 s the attack took.
    bound = 5.0
    for call in (api.plan, api.start):
        out, seconds = _timed(lambda c=call: c(tasks, ANON))
        assert seconds < bound and "Sign in with Hugging Face to train." in str(out), out
        out, seconds = _timed(lambda c=call: c(tasks, _signed_in("alice")))
        assert seconds < bound and "The config holds more than" in str(out), out  # 64 KB of text, first
    deep: dict = {}
    for _ in range(12_000):
        deep = {"a": deep}
    out, seconds = _timed(lambda: api.plan({"epochs": deep}, _signed_in("alice")))
    assert seconds < bound and "nests deeper than 8 levels" in out["error"]
    out = api.plan({"dataset": "x" * 70_000}, _signed_in("alice"))
    assert "more than 64 KB of text" in out["error"]
    # The task-name check is linear now: the command line's own check of 20,000 tasks takes well under a second
    # more than parsing them (it was 11.5 s).
    names = [{"name": "same", "dataset": "d.csv"}] * 20_000
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        from_dict({"tasks": names})
    seconds = time.perf_counter() - start
    print(f"20,000 tasks through from_dict: {seconds:.2f} s")
    assert seconds < 3.0 and "Task name 'same' is used 20000 times: give every task its own name." in \
        e.value.problems


def test_a_huge_chosen_cell_is_previewed_within_a_bound(tmp_path, tiny_gpt2):
    import csv

    data = tmp_path / "pairs.csv"
    with open(data, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["prompt", "chosen", "rejected"])
        w.writerow(["the film was", "good " * 880_000, "dull"])  # a 4.4 MB cell
    assert data.stat().st_size > 4_400_000
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    shown, seconds = _timed(lambda: ctl.dataset.chat_example(str(data), "", "train", "preference", "", tiny_gpt2, "",
                                                             "assistant", 64, "prompt", "chosen", "rejected"))
    print(f"4.4 MB chosen cell: previewed in {seconds:.2f} s")
    assert seconds < 5.0 and "left out of training" in shown.note
    assert sum(len(text) for text, _ in shown.example["value"]) < 5000  # max_length tokens of it, not 4.4 MB


LOOP_TEMPLATE = ("{% for i in range(100000) %}{% for j in range(400) %}{% endfor %}{% endfor %}"
                 "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
MEM_TEMPLATE = ("{% set ns = namespace(s='x') %}{% for i in range(31) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
                "{{ ns.s }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_a_runs_looping_or_memory_eating_chat_template_is_cut_in_try_it_and_predict(tmp_path):
    import json
    import multiprocessing

    from conftest import run_train
    from test_chat import _chatml_tokenizer, _conversations, _tiny_chat_llama, _write_jsonl

    from app.local import training as jobs

    model = _tiny_chat_llama(_chatml_tokenizer(), tmp_path / "chat_model")
    run = tmp_path / "runs" / "r"
    run_train(run, model=model, dataset=_write_jsonl(tmp_path / "chat.jsonl", _conversations(8)), task="causal_lm",
              max_steps=1, effective_batch_size=4)
    ctl = handlers(tmp_path / "runs", JobManager(tmp_path / "runs"))
    ctl.state.jobs.training._job = jobs._Job(run_dir=run, config_path=run / "config.yaml", log_path=run / "launch.log",
                                             command=["python"], pid=-1, proc=None, launched=time.time() - 60)
    assert set(ctl.tryit.predict("hello")) == {"reply"}

    def set_template(template: str) -> None:
        saved = run / "model" / "chat_template.jinja"
        if saved.is_file():
            saved.write_text(template)
        config = run / "model" / "tokenizer_config.json"
        values = json.loads(config.read_text())
        if "chat_template" in values or not saved.is_file():
            values["chat_template"] = template
            config.write_text(json.dumps(values))

    api = ScriptApi(ctl)
    for template, said in ((LOOP_TEMPLATE, "took longer than 2 s and was stopped"),
                           (MEM_TEMPLATE, "")):
        set_template(template)
        shown, seconds = _timed(lambda: ctl.tryit.try_it("good movie"))
        print(f"Try it with a {'LOOP' if template is LOOP_TEMPLATE else 'MEM'} template: {seconds:.2f} s, "
              f"{shown.message!r}")
        assert seconds < 10.0 and shown.message.startswith("⚠️ ") and said in shown.message
        assert "fix" in shown.message and "Traceback" not in shown.message
        out, seconds = _timed(lambda: api.predict("good movie", None))
        assert seconds < 10.0 and set(out) == {"error"} and said in out["error"]
    assert not [c for c in multiprocessing.active_children() if c.name == "finetune-bounded"]


def _resumable(ctl: Handlers, user, dataset: str) -> str:
    """A run of `user`'s, stopped with a checkpoint (by the fake child): its name."""
    started = ctl.run.start_run(_config(dataset=dataset), request=user)
    assert started.started, started.message
    _wait_for(lambda: ctl.state.jobs.status().progress)
    ctl.run.stop(request=user)
    _wait_for(lambda: not ctl.state.jobs.status().active)
    (Path(started.run_dir) / "checkpoints" / "step-0000120").mkdir(parents=True)
    return Path(started.run_dir).name


def test_no_run_resumes_while_an_export_runs_and_no_export_starts_while_a_start_plans(shared, monkeypatch):
    import os
    import sys
    import threading

    ctl, uploads = shared
    bobs = _resumable(ctl, BOB, uploads["bob"])
    alices = _resumable(ctl, ALICE, uploads["alice"])
    export = ctl.state.jobs.start_export([sys.executable, "-c", "import time; time.sleep(60)", "export"],
                                         Path("runs/alice") / alices, "alice")
    try:
        refusal = "An export is in progress on this server: start the run when it is done (one job at a time)."
        assert ctl.runs.resume([bobs], request=BOB) == f"⚠️ {refusal}"  # the Runs tab
        assert ctl.run.resume(request=ALICE) == f"⚠️ {refusal}"  # the Train tab (her stopped run)
        assert not ctl.state.jobs.status().active
    finally:
        os.killpg(export.proc.pid, 9)
        export.proc.wait()
    # A Start with a budget plans first (a minute, for a big model): the server's one job is held meanwhile.
    planning = threading.Event()

    def slow_plan(*args, **kwargs):
        planning.set()
        time.sleep(2.0)
        return {"micro_batch_size": 8, "notes": []}

    monkeypatch.setattr(ctl.state.jobs.planner, "run", slow_plan)
    result = {}
    start = threading.Thread(target=lambda: result.update(started=ctl.run.start_run(
        _config(dataset=uploads["alice"], memory_budget_gb=8.0), request=ALICE)))
    start.start()
    assert planning.wait(30)
    with pytest.raises(JobBusy, match="^A run is being started on this server: export when it is done"):
        ctl.state.jobs.start_export([sys.executable, "-c", "pass", "export"], Path("runs/alice") / alices, "alice")
    other = ctl.run.start_run(_config(dataset=uploads["bob"]), request=BOB)
    assert not other.started and other.message.startswith("A run is being started on this server")
    start.join(30)
    assert result["started"].started, result["started"].message
    # bob's Resume while alice trains waits in the queue, and says nothing of hers.
    _wait_for(lambda: ctl.state.jobs.status().progress)
    said = ctl.runs.resume([bobs], request=BOB)
    assert said.startswith(f"`{bobs}`: Queued, position 1: it starts by itself when the run in progress ends")
    assert "alice" not in said and result["started"].run_dir.split("/")[-1] not in said
    assert ctl.runs.cancel([bobs], request=BOB).message == (f"Cancelled the queued run `runs/bob/{bobs}`; its "
                                                           "folder is kept.")
    mine = ctl.runs.resume([alices], request=ALICE)
    assert "position 1" in mine and str(Path.cwd()) not in mine
    ctl.state.jobs.cancel(Path("runs/alice") / alices, "alice")
    ctl.run.stop(request=ALICE)


def test_messages_name_a_folder_by_its_place_in_the_runs_folder_never_by_the_servers_path(tmp_path):
    from app.door import cleanup
    from app.report import shown_path

    home = tmp_path / "srv" / "runs" / "bob"
    for typed in ("../x", str(tmp_path / "elsewhere")):
        with pytest.raises(AccessError) as e:
            resolve_output_dir(typed, home)
        assert str(home) not in str(e.value) and "your runs folder" in str(e.value)
    said = cleanup.disk_problem(tmp_path / "srv" / "runs", 5, lambda path: 1e9)
    assert str(tmp_path) not in said and "the runs folder (runs)" in said
    run = home / "20261201-120000-978a2325"
    assert shown_path(run / "config.yaml", tmp_path / "srv" / "runs", shared=True) == \
        "runs/bob/20261201-120000-978a2325/config.yaml"
    assert shown_path(tmp_path / "other" / "x", tmp_path / "srv" / "runs", shared=True) == "x"


def test_refused_inputs_are_answered_without_a_traceback_in_the_servers_log(space_env):
    """Gradio prints the traceback of every error an event raises unless it says not to, from its event loop: 100
    refused events of the route walk wrote 188 KB, and with the app's output in a pipe nobody read, the loop blocked
    on a write and every request after it (an anonymous sign-in check too) went unanswered. A refusal, by the door
    or by Gradio's own check of a choice, is an answer and prints nothing."""
    with gr.Blocks() as demo:
        choice, radio, boxes = gr.Dropdown(["a", "b"]), gr.Radio(["x", "y"]), gr.CheckboxGroup(["p", "q"])
        out = gr.Textbox()
        from app.door.policy import RequestPolicy

        RequestPolicy(_space()).on(gr.Button().click, lambda *a, request: "ran", [choice, radio, boxes], {},
                                   outputs=[out])
    guarded = next(f.fn for f in demo.fns.values() if getattr(f.fn, "gate", None))
    with pytest.raises(gr.Error, match="Sign in with Hugging Face") as refused:
        guarded(ANON, "a", "x", ["p"])
    assert not refused.value.print_exception
    # Gradio's choice check runs before the door, on the component or on the copy it makes for a session when a
    # handler updates it (a new instance of its class).
    for component, wrong in ((choice, "c"), (radio, "z"), (boxes, ["r"]),
                             (gr.Dropdown(["a", "b"], value="a"), ["a", "nope"])):
        copy = type(component)(**{k: v for k, v in component.constructor_args.items()})
        for each in (component, copy):
            with pytest.raises(gr.Error, match="not in the list of choices") as refused:
                each.preprocess(wrong)
            assert not refused.value.print_exception
    assert choice.preprocess("b") == "b" and boxes.preprocess(["q"]) == ["q"]
