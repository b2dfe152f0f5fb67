"""Whether a hub model can be reached now, asked once within a few seconds before a planner or a run would ask.

Without a network, transformers' own download of a model's config retries for about a minute before it fails
(`huggingface_hub`'s backoff: 62 s of nothing after a preset was picked, then a Plan that failed after 50 s). One
HEAD request to the Hub, without retries and bounded by `PROBE_S`, tells the page the same in a sentence.
"""

from __future__ import annotations

import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from app.mapping import loads_offline

PROBE_S = 5.0  # the most one probe waits for the Hub's answer
REMEMBER_S = 30.0  # a probe's answer stands this long (Plan, then Start, ask once)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")

_answers: dict[str, tuple[float, str | None]] = {}  # endpoint → (when, why it is out of reach or None)
_lock = threading.Lock()


def hub_problem(model: str) -> str | None:
    """Why hub model `model` cannot be loaded now (the Hub is switched off, or out of reach), in one sentence; None
    for a model that is here (bundled, a folder, cached), a name that is no hub id, or when the Hub answers."""
    model = (model or "").strip()
    if not HUB_ID.fullmatch(model) or loads_offline(model):
        return None
    from huggingface_hub import constants

    here = "pick a model that is on this machine (the bundled MiniLM, a local folder, or one downloaded before)"
    if constants.HF_HUB_OFFLINE:
        return (f"Model {model!r} is on the Hugging Face Hub, which is switched off here (HF_HUB_OFFLINE): {here}, "
                "or unset HF_HUB_OFFLINE.")
    why = _out_of_reach(constants.ENDPOINT)
    if why is None:
        return None
    return f"Model {model!r} is on the Hugging Face Hub, which this machine cannot reach ({why}): connect, or {here}."


def _out_of_reach(endpoint: str) -> str | None:
    """Why `endpoint` did not answer (remembered for `REMEMBER_S`), None when it answered anything."""
    with _lock:
        seen = _answers.get(endpoint)
    if seen is not None and time.monotonic() - seen[0] < REMEMBER_S:
        return seen[1]
    answer: list[str | None] = []
    # A thread, not only the request's timeout: resolving the host name is not bounded by it.
    probe = threading.Thread(target=lambda: answer.append(_head(endpoint)), daemon=True)
    probe.start()
    probe.join(PROBE_S + 1)
    why = answer[0] if answer else f"no answer within {PROBE_S:g} s"
    with _lock:
        _answers[endpoint] = (time.monotonic(), why)
    return why


def _head(url: str) -> str | None:
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=PROBE_S).close()
    except urllib.error.HTTPError:
        return None  # an answer, even a refusal: the Hub is there
    except (OSError, ValueError) as e:  # no route, no name, refused, timed out
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, TimeoutError):
            return f"no answer within {PROBE_S:g} s"
        if isinstance(reason, socket.gaierror):  # "[Errno -2] Name or service not known", in words
            return f"the name {urllib.parse.urlsplit(url).hostname} does not resolve"
        if isinstance(reason, ConnectionRefusedError):
            return "the connection was refused"
        return str(reason).strip()[:120] or type(e).__name__
    return None
