"""The task-kind seam (finetune.kinds): the registry is light and complete, every kind implements the whole
protocol, and what the configuration and the saved models read from the registry."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from finetune import registry
from finetune.config.schema import TASKS, ConfigError, from_dict
from finetune.kinds.base import TaskKind

REPO = Path(__file__).resolve().parent.parent
# The contract's methods, over its roles (DataCodec, Objective, …), and those without a default (a body that is
# only its docstring): every kind implements these.
ROLES = {klass.__name__ for klass in TaskKind.__mro__ if klass.__module__ == "finetune.kinds.base"}
METHODS = {(role.name, f.name): f for role in ast.parse((REPO / "finetune/kinds/base.py").read_text()).body
           if isinstance(role, ast.ClassDef) and role.name in ROLES for f in role.body
           if isinstance(f, ast.FunctionDef) and not f.name.startswith("_") and not f.decorator_list}
PROTOCOL = sorted(name for _, name in METHODS)
REQUIRED = sorted(name for (_, name), f in METHODS.items() if len(f.body) == 1 and isinstance(f.body[0], ast.Expr))


def test_importing_the_registry_and_the_config_imports_no_torch():
    code = ("import sys, json\nimport finetune.registry, finetune.config.schema\n"
            "print(json.dumps([m for m in ('torch', 'transformers', 'datasets', 'numpy', 'pyarrow') "
            "if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("name", registry.names())
def test_every_kind_implements_the_whole_protocol(name):
    kind = registry.kind(name)
    assert kind.entry is registry.entry(name)
    missing = [m for m in PROTOCOL if not callable(getattr(kind, m, None))]
    assert missing == []
    # The members without a default are the kind's own, not the protocol's docstring.
    inherited = [m for m in REQUIRED if next(k for k in type(kind).__mro__ if m in vars(k)).__name__ in ROLES]
    assert inherited == []
    e = kind.entry
    # A head's auto class (AutoModelFor…), or the bare encoder's (AutoModel, for embeddings).
    assert e.auto_model.startswith("AutoModel") and e.peft_auto_model.startswith("AutoPeftModel")
    assert e.pipeline_tag and e.columns and e.architectures
    # peft has no task type for images: an image classifier's adapter trains its new head whole
    # (`modules_to_save`), and a vision-language model's is told by its base config (CAUSAL_LM would read it as a
    # causal LM's).
    assert e.peft_task_type or e.pipeline_tag.startswith("image")


def test_the_config_accepts_exactly_the_registered_kinds():
    """Every kind declared in finetune/specs/ is a `task`, in its declared order, and has its contract case (a kind
    lost or added shows here, without a list of names to keep)."""
    assert TASKS == registry.names()
    declared = {p.stem for p in (REPO / "finetune" / "specs").glob("*.py")} - {"__init__"}
    cases = {p.stem for p in (REPO / "tests" / "kind_cases").glob("*.py")} - {"__init__"}
    assert set(TASKS) == declared == cases and len(TASKS) >= 12
    assert [registry.entry(n).order for n in TASKS] == sorted(registry.entry(n).order for n in TASKS)
    assert TASKS[0] == registry.DEFAULT == "classification"
    with pytest.raises(ConfigError, match="task"):
        from_dict({"task": "summarisation"})


@pytest.mark.parametrize(("task", "values", "message"), [
    ("classification", {"prompt_column": "p", "completion_column": "c"},
     "`prompt_column`/`completion_column` are for task=causal_lm; for classification use `text_column` and "
     "`label_column`."),
    ("causal_lm", {"label_column": "y"},
     "`label_column`/`text_pair_column` are for task=classification; for causal_lm use `text_column`, or "
     "`prompt_column` with `completion_column`."),
    ("classification", {"messages_column": "m"},
     "`messages_column` is for task=causal_lm: conversations train a language model."),
])
def test_another_kinds_columns_are_refused_in_one_sentence(task, values, message):
    assert registry.column_problems(task, values) == [message]
    with pytest.raises(ConfigError) as e:
        from_dict({"task": task, **values})
    assert message in e.value.problems


def test_a_kinds_own_columns_are_not_refused():
    assert registry.column_problems("classification", {"text_column": "t", "label_column": "y",
                                                       "text_pair_column": "u"}) == []
    assert registry.column_problems("causal_lm", {"text_column": "t", "prompt_column": "p",
                                                  "completion_column": "c"}) == []


@pytest.mark.parametrize(("model_config", "kind"), [
    ({"architectures": ["BertForSequenceClassification"]}, "classification"),
    ({"architectures": ["LlamaForCausalLM"]}, "causal_lm"),
    ({"architectures": ["GPT2LMHeadModel"]}, "causal_lm"),
    ({"architectures": ["BertModel"]}, "embedding"),  # a bare encoder (a sentence-transformers model's)
    ({"architectures": ["ViTForImageClassification"]}, "image_classification"),
    ({"architectures": None}, "classification"),
])
def test_a_saved_models_kind_is_read_from_its_config(model_config, kind):
    assert registry.kind_of_model_config(model_config) == kind


def test_a_saved_adapters_kind_is_read_from_its_peft_task_type():
    assert registry.kind_of_peft_task_type("CAUSAL_LM") == "causal_lm"
    assert registry.kind_of_peft_task_type("SEQ_CLS") == "classification"
    assert registry.kind_of_peft_task_type("FEATURE_EXTRACTION") == "embedding"


# Every member of the role protocols, attributes with a default (`counted_per_sample`, …) included.
MEMBERS = sorted({name for klass in TaskKind.__mro__ if klass.__module__ == "finetune.kinds.base"
                  for name in [*vars(klass), *getattr(klass, "__annotations__", {})] if not name.startswith("_")})


@pytest.mark.parametrize("name", registry.names())
def test_every_kinds_spec_is_declared_and_its_whole_contract_resolves(name):
    """The contract once over every kind: what its registry entry declares (columns, options, settings, features)
    is the config's and the planner's, and every member of every role protocol resolves on it."""
    import dataclasses

    from finetune.config.exclusions import KIND_FEATURES
    from finetune.config.schema import Config

    fields = {f.name for f in dataclasses.fields(Config)}
    e, kind = registry.entry(name), registry.kind(name)
    assert e.name == name and e.module.startswith("finetune.kinds.") and e.summary
    assert all(column.endswith("_column") for column in e.columns)
    assert sorted({*e.columns, *e.options, *e.settings, *(o.name for o in e.declares)} - fields) == []
    assert sorted(set(e.features) - {*KIND_FEATURES, "quantization"}) == []
    assert [m for m in MEMBERS if not hasattr(kind, m)] == []
    # The planner's chunked-loss rung is the kind's own: offered where the entry lists the feature, and then there.
    chunks = kind.chunked_variant()
    assert (chunks is not None) == ("chunked_loss" in e.features)
    if chunks is not None:
        assert chunks.kind.entry is e and chunks.chunk_positions(128256) > 0


def test_the_protocol_page_names_every_member_of_the_contract():
    """docs/task-kind-protocol.md lists every role and every member with its default, from the code."""
    page = (REPO / "docs" / "task-kind-protocol.md").read_text(encoding="utf-8")
    assert sorted(m for m in [*ROLES, *MEMBERS] if f"`{m}" not in page) == []
    words = {13: "Thirteen", 14: "Fourteen", 15: "Fifteen", 16: "Sixteen", 17: "Seventeen"}
    assert f"{words[len(REQUIRED)]} members have none" in page
