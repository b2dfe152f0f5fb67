"""An Ollama `Modelfile` for an exported GGUF: FROM, the run's chat template in Ollama's Go-template syntax,
PARAMETER stop for the end-of-turn token it learned, and the system prompt of its data.

A Jinja chat template cannot be translated to Go in general, but the templates chat models train with wrap each
turn in a fixed prefix and suffix per role (ChatML's `<|im_start|>user\\n … <|im_end|>\\n`, Llama 3's headers and
`<|eot_id|>`), after a fixed preamble (Llama 3's `<|begin_of_text|>`), and end a prompt with a generation prompt.
`turn_pieces` finds those pieces by rendering the run's own template on marked contents; `go_template` writes them
as a Go template; and the translation is kept only when rendering the pieces gives back exactly what the Jinja
template renders for a few conversations (system, two exchanges, a last user turn) — a template with more logic
than that is refused in one sentence instead of translated wrongly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune.errors import InputError

ROLES = ("system", "user", "assistant")
MARK = "\x00{}\x00"  # a content no real template changes: what surrounds it is the turn's wrapping
PROBES = (
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "Why?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Why?"}],
)


class TemplateError(InputError):
    """The run's chat template has more logic than per-role wrappers: the Modelfile would render it wrongly."""


@dataclass(frozen=True)
class TurnPieces:
    """A chat template as text pieces: the preamble, each role's prefix and suffix, and the generation prompt."""

    preamble: str
    prefix: dict[str, str]
    suffix: dict[str, str]
    generation: str

    def render(self, turns: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """What the template renders for `turns`, from the pieces (what the Go template does)."""
        body = "".join(self.prefix[t["role"]] + t["content"] + self.suffix[t["role"]] for t in turns)
        return self.preamble + body + (self.generation if add_generation_prompt else "")


def _render(tokenizer: Any, turns: list[dict[str, Any]], generation: bool) -> str:
    return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation)


def turn_pieces(tokenizer: Any) -> TurnPieces:
    """The pieces of the tokenizer's chat template, checked against the template itself on `PROBES`."""
    import jinja2

    prefix, suffix, preamble = {}, {}, None
    for role in ROLES:
        a, b = MARK.format("a"), MARK.format("b")
        try:
            one = _render(tokenizer, [{"role": role, "content": a}], False)
            two = _render(tokenizer, [{"role": role, "content": a}, {"role": role, "content": b}], False)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError):  # refuses this role
            if role == "system":  # a template without system turns: the Modelfile has no SYSTEM for them
                continue
            raise TemplateError(_refusal(f"it cannot render a lone {role} turn")) from None
        if one.count(a) != 1 or two.count(a) != 1 or two.count(b) != 1:
            raise TemplateError(_refusal(f"it changes the content of {role} turns"))
        lead, tail = one.split(a)
        between, last = two.split(a)[1].split(b)
        # two = lead + a + between + b + last, with between = suffix + prefix and last = suffix.
        if last != tail or not between.startswith(last):
            raise TemplateError(_refusal(f"{role} turns are not wrapped the same way wherever they are"))
        suffix[role] = last
        prefix[role] = between[len(last):]
        if not lead.endswith(prefix[role]):
            raise TemplateError(_refusal(f"the first {role} turn is wrapped differently from the others"))
        start = lead[: len(lead) - len(prefix[role])]
        if preamble not in (None, start):
            raise TemplateError(_refusal("its start depends on the first turn's role"))
        preamble = start
    user = [{"role": "user", "content": "Hi"}]
    generation = _render(tokenizer, user, True)[len(_render(tokenizer, user, False)):]
    pieces = TurnPieces(preamble=preamble or "", prefix=prefix, suffix=suffix, generation=generation)
    for turns in PROBES:
        if "system" not in prefix and turns[0]["role"] == "system":
            continue
        for gen in (True, False):
            if pieces.render(turns, gen) != _render(tokenizer, turns, gen):
                raise TemplateError(_refusal("rendering its turns one by one does not give back what it renders "
                                             "for a whole conversation"))
    return pieces


def _refusal(why: str) -> str:
    return (f"The run's chat template cannot be written as an Ollama TEMPLATE ({why}): export without --ollama and "
            "write the Modelfile's TEMPLATE by hand.")


def _go_text(text: str) -> str:
    """Literal text inside a Go template: only `{{` would be read as an action."""
    return text.replace("{{", '{{ "{{" }}')


def go_template(pieces: TurnPieces) -> str:
    """The pieces as an Ollama TEMPLATE over `.Messages`: each turn wrapped by its role, then the generation prompt
    after a last turn that is not the assistant's. No whitespace-trimming markers: the pieces' newlines are kept."""
    turns = ""
    for role in (r for r in ROLES if r in pieces.prefix):
        keyword = "if" if not turns else "else if"
        turns += (f'{{{{ {keyword} eq .Role "{role}" }}}}' + _go_text(pieces.prefix[role]) + "{{ .Content }}"
                  + _go_text(pieces.suffix[role]))
    return (_go_text(pieces.preamble) + "{{ range $i, $_ := .Messages }}"
            + "{{ $last := eq (len (slice $.Messages $i)) 1 }}" + turns + "{{ end }}"
            + '{{ if and $last (ne .Role "assistant") }}' + _go_text(pieces.generation) + "{{ end }}{{ end }}")


def _quoted(text: str) -> str:
    """A Modelfile value: triple-quoted (it may span lines); a value with triple quotes in it is refused."""
    if '"""' in text:
        raise TemplateError('A Modelfile value cannot contain """: export without --ollama.')
    return f'"""{text}"""'


def modelfile(gguf_name: str, tokenizer: Any, stops: list[int], system: str | None = None) -> str:
    """The Modelfile text for `gguf_name` (beside it), with the tokenizer's template and the stop tokens."""
    lines = [f"FROM ./{gguf_name}", f"TEMPLATE {_quoted(go_template(turn_pieces(tokenizer)))}"]
    for token in dict.fromkeys(tokenizer.convert_ids_to_tokens(i) for i in stops):
        lines.append("PARAMETER stop " + (_quoted(token) if any(c.isspace() for c in token) else token))
    if system:
        lines.append(f"SYSTEM {_quoted(system)}")
    return "\n".join(lines) + "\n"


def write_modelfile(path: Path, gguf: Path, merged: Path, system: str | None = None) -> Path:
    """Write the Modelfile for `gguf` from the merged folder's tokenizer and generation config."""
    import json

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    stops = json.loads((merged / "generation_config.json").read_text(encoding="utf-8")).get("eos_token_id")
    stops = [stops] if isinstance(stops, int) else list(stops or [])
    path.write_text(modelfile(gguf.name, tokenizer, stops, system), encoding="utf-8")
    return path


def create_command(path: Path, name: str) -> str:
    """The one command that makes the model in Ollama."""
    return f"ollama create {name} -f {path}"


def hub_files(modelfile_text: str) -> dict[str, str]:
    """The files Ollama reads from a Hub repository when it pulls `hf.co/<repo>` (it takes no Modelfile there):
    `template` (the TEMPLATE), `params` (JSON: the stop tokens) and `system`, from a Modelfile `modelfile` wrote."""
    import json
    import re

    template = re.search(r'^TEMPLATE """(.*?)"""$', modelfile_text, re.S | re.M)
    system = re.search(r'^SYSTEM """(.*?)"""$', modelfile_text, re.S | re.M)
    stops = [s[3:-3] if s.startswith('"""') else s
             for s in re.findall(r"^PARAMETER stop (.+)$", modelfile_text, re.M)]
    files = {"params": json.dumps({"stop": stops}, indent=2, ensure_ascii=False) + "\n"} if stops else {}
    if template:
        files["template"] = template.group(1)
    if system:
        files["system"] = system.group(1)
    return files
