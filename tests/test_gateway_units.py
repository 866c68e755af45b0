"""The gateway's translation functions on their own: OpenAI JSON -> SDK arguments, usage, auth, SSE."""
from __future__ import annotations

import json

import pytest
from dspark_client import Chunk, FinishReason, SpecMetrics
from dspark_client.request import COLLECTED_STREAM_INTERVAL_MS

from gateway_svc import openai_response as out
from gateway_svc.auth import check_authorization, configured_keys
from gateway_svc.errors import ApiError
from gateway_svc.openai_request import parse_chat, parse_completion
from gateway_svc.usage import ChoiceTotals, usage

USER = [{"role": "user", "content": "hi"}]


def test_chat_fields_map_to_sdk_arguments_one_set_per_choice():
    plan = parse_chat({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                               {"type": "text", "text": "b"}]}],
                       "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": -1, "seed": 10,
                       "stop": "END", "n": 3, "stream": True, "stream_options": {"include_usage": True},
                       "user": "u1", "speculation": {"disable": True, "max_draft_tokens": 2},
                       "presence_penalty": 0, "logprobs": False}, max_n=16)
    assert (plan.kind, plan.model, plan.stream, plan.include_usage) == ("chat", "m", True, True)
    assert [c.index for c in plan.choices] == [0, 1, 2]
    assert [c.params["seed"] for c in plan.choices] == [10, 11, 12]  # reproducible, yet the samples differ
    p = plan.choices[0].params
    assert p["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    assert (p["max_tokens"], p["temperature"], p["top_p"], p["top_k"], p["stop"]) == (7, 0.5, 0.9, 0, ["END"])
    assert (p["speculation"], p["max_draft_tokens"]) == (False, 2)
    assert p["stream_interval_ms"] == 0  # streamed to the caller: a chunk every step upstream


def test_defaults_are_openais_and_the_servers():
    p = parse_chat({"messages": USER}, max_n=16).choices[0].params
    assert (p["temperature"], p["top_p"], p["top_k"], p["seed"], p["max_tokens"], p["stop"]) == (1.0, 1.0, 0, None, 0, [])
    assert (p["speculation"], p["max_draft_tokens"], p["model"]) == (True, 0, "")
    assert p["stream_interval_ms"] == COLLECTED_STREAM_INTERVAL_MS  # a whole response: chunked upstream


def test_completion_prompts_each_get_n_choices_in_openais_order():
    plan = parse_completion({"prompt": ["a", "b"], "n": 2, "max_tokens": 3}, max_n=16)
    assert [(c.index, c.prompt_index, c.params["prompt"]) for c in plan.choices] == [
        (0, 0, "a"), (1, 0, "a"), (2, 1, "b"), (3, 1, "b")]
    assert parse_completion({"prompt": [5, 6]}, 16).choices[0].params["token_ids"] == [5, 6]
    assert [c.params["token_ids"] for c in parse_completion({"prompt": [[5], [6, 7]]}, 16).choices] == [[5], [6, 7]]


BAD_CHAT = [
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("logit_bias", {"logit_bias": {"5": 1}}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("messages", {"messages": []}),
    ("messages[0].role", {"messages": [{"role": "tool", "content": "x"}]}),
    ("messages[0].content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("temperature", {"temperature": -1}),
    ("temperature", {"temperature": "hot"}),
    ("top_p", {"top_p": 0}),
    ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": 2.5}),
    ("max_completion_tokens", {"max_tokens": 3, "max_completion_tokens": 3}),
    ("seed", {"seed": -1}),
    ("stop", {"stop": ["ok", ""]}),
    ("stop", {"stop": 5}),
    ("n", {"n": 0}),
    ("n", {"n": 17}),
    ("stream", {"stream": "yes"}),
    ("stream_options", {"stream_options": {"include_usage": True}}),  # without stream: true
    ("speculation.disable", {"speculation": {"disable": "no"}}),
    ("speculation.max_draft_tokens", {"speculation": {"max_draft_tokens": -1}}),
    ("speculation", {"speculation": {"k": 3}}),
    ("user", {"user": 5}),
]


@pytest.mark.parametrize("param,fields", BAD_CHAT, ids=[f"{p}={json.dumps(f)[:40]}" for p, f in BAD_CHAT])
def test_each_bad_chat_field_is_a_400_naming_it(param, fields):
    with pytest.raises(ApiError) as info:
        parse_chat({"messages": USER, **fields}, max_n=16)
    assert info.value.status == 400
    assert info.value.body()["error"]["param"] == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("prompt", ["", [], [-1], [[]], [1, "a"], {"text": "x"}, None])
def test_bad_completion_prompts_are_400(prompt):
    body = {"prompt": prompt} if prompt != "" else {"prompt": ""}
    if prompt == "":  # an empty string is a valid shape; the server refuses it (empty prompt)
        assert parse_completion(body, 16).choices[0].params["prompt"] == ""
        return
    with pytest.raises(ApiError) as info:
        parse_completion(body, 16)
    assert info.value.param == "prompt"


def test_a_body_that_is_not_an_object_is_a_400():
    with pytest.raises(ApiError):
        parse_chat(["messages"], 16)


def metrics(prompt, generated, steps, drafts, draft_tokens, accepted) -> SpecMetrics:
    return SpecMetrics(prompt, generated, steps, drafts, draft_tokens, accepted, generated / steps, (), ())


def chunk(tokens, m=None) -> Chunk:
    return Chunk("r", tuple(tokens), "", 0, FinishReason.STOP if m else None, "", m)


def test_usage_counts_a_prompt_once_and_sums_speculation_over_choices():
    a, b = ChoiceTotals(prompt_index=0), ChoiceTotals(prompt_index=0)
    a.add(chunk([1, 2]))
    a.add(chunk([3], metrics(5, 3, 2, 1, 4, 1)))
    b.add(chunk([7], metrics(5, 1, 1, 0, 0, 0)))
    u = usage([a, b])
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (5, 4, 9)
    assert u["speculation"] == {"drafts": 1, "draft_tokens": 4, "accepted_tokens": 1, "tau": round(4 / 3, 4)}


def test_keys_come_from_flags_and_the_environment_and_need_a_bearer_header():
    keys = configured_keys(["k1"], {"DSPARK_API_KEYS": " k2, ,k3 "})
    assert keys == ["k1", "k2", "k3"]
    check_authorization("Bearer k3", keys)
    check_authorization(None, [])  # no keys configured: open
    for header in (None, "Bearer nope", "k1", "Basic k1"):
        with pytest.raises(ApiError) as info:
            check_authorization(header, keys)
        assert info.value.status == 401 and info.value.body()["error"]["code"] == "invalid_api_key"


def test_stream_chunks_are_sse_lines_in_openais_shape():
    first = out.chunk("chat", "id1", 1, "m", 0, "hi", None, True, include_usage=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"} and first["usage"] is None
    last = out.chunk("completion", "id1", 1, "m", 2, "", "length", False, include_usage=False)
    assert last["choices"] == [{"index": 2, "text": "", "finish_reason": "length", "logprobs": None}]
    assert "usage" not in last
    line = out.sse(first)
    assert line.startswith(b"data: {") and line.endswith(b"\n\n") and json.loads(line[6:]) == first
    assert out.DONE == b"data: [DONE]\n\n"
