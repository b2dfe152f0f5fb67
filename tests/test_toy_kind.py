"""The task-kind seam, proven with a kind that lives outside the package (tests/toykind.py) and is added by its
declaration alone (a spec module the registry finds): the config accepts it, the GUI's column table shows its
column, and it trains exactly ((B, k) ≡ (k·B, 1)) through the CLI, evaluates and predicts, with no other file
touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import assert_same_weights, load_weights

REPO = Path(__file__).resolve().parent.parent

# The one file a new kind adds to the package besides its implementation: its declaration, finetune/specs/<kind>.py
# (here in a folder the test adds to finetune.specs' path, as the package's own folder would hold it).
SPEC = """
from finetune.specs import Entry

ENTRY = Entry(
    name='word_parity', order=1000, module='toykind', summary='word-count parity', columns=('text_column',),
    uses='`text_column`', auto_model='AutoModelForSequenceClassification', peft_task_type='SEQ_CLS',
    peft_auto_model='AutoPeftModelForSequenceClassification', pipeline_tag='text-classification',
    architectures=('ForSequenceClassification',), example='one two three', has_labels=True)
"""

SCRIPT = """
import json, sys
sys.path.insert(0, 'tests')
import finetune.specs
finetune.specs.__path__.append(sys.argv[4])  # before the registry looks

from finetune.cli import main
from finetune.config.schema import TASKS, ConfigError, from_dict
model, data, out = sys.argv[1:4]
assert 'word_parity' in TASKS
try:
    from_dict({'task': 'word_parity', 'label_column': 'label'})
    raise SystemExit('label_column was accepted')
except ConfigError as e:
    refusal = e.problems
base = ['train', 'task=word_parity', f'model={model}', f'dataset={data}', 'text_column=sentence', 'optimizer=sgd',
        'learning_rate=0.5', 'effective_batch_size=8', 'max_steps=2', 'eval_fraction=0.25', 'shuffle=false']
assert main([*base, f'output_dir={out}/big', 'micro_batch_size=8', '-q']) == 0
assert main([*base, f'output_dir={out}/acc', 'micro_batch_size=2', '-q']) == 0
from finetune.use.predict import predict
from finetune.use.evaluate import evaluate_target
print(json.dumps({'refusal': refusal, 'predicted': predict(f'{out}/big', ['one two three']),
                  'evaluated': evaluate_target(f'{out}/big', [])}))
"""


def test_a_kind_added_by_its_spec_module_only_trains_exactly_and_is_used(tmp_path, tiny_bert, cls_csv):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "word_parity.py").write_text(SPEC)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, tiny_bert, cls_csv, str(tmp_path), str(tmp_path / "specs")],
                          cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = json.loads(proc.stdout.strip().splitlines()[-1])
    refusal = printed["refusal"]
    assert refusal == ["`label_column`/`text_pair_column` are for task=classification; for word_parity use "
                       "`text_column`."]
    big, acc = tmp_path / "big", tmp_path / "acc"
    assert_same_weights(load_weights(big), load_weights(acc))  # 1 micro-batch of 8 ≡ 4 of 2
    assert load_weights(big)["classifier.weight"].shape[0] == 2
    saved = json.loads((big / "model" / "config.json").read_text())
    assert saved["id2label"] == {"0": "even", "1": "odd"}
    metrics = json.loads((big / "metrics.json").read_text())
    assert {"loss", "accuracy", "macro_f1"} <= metrics.keys() and 0 <= metrics["accuracy"] <= 1
    events = [json.loads(line) for line in (big / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-1] == "done"
    assert "task: word_parity" in (big / "config.yaml").read_text()
    [prediction] = printed["predicted"]  # the kind's prediction output: a label and both probabilities
    assert prediction["label"] in ("even", "odd") and set(prediction["probabilities"]) == {"even", "odd"}
    evaluated = printed["evaluated"]  # finetune eval of the run, on its own held-out rows: the final metrics again
    assert evaluated["accuracy"] == metrics["accuracy"] and evaluated["samples"] > 0
