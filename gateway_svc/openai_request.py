"""OpenAI request JSON -> the client SDK's generate() arguments, one set per choice (plain functions).

Every field is either translated or refused with a 400 naming it: a field we cannot honour is
never dropped silently. A field sent with its neutral value (presence_penalty 0, logprobs false,
echo false, ...) changes nothing and is accepted, since some clients always send those.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from dspark_client.request import COLLECTED_STREAM_INTERVAL_MS

from .errors import bad_request

MAX_SEED = 2**64 - 1  # SamplingParams.seed is a uint64
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}

# Fields of either endpoint that we translate.
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "user", "speculation"}
CHAT_ONLY = {"messages", "max_completion_tokens"}
COMPLETION_ONLY = {"prompt"}
# Fields we do not support, accepted only with the value that means "off".
NEUTRAL = {"frequency_penalty": (0,), "presence_penalty": (0,), "logprobs": (False,), "echo": (False,), "best_of": (1,)}


@dataclass(frozen=True)
class ChoiceRequest:
    index: int          # the choice's index in the response
    prompt_index: int   # which prompt it answers (completions accept several)
    params: dict        # keyword arguments of dspark_client's generate_stream()


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks for: len(choices) upstream generations."""

    kind: str  # "chat" or "completion"
    model: str
    stream: bool
    include_usage: bool
    choices: list[ChoiceRequest] = field(default_factory=list)


def parse_chat(body: object, max_n: int) -> Plan:
    body = _object(body)
    _refuse_unknown(body, COMMON | CHAT_ONLY)
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad_request("set max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    messages = _messages(body.get("messages"))
    limit_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    return _plan("chat", body, [{"messages": messages}], limit_field, max_n)


def parse_completion(body: object, max_n: int) -> Plan:
    body = _object(body)
    _refuse_unknown(body, COMMON | COMPLETION_ONLY)
    return _plan("completion", body, _prompts(body.get("prompt")), "max_tokens", max_n)


def _plan(kind: str, body: dict, prompts: list[dict], limit_field: str, max_n: int) -> Plan:
    n = _int(body, "n", 1, low=1)
    if n * len(prompts) > max_n:
        raise bad_request(f"n x prompts = {n * len(prompts)} choices; this server allows at most {max_n}", "n")
    stream = _bool(body, "stream", False)
    include_usage = _stream_options(body, stream)
    seed = _optional_int(body, "seed", low=0, high=MAX_SEED)
    if seed is not None and seed + n - 1 > MAX_SEED:
        raise bad_request(f"seed + n - 1 must be <= {MAX_SEED}", "seed")
    disable, max_draft = _speculation(body.get("speculation"))
    shared = {
        "model": _string(body, "model", ""),
        "temperature": _number(body, "temperature", 1.0, low=0.0),
        "top_p": _top_p(body),
        "top_k": _top_k(body),
        "max_tokens": _optional_int(body, limit_field, low=1) or 0,  # 0 = the server's default
        "stop": _stop(body.get("stop")),
        "speculation": not disable,
        "max_draft_tokens": max_draft,
        # A whole response needs no per-step chunks upstream (dspark_client.generate()'s interval).
        "stream_interval_ms": 0 if stream else COLLECTED_STREAM_INTERVAL_MS,
    }
    _string(body, "user", "")  # only checked: it names the end user for abuse tracking, nothing to do here
    choices = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            # Choice i of a seeded request gets seed + i: reproducible, yet the n samples differ.
            params = dict(shared, **prompt, seed=None if seed is None else seed + i)
            choices.append(ChoiceRequest(index=len(choices), prompt_index=p, params=params))
    return Plan(kind, shared["model"], stream, include_usage, choices)


# ---- single fields ------------------------------------------------------------------------------
def _object(body: object) -> dict:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return {k: v for k, v in body.items() if v is not None}  # null = not set, as OpenAI treats it


def _refuse_unknown(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name not in known and not _is_neutral(name, value):
            raise bad_request(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def _is_neutral(name: str, value) -> bool:
    # isinstance check: True == 1 and False == 0 in Python, but best_of: true is not best_of: 1.
    return any(value == off and isinstance(value, bool) == isinstance(off, bool) for off in NEUTRAL.get(name, ()))


def _bool(body: dict, name: str, default: bool, prefix: str = "") -> bool:
    """prefix: where `body` sits in the request ("speculation." for a nested field)."""
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise bad_request(f"'{prefix}{name}' must be a boolean, got {value!r}", prefix + name)
    return value


def _string(body: dict, name: str, default: str) -> str:
    value = body.get(name, default)
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string", name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(body: dict, name: str, default: int, low: int | None = None, high: int | None = None,
         prefix: str = "") -> int:
    value = _optional_int(body, name, low, high, prefix)
    return default if value is None else value


def _optional_int(body: dict, name: str, low: int | None = None, high: int | None = None,
                  prefix: str = "") -> int | None:
    if name not in body:
        return None
    value, where = body[name], prefix + name
    if not _is_int(value):
        raise bad_request(f"'{where}' must be an integer, got {value!r}", where)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_request(f"'{where}' must be {bounds}, got {value}", where)
    return value


def _number(body: dict, name: str, default: float, low: float) -> float:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {value!r}", name)
    if value < low:
        raise bad_request(f"'{name}' must be >= {low}, got {value}", name)
    return float(value)


def _top_p(body: dict) -> float:
    value = _number(body, "top_p", 1.0, low=0.0)
    if not 0 < value <= 1:
        raise bad_request(f"'top_p' must be in (0, 1], got {value}", "top_p")
    return value


def _top_k(body: dict) -> int:
    value = _int(body, "top_k", 0, low=-1)
    return 0 if value == -1 else value  # vLLM's -1 and our 0 both mean "no top-k"


def _stream_options(body: dict, stream: bool) -> bool:
    if "stream_options" not in body:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed with stream: true", "stream_options")
    options = body["stream_options"]
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise bad_request(f"'stream_options.{sorted(unknown)[0]}' is not supported by this server",
                          "stream_options", "unsupported_parameter")
    return _bool(options, "include_usage", False, "stream_options.")


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' strings must not be empty", "stop")
    if len(stops) > 16:
        raise bad_request(f"'stop' takes at most 16 strings, got {len(stops)}", "stop")
    return stops


def _speculation(value) -> tuple[bool, int]:
    """Our extension: {"disable": bool, "max_draft_tokens": int} -> SpeculationOverride."""
    if value is None:
        return False, 0
    if not isinstance(value, dict):
        raise bad_request("'speculation' must be an object", "speculation")
    unknown = set(value) - {"disable", "max_draft_tokens"}
    if unknown:
        raise bad_request(f"'speculation.{sorted(unknown)[0]}' is not a known field "
                          "(known: disable, max_draft_tokens)", "speculation")
    disable = _bool(value, "disable", False, "speculation.")
    max_draft = _int(value, "max_draft_tokens", 0, low=0, high=2**32 - 1, prefix="speculation.")  # 0 = no cap
    return disable, max_draft


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}", f"{where}.role")
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise bad_request(f"'{where}.{sorted(extra)[0]}' is not supported by this server", where,
                              "unsupported_parameter")
        out.append({"role": CHAT_ROLES[role], "content": _content(message.get("content"), where)})
    return out


def _content(value, where: str) -> str:
    """A string, or a list of text parts (joined); images and audio are not supported."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"'{where}.content' parts must be text parts ({{\"type\": \"text\", \"text\": ...}})",
                                  f"{where}.content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")


def _prompts(value) -> list[dict]:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    def token_list(ids) -> bool:
        return isinstance(ids, list) and ids != [] and all(_is_int(t) and t >= 0 for t in ids)

    if isinstance(value, str):
        return [{"prompt": value}]
    if token_list(value):
        return [{"token_ids": value}]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [{"prompt": p} for p in value]
        if all(token_list(p) for p in value):
            return [{"token_ids": p} for p in value]
    raise bad_request("'prompt' must be a string, a list of strings, a list of token ids (>= 0) "
                      "or a list of such lists, and not empty", "prompt")
