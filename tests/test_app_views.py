"""What the page shows, from events and plans (pure functions), and the Dataset block's checks."""

from __future__ import annotations

import re
from pathlib import Path

from app import charts, report
from app.local.tail import EventTail, error_from_output, session_output
from app.local.training import JobStatus
from app.train import plan_report, preview, run_report
from app.tryit import panel, renderers

GIB = 1024**3


def _events(steps: int, total: int = 10, evals: tuple[int, ...] = ()) -> list[dict]:
    out = [{"event": "start", "time": 100.0, "total_steps": total, "step": 0, "micro_batch_size": 4,
            "grad_accum_steps": 2, "num_processes": 1, "effective_batch_size": 8, "precision": "fp32",
            "device": "cpu", "run_dir": "runs/x", "resumed": False}]
    for s in range(1, steps + 1):
        out.append({"event": "step", "time": 100.0 + 2 * s, "step": s, "epoch": s / 5, "loss": 1 / s,
                    "grad_norm": 0.5, "lr": 1e-4, "samples": 8 * s, "tokens": 80 * s, "skipped": 0,
                    "samples_per_s": 4.0})
        if s in evals:
            out.append({"event": "eval", "time": 100.0 + 2 * s, "step": s, "epoch": s / 5,
                        "metrics": {"loss": 0.9 / s, "accuracy": 0.5}})
    return out


def test_loss_frame_is_long_format_with_train_and_eval():
    frame = charts.loss_frame(_events(4, evals=(2, 4)))
    assert list(frame.columns) == ["step", "loss", "split"]
    assert frame.step.dtype == "int64" and frame.loss.dtype == "float64"
    assert frame[frame.split == "train"].step.tolist() == [1, 2, 3, 4]
    assert frame[frame.split == "eval"].loss.tolist() == [0.45, 0.225]


def test_loss_chart_draws_every_split_from_the_first_update_and_eval_as_points():
    import re

    chart = charts.loss_chart_html(charts.loss_frame(_events(4, evals=(4,))))  # one eval so far: still visible
    train = re.search(r'<path data-split="train" d="([^"]+)"', chart).group(1)
    assert train.count("M") + train.count("L") == 4
    assert len(re.findall(r'<circle data-split="eval"', chart)) == 1
    assert '<circle data-split="train"' not in chart  # a training line is a line, not a dot per step
    dotted = charts.loss_chart_html(charts.loss_frame(_events(4, evals=(4,))), points=True)
    assert len(re.findall(r'<circle data-split="train"', dotted)) == 4
    assert 'stroke="#1d4ed8"' in chart and 'fill="#c2410c"' in chart  # each split its own colour, from the start
    legend = chart[chart.index('class="ft-legend"'):chart.index("<svg viewBox")]
    assert ">train</span>" in legend and ">eval</span>" in legend  # outside the plot's frame: never cut off
    assert charts.loss_chart_html(charts.loss_frame([])) == ""


def test_long_curves_are_thinned_but_keep_their_last_step():
    frame = charts.loss_frame(_events(2500, total=2500))
    train = frame[frame.split == "train"].step.tolist()
    assert len(train) <= charts.MAX_PLOT_POINTS + 1 and train[0] == 1 and train[-1] == 2500


def test_progress_shows_step_total_and_eta():
    s = JobStatus(state="running", run_dir=Path("runs/x"), events=_events(3))
    assert run_report.eta_seconds(s.events) == 14.0  # 2 s a step, 7 steps left
    html = run_report.progress_html(s)
    assert 'max="10" value="3"' in html and "step 3 / 10" in html and "ETA 0:14" in html
    done = JobStatus(state="done", run_dir=Path("runs/x"), events=_events(10))
    assert "step 10 / 10" in run_report.progress_html(done)
    assert "No run yet" in run_report.progress_html(JobStatus(state="idle"))


def test_eta_counts_only_the_steps_since_the_latest_start():
    events = _events(4) + [{**_events(0)[0], "time": 1000.0, "step": 4, "resumed": True},
                           {**_events(5)[-1], "time": 1003.0}, {**_events(6)[-1], "time": 1006.0}]
    assert run_report.eta_seconds(events) == 12.0  # 3 s a step since the resume, 4 steps left


def test_stats_status_and_log():
    s = JobStatus(state="running", run_dir=Path("runs/x"), events=_events(2, evals=(2,)))
    stats = run_report.stats_markdown(s)
    for part in ("**loss** 0.5000", "**lr** 1.00e-04", "**grad norm** 0.5", "**samples/s** 4.0",
                 "**skipped fp16 steps** 0", "**eval @ 2** loss 0.4500, accuracy 0.5000"):
        assert part in stats
    log = run_report.log_text(s)
    assert "micro-batch 4 × accumulation 2 × 1 process(es) = 8, fp32 on cpu" in log and "step 2/10" in log
    failed = JobStatus(state="failed", run_dir=Path("runs/x"), message="Label column 'y' is not in the data.")
    assert "Failed" in run_report.status_markdown(failed) and "Label column 'y'" in run_report.status_markdown(failed)
    # Never a blank:
    assert "see the log" in run_report.status_markdown(JobStatus(state="failed", run_dir=Path("runs/x")))
    done = JobStatus(state="done", run_dir=Path("runs/x"),
                     events=[*_events(1), {"event": "done", "time": 1.0, "step": 1, "metrics": {"accuracy": 0.875},
                                           "model_dir": "m"}])
    assert "accuracy 0.8750" in run_report.status_markdown(done) and report.final_metrics(done) == {"accuracy": 0.875}


PLAN = {"micro_batch_size": 4, "grad_accum_steps": 8, "num_processes": 1, "effective_batch_size": 32,
        "precision": "bf16", "gradient_checkpointing": True, "lora": False, "optimizer": "adamw",
        "budget_bytes": 8 * GIB, "predicted_peak_bytes": 6 * GIB, "device": "cuda:0",
        "breakdown": {"weights": 1 * GIB, "gradients": 1 * GIB, "optimizer_state": 2 * GIB, "activations": 2 * GIB},
        "notes": ["gradient checkpointing: the plan without it needs 9.1 GiB"]}


def test_plan_is_shown_as_batch_arithmetic_and_a_bar_against_the_budget():
    text = plan_report.plan_markdown(PLAN)
    assert "micro-batch 4 × accumulation 8 × 1 process(es) = effective batch 32" in text
    assert "precision **bf16**" in text and "gradient checkpointing **on**" in text and "LoRA **off**" in text
    assert "quantization **none**" in text
    assert "predicted peak **6.00 GiB** (75 % of the 8.00 GiB budget)" in text
    assert "- gradient checkpointing: the plan without it needs 9.1 GiB" in text
    assert "weights 1.00 GiB · gradients 1.00 GiB · optimizer state 2.00 GiB · activations 2.00 GiB" in text
    # Samples of different lengths: the longest micro-batch the planner counted holds padding, said in plain words.
    padded = plan_report.plan_markdown({**PLAN, "worst_case_tokens": 512, "padded": True, "method": "dry-run"})
    assert "longest micro-batch 4 × 512 tokens (shorter samples padded to it)" in padded
    assert "dry-run" not in padded and "estimated on a weightless copy of the model" in padded
    assert "padded to it" not in plan_report.plan_markdown({**PLAN, "worst_case_tokens": 512, "padded": False})
    assert "padded to it" not in plan_report.plan_markdown({**PLAN, "worst_case_tokens": 512, "padded": True,
                                                            "micro_batch_size": 1})
    frame = plan_report.plan_frame(PLAN)
    assert frame.part.tolist() == ["weights", "gradients", "optimizer state", "activations", "predicted peak",
                                   "budget"]
    assert frame.GiB.tolist() == [1.0, 1.0, 2.0, 2.0, 6.0, 8.0]


def _bar_widths(chart: str) -> dict[str, float]:
    rows = re.findall(r'data-part="([^"]+)".*?width:([0-9.]+)%', chart)
    return {part: float(width) for part, width in rows}


def test_plan_chart_keeps_small_parts_readable_and_the_budget_a_marker():
    # Near the budget: one scale for all, the budget a marker line at its place.
    near = plan_report.plan_chart_html(PLAN)
    widths = _bar_widths(near)
    assert widths["optimizer state"] == 25.0 and widths["predicted peak"] == 75.0
    assert 'ft-budget-mark" style="left:100.0%' in near and "8.00 GiB" in near
    # Far under a 23.5 GiB budget (issue 20 item 10): the bars are scaled to the peak, not to the budget, so a
    # 0.6 GiB part is a tenth of the chart, not a sliver; the budget is said in words, not drawn off the scale.
    small = {**PLAN, "predicted_peak_bytes": 6 * GIB * 0.1, "budget_bytes": 23.5 * GIB,
             "breakdown": {"weights": 0.06 * GIB, "activations": 0.54 * GIB, "overhead": 1024}}
    chart = plan_report.plan_chart_html(small)
    widths = _bar_widths(chart)
    assert widths["predicted peak"] == 100.0 and widths["activations"] == 90.0 and widths["weights"] == 10.0
    assert widths["overhead"] == plan_report.MIN_BAR_PCT  # too small to see: a sliver, with its number beside it
    assert ">1 KiB<" in chart
    assert "ft-budget-mark" not in chart and "off the scale (the plan uses 3 % of it)" in chart


def test_plan_view_names_the_quantization_and_drops_savings_notes_on_a_roomy_plan():
    quantized = {**PLAN, "lora": True, "quantization": "4bit", "base_dtype": "bf16",
                 "breakdown": {"weights": 0.2 * GIB, "quantized_weights": 1.0 * GIB,
                               "quantization_constants": 0.1 * GIB, "activations": 2 * GIB}}
    text = plan_report.plan_markdown(quantized)
    assert "quantization **4bit**" in text and "frozen base quantized **4bit**" in text
    assert "quantized weights (4bit) 1.00 GiB" in text and "unquantized weights" in text
    assert "quantized weights (4bit)" in _bar_widths(plan_report.plan_chart_html(quantized))
    skipped = "8-bit AdamW and quantized bases skipped: they need bitsandbytes."
    roomy = {**PLAN, "predicted_peak_bytes": GIB, "notes": [skipped]}
    assert "8-bit AdamW" not in plan_report.plan_markdown(roomy)  # 12 % of the budget: nothing to save
    assert "8-bit AdamW" in plan_report.plan_markdown({**PLAN, "notes": [skipped]})  # 75 %: worth knowing


def test_plan_view_shows_activation_offloads_cpu_memory_as_its_own_bar():
    offloaded = {**PLAN, "activation_offload": True, "host_bytes": 3 * GIB}
    text = plan_report.plan_markdown(offloaded)
    assert "activation offload **on**" in text and "**3.00 GiB** of RAM, not part of the device's peak" in text
    frame = plan_report.plan_frame(offloaded)
    assert frame.part.tolist()[-2:] == [plan_report.HOST_PART, "budget"]
    assert frame[frame.kind == "host"].GiB.tolist() == [3.0]
    chart = plan_report.plan_chart_html(offloaded)
    widths = _bar_widths(chart)
    # On the device's scale (the budget of 8 GiB), beside the peak and not added to it.
    assert widths[plan_report.HOST_PART] == 37.5 and widths["predicted peak"] == 75.0
    assert "offloaded activations (CPU memory)" in chart and "CPU memory (activation offload)" in chart
    assert plan_report.HOST_PART not in _bar_widths(plan_report.plan_chart_html(PLAN))  # no offload: no bar
    # CPU memory larger than the device's peak: the scale takes it, so no bar runs off the chart.
    big = _bar_widths(plan_report.plan_chart_html({**offloaded, "host_bytes": 16 * GIB}))
    assert big[plan_report.HOST_PART] == 100.0 and big["predicted peak"] == 37.5


def test_dataset_block_guesses_columns_and_counts_labels(cls_csv):
    view = preview.inspect(cls_csv, None, "train", "classification", {})
    assert view.error == "" and view.columns == ["sentence", "label"] and view.rows == 37
    assert view.chosen["text_column"] == "sentence" and view.chosen["label_column"] == "label"
    assert set(view.labels) == {"neg", "pos"} and sum(view.labels.values()) == 37
    assert len(view.preview) == preview.PREVIEW_ROWS
    assert "37 rows · 2 labels" in preview.labels_markdown(view)


def test_dataset_block_errors_are_one_sentence_next_to_the_field(tmp_path, cls_csv):
    assert "does not exist" in preview.inspect(str(tmp_path / "nope.csv"), None, "train", "classification",
                                               {}).error
    same = preview.inspect(cls_csv, None, "train", "classification",
                           {"text_column": "label", "label_column": "label"})
    assert same.error == "The same column is mapped twice: pick a different column for each role."
    one_class = tmp_path / "one.csv"
    one_class.write_text("text,label\na,x\nb,x\n")
    assert "has only one class" in preview.inspect(str(one_class), None, "train", "classification", {}).error
    causal = preview.inspect(cls_csv, None, "train", "causal_lm", {"label_column": "label"})
    assert causal.error == "" and causal.chosen["text_column"] == "sentence" and not causal.chosen["label_column"]


def test_a_text_column_of_numbers_or_ids_is_refused_and_conversations_suggest_causal_lm(tmp_path, cls_csv):
    numbers = tmp_path / "numbers.csv"
    numbers.write_text("id,label\n" + "".join(f"{i},{i % 2}\n" for i in range(20)))
    refused = preview.inspect(str(numbers), None, "train", "classification", {"label_column": "label"})
    assert refused.error == ("Text column `id` (guessed: it is the only column beside the label) holds numbers, not "
                             "text: pick the column with the text under Text column, or add one to the file.")
    codes = tmp_path / "codes.csv"
    codes.write_text("sku,review,label\n" + "".join(f"A-{i:04d},meh {i},{i % 2}\n" for i in range(20)))
    chosen = preview.inspect(str(codes), None, "train", "classification", {"text_column": "sku"})
    assert chosen.error.startswith("Text column `sku` looks like ids (one distinct code per row)")
    assert preview.inspect(str(codes), None, "train", "classification", {"text_column": "review"}).error == ""
    assert preview.inspect(cls_csv, None, "train", "classification", {}).error == ""  # real text passes
    chat = tmp_path / "chat.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    assert preview.inspect(str(chat), None, "train", "classification", {}).error == (
        "Column `messages` holds conversations, which a classifier cannot learn from: set Task to Causal language "
        "modelling and pick a causal LM model (one with a chat template) to fine-tune on them.")
    assert preview.inspect(str(chat), None, "train", "causal_lm", {}).error == ""


def test_uploads_are_kept_once_under_a_content_hash(tmp_path):
    a = tmp_path / "in" / "data.csv"
    a.parent.mkdir()
    a.write_text("text,label\na,0\nb,1\n")
    inode = a.stat().st_ino
    kept = preview.keep_upload(str(a), tmp_path / "uploads")
    assert kept.read_text() == "text,label\na,0\nb,1\n" and kept.name.startswith("data-") and kept.suffix == ".csv"
    # Kept once: the same bytes on disk (moved by a hard link, never copied), and Gradio's temporary name is gone.
    assert kept.stat().st_ino == inode and kept.stat().st_nlink == 1 and not a.exists()
    assert [p.name for p in kept.parent.iterdir()] == [kept.name]  # no temporary name left behind
    a.write_text("text,label\nc,0\nd,1\n")  # a new file under the same name never replaces the old copy
    again = preview.keep_upload(str(a), tmp_path / "uploads")
    assert again != kept and kept.read_text().startswith("text,label\na")
    a.write_text("text,label\nc,0\nd,1\n")  # the same file uploaded again: one kept file, the upload removed
    assert preview.keep_upload(str(a), tmp_path / "uploads") == again and not a.exists()


def test_event_tail_reads_only_complete_new_lines(tmp_path):
    path = tmp_path / "events.jsonl"
    tail = EventTail(path)
    assert tail.read() == []
    path.write_text('{"event": "start"}\n{"event": "st')
    assert tail.read() == [{"event": "start"}]  # the half-written line waits
    with open(path, "a") as f:
        f.write('ep", "step": 1}\n')
    assert tail.read() == [{"event": "start"}, {"event": "step", "step": 1}]
    path.write_text('{"event": "start", "step": 0}\n')  # replaced by an overwrite=true run
    assert tail.read() == [{"event": "start", "step": 0}]


def test_the_childs_message_is_taken_from_this_session_of_the_log(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("$ -m finetune train a.yaml -q\nerror: an old problem.\n$ -m finetune train a.yaml -q\n"
                   "Some warning\nerror: 2 problems in the config:\n  - `a` is bad.\n  - `b` is bad.\n")
    output = session_output(log)
    assert "old problem" not in output
    assert error_from_output(output) == "2 problems in the config:\n  - `a` is bad.\n  - `b` is bad."
    assert error_from_output("Traceback (most recent call last):\n  ...\nRuntimeError: boom") == "RuntimeError: boom"


def test_try_it_offers_a_chat_only_for_a_finished_run_trained_on_conversations(tmp_path):
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    done = JobStatus(state="done", run_dir=run)
    (run / "config.yaml").write_text("task: classification\n")
    assert panel.try_view(done) == "probabilities"
    (run / "config.yaml").write_text("task: causal_lm\nmessages_column: messages\n")
    assert panel.try_view(done) == "chat"
    (run / "config.yaml").write_text("task: causal_lm\ntext_column: text\n")
    assert panel.try_view(done) == "text"
    assert panel.try_view(JobStatus(state="running", run_dir=run)) is None  # no finished model yet
    # Each kind's view is its registry entry's, and each view has its renderer.
    for task, view in (("regression", "value"), ("reward", "score"), ("token_classification", "entities"),
                       ("preference", "text")):
        (run / "config.yaml").write_text(f"task: {task}\n")
        assert panel.try_view(done) == view and view in renderers.RENDERERS
    (run / "model" / "chat_template.jinja").write_text("{{ messages }}")  # a tuned model with a template: a chat
    assert panel.try_view(done) == "chat"
    before = panel.panel(JobStatus(state="idle"), new_model=True)
    assert before.button["interactive"] is False
    assert before.chat["visible"] is False and before.new_chat["visible"] is False


def test_an_empty_or_header_only_file_is_a_sentence_about_the_file_not_datasets_words(tmp_path):
    """Issue 42 row 9. Before: `... could not be read as .csv (Instruction "train" corresponds to no data!)` and
    `(An error occurred while generating the dataset)`."""
    empty, header, jsonl = tmp_path / "empty.csv", tmp_path / "header.csv", tmp_path / "empty.jsonl"
    empty.write_text("")
    header.write_text("text,label\n")
    jsonl.write_text("\n")
    said = {path.name: preview.inspect(str(path), None, "train", "classification", {}).error
            for path in (empty, header, jsonl)}
    assert said == {
        "empty.csv": f"Dataset file {str(empty)!r} is empty: give a file with one example per row (a CSV's first "
                     "line names its columns).",
        "header.csv": f"Dataset file {str(header)!r} has a header line ('text,label') but no rows: add one example "
                      "per line under it.",
        "empty.jsonl": f"Dataset file {str(jsonl)!r} is empty: give a file with one example per row (a CSV's first "
                       "line names its columns)."}
