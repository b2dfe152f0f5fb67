"""A kind carries its options: each option a kind's entry declares (`registry.Option`) is a field of the schema with
exactly its declaration, is named for what the kind does with it, and shows in `finetune train --help`; and a kind
added by its spec module alone (finetune/specs/<kind>.py), with a column and a setting of its own, gets both in the
schema, the refusals, `finetune init`, the reference table, the CLI's help, `base.Columns` and the form."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import registry
from finetune.cli import kind_options_help
from finetune.config.schema import FIELDS, field_type

REPO = Path(__file__).resolve().parent.parent
DECLARED = [pytest.param(e, o, id=o.name) for e in registry.ENTRIES.values() for o in e.declares]


def test_the_kinds_declare_the_options_that_moved_out_of_the_flat_schema():
    declared = {o.name: e.name for e in registry.ENTRIES.values() for o in e.declares}
    assert {k: declared.get(k) for k in ("tokens_column", "tags_column", "label_all_tokens", "simpo_gamma",
                                         "orpo_lambda", "center_rewards_coefficient")} == {
        "tokens_column": "token_classification", "tags_column": "token_classification",
        "label_all_tokens": "token_classification", "simpo_gamma": "preference", "orpo_lambda": "preference",
        "center_rewards_coefficient": "reward"}


@pytest.mark.parametrize(("e", "o"), DECLARED)
def test_a_declared_option_is_a_schema_field_with_its_declaration(e, o):
    f = FIELDS[o.name]
    assert f.default == o.default
    assert {k: f.metadata[k] for k in ("help", "choices", "min", "max", "group", "source")} == {
        "help": o.help, "choices": o.choices, "min": o.min, "max": o.max, "group": o.group, "source": o.source}
    assert field_type(o.name) == (tuple[str, ...] if o.type is tuple else o.type, o.default is None)


@pytest.mark.parametrize(("e", "o"), DECLARED)
def test_a_declared_option_is_named_for_what_its_kind_does_with_it(e, o):
    refused = {key for group in e.own_columns for key in group}
    assert o.name in {*e.columns, *refused, *e.options, *e.settings} or any(
        o.name in keys for other in registry.ENTRIES.values() for keys in other.declines.values())
    assert o.name in kind_options_help()


# A kind with a column of its own and a setting of its own, declared in its spec module: the one file of the package
# that names it besides its implementation (toykind, in tests/).
SPEC = """
from finetune.specs import Entry, Option

ENTRY = Entry(
    name='word_parity', order=1000, module='toykind', summary='word-count parity', columns=('words_column',),
    own_columns=(('words_column',),), uses='`words_column`', settings=('parity_weight',),
    declares=(Option('words_column', str, None, "Word parity: column of the texts whose words are counted."),
              Option('parity_weight', float, 1.0, "Word parity: weight of the loss.", min=0.0, max=10.0,
                     group='advanced')),
    auto_model='AutoModelForSequenceClassification', peft_task_type='SEQ_CLS',
    peft_auto_model='AutoPeftModelForSequenceClassification', pipeline_tag='text-classification',
    architectures=('ForSequenceClassification',), example='one two three', has_labels=True)
"""

SCRIPT = """
import json, sys
sys.path.insert(0, 'tests')
import finetune.specs
finetune.specs.__path__.append(sys.argv[1])  # where word_parity.py is: the registry finds it there by looking
from finetune import registry
assert registry.names()[-1] == 'word_parity'

from finetune.cli import build_parser
from finetune.config.schema import ConfigError, from_dict, markdown_table, template
from finetune.kinds.base import Columns
from app.mapping import shown_fields

def refused(values):
    try:
        from_dict(values)
    except ConfigError as e:
        return e.problems
    return []

c = from_dict({'task': 'word_parity', 'words_column': 'w', 'parity_weight': 2})
print(json.dumps({
    'values': [c.words_column, c.parity_weight, from_dict({'task': 'word_parity'}).parity_weight],
    'too_big': refused({'task': 'word_parity', 'parity_weight': 20}),
    'not_mine': refused({'task': 'classification', 'words_column': 'w'}),
    'setting_elsewhere': refused({'task': 'classification', 'parity_weight': 2}),
    'template': [line for line in template().splitlines()
                 if any(word in line for word in ('Word parity', 'words_column', 'parity_weight'))],
    'table': [line for line in markdown_table().splitlines() if '`words_column`' in line or '`parity_weight`' in line],
    'help': build_parser()._subparsers._group_actions[0].choices['train'].format_help(),
    'columns': Columns(words='w').words,
    'shown': [shown_fields('word_parity', 'data.csv')[k] for k in ('words_column', 'parity_weight')],
    'shown_elsewhere': [shown_fields('classification', 'data.csv')[k] for k in ('words_column', 'parity_weight')],
}))
"""


def test_a_kind_with_options_of_its_own_is_added_by_its_spec_module_only(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    (tmp_path / "specs").mkdir()
    (tmp_path / "specs" / "word_parity.py").write_text(SPEC)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "specs")], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["values"] == ["w", 2.0, 1.0]
    assert len(out["too_big"]) == 1 and out["too_big"][0].startswith("`parity_weight` must be at most 10")
    assert out["not_mine"] == ["`words_column` is for task=word_parity; for classification use `text_column` and "
                               "`label_column`."]
    assert out["setting_elsewhere"] == []  # a setting: the other kinds hold its default, unrefused
    assert out["template"] == ["# Word parity: column of the texts whose words are counted.", "# words_column: null",
                               "# Word parity: weight of the loss.", "parity_weight: 1.0"]
    assert out["table"] == ["| `words_column` | — | Word parity: column of the texts whose words are counted. |",
                            "| `parity_weight` | `1.0` | Word parity: weight of the loss. |"]
    assert "task=word_parity: words_column, parity_weight" in out["help"]
    assert out["columns"] == "w"
    assert out["shown"] == [True, True] and out["shown_elsewhere"] == [False, False]
