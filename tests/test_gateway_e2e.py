"""The HTTP gateway with the official `openai` client against the real services on a tiny target.

The tiny target's tokenizer is word level ("w12 w40 ..."): one word per token, so token counts
can be read off the text. The verifier drafts every step (explore=1, --draft-probe-every=1) so
speculation is really at work, and the reference for every output is the gRPC SDK's.
"""
from __future__ import annotations

import concurrent.futures
import json
import time

import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai
import pytest
from dspark_client import Client, RetryPolicy
from service_helpers import (internal_channel, start_drafter, start_gateway, start_scheduler, start_verifier,
                             wait_http_ok, wait_registered, wait_serving, wait_until, write_tiny_target)

from dspark.proto_gen.v1 import verifier_pb2, verifier_pb2_grpc

pytestmark = pytest.mark.slow
KEY = "test-key-1"
MAX_CONCURRENT = 8  # the gateway's limit on generations in flight (checked below)
USER = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    path = str(write_tiny_target(tmp_path_factory.mktemp("tiny") / "tiny"))
    drafter, d_addr = start_drafter(path, logs)
    scheduler, s_addr = start_scheduler(logs, [])  # in-process store: no verifiers of other runs
    # No prompt lookup: the tiny target loops, and lookup would finish its 1000-token answers within
    # the cancellation tests' time and make the bursts the stop-string test looks for its own.
    verifier, v_addr = start_verifier(path, logs, d_addr, s_addr, explore=1.0, draft_probe_every=1, lookup="off")
    gateway, url = start_gateway(s_addr, logs, api_keys=["other-key", KEY], max_concurrent=MAX_CONCURRENT,
                                 max_request_bytes=65536)
    services = [gateway, verifier, scheduler, drafter]
    try:
        for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service)
        wait_registered(s_addr, 1)
        wait_http_ok(url + "/health", gateway)
        yield dict(url=url, scheduler=s_addr, verifier=v_addr, gateway=gateway)
    finally:
        for service in services:
            service.kill()


@pytest.fixture(scope="module")
def api(cluster):
    with openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=KEY, max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def sdk(cluster):
    with Client(cluster["scheduler"], timeout=120, retry=RetryPolicy(max_attempts=1)) as client:
        yield client


def stream_text(events) -> tuple[dict[int, str], dict[int, str], object]:
    """Chat or completion stream -> (text per choice, finish reason per choice, usage of the last chunk)."""
    texts, finishes, usage = {}, {}, None
    for event in events:
        usage = event.usage or usage
        for choice in event.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] = texts.get(choice.index, "") + (piece or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, usage


def test_models_lists_the_served_target(api):
    assert [m.id for m in api.models.list().data] == ["tiny"]


def test_greedy_chat_equals_the_sdk_streamed_and_not(api, sdk):
    reference = sdk.generate(messages=USER, max_tokens=24, temperature=0)
    whole = api.chat.completions.create(model="tiny", messages=USER, max_tokens=24, temperature=0)
    assert whole.choices[0].message.content == reference.text
    assert whole.choices[0].finish_reason == "length" and whole.object == "chat.completion"
    assert whole.usage.completion_tokens == len(reference.token_ids) == 24  # max_tokens, never more
    assert whole.usage.prompt_tokens == reference.metrics.prompt_tokens
    texts, finishes, usage = stream_text(api.chat.completions.create(
        model="tiny", messages=USER, max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert texts == {0: reference.text} and finishes == {0: "length"}
    # The usage chunk agrees with the stream (one word per token) and with the whole response.
    assert usage.completion_tokens == len(texts[0].split()) == whole.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.speculation["drafts"] > 0  # the drafter took part


def test_greedy_completion_equals_the_sdk_for_text_and_token_prompts(api, sdk):
    reference = sdk.generate(prompt="w9 w10 w11", max_tokens=16, temperature=0)
    whole = api.completions.create(model="tiny", prompt="w9 w10 w11", max_tokens=16, temperature=0)
    assert whole.choices[0].text == reference.text and whole.usage.completion_tokens == 16
    texts, finishes, usage = stream_text(api.completions.create(
        model="tiny", prompt="w9 w10 w11", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: reference.text} and usage.completion_tokens == 16
    by_ids = sdk.generate(token_ids=[9, 10, 11], max_tokens=8, temperature=0)
    assert api.completions.create(model="tiny", prompt=[9, 10, 11], max_tokens=8, temperature=0).choices[0].text \
        == by_ids.text


def test_n_2_gives_two_seeded_choices_streamed_and_not(api, sdk):
    request = dict(model="tiny", messages=USER, max_tokens=12, temperature=1.0, seed=5, n=2)
    whole = api.chat.completions.create(**request)
    texts = [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]
    # Choice i is sampled with seed + i: the same as two SDK calls with those seeds.
    assert texts == [sdk.generate(messages=USER, max_tokens=12, temperature=1.0, seed=s).text for s in (5, 6)]
    assert texts[0] != texts[1]
    prompt_tokens = sdk.generate(messages=USER, max_tokens=1).metrics.prompt_tokens
    assert whole.usage.completion_tokens == 24 and whole.usage.prompt_tokens == prompt_tokens  # counted once
    streamed, finishes, usage = stream_text(api.chat.completions.create(**request, stream=True,
                                                                       stream_options={"include_usage": True}))
    assert streamed == {0: texts[0], 1: texts[1]} and finishes == {0: "length", 1: "length"}
    assert usage.completion_tokens == 24


def test_seed_makes_sampling_reproducible(api):
    request = dict(model="tiny", prompt="w20 w21", max_tokens=20, temperature=0.9, top_p=0.95)
    first = api.completions.create(**request, seed=1234).choices[0].text
    assert api.completions.create(**request, seed=1234).choices[0].text == first
    assert api.completions.create(**request, seed=99).choices[0].text != first


SPECIAL_IDS = {1, 2, 3, 4}  # the tiny tokenizer's special tokens: they decode to no word (<unk>, 0, does)


def find_burst(sdk) -> tuple[str, int, str]:
    """A greedy output with a multi-token chunk (accepted draft tokens) whose first token's word is
    met first right there: (prompt, tokens before that chunk, the word)."""
    for i in range(5, 90, 3):
        prompt = f"w{i} w{i + 1} w{i + 2} w{i + 3}"
        chunks = list(sdk.generate_stream(prompt=prompt, max_tokens=40, temperature=0))
        text, before, words_before = "".join(c.text for c in chunks), 0, 0
        words = text.split()
        for c in chunks:
            if len(c.token_ids) >= 2 and c.token_ids[0] not in SPECIAL_IDS:
                word = words[words_before]
                # The stop string must first occur at this token, not earlier (e.g. "w5" inside "w54").
                if text.find(word) == len(" ".join(words[:words_before])) + (1 if words_before else 0):
                    return prompt, before, word
            before += len(c.token_ids)
            words_before += sum(t not in SPECIAL_IDS for t in c.token_ids)
    pytest.fail("no greedy output with an accepted burst on the tiny target")


def test_a_stop_string_inside_an_accepted_burst_cuts_text_and_tokens_exactly(api, sdk):
    prompt, before, word = find_burst(sdk)
    full = sdk.generate(prompt=prompt, max_tokens=40, temperature=0)
    expected = full.text[:full.text.find(word)]
    cut = sdk.generate(prompt=prompt, max_tokens=40, temperature=0, stop=[word])
    assert cut.text == expected and list(cut.token_ids) == list(full.token_ids[:before + 1])
    whole = api.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=word)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == before + 1  # through the token that completed the stop string
    texts, finishes, usage = stream_text(api.completions.create(
        model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=["w999", word], stream=True,
        stream_options={"include_usage": True}))
    assert texts == {0: expected} and finishes == {0: "stop"} and usage.completion_tokens == before + 1


def test_speculation_opt_out_and_cap_are_honoured_and_lossless(api):
    def run(**speculation):
        return api.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0,
                                           extra_body={"speculation": speculation} if speculation else None)

    default, off, capped = run(), run(disable=True), run(max_draft_tokens=1)
    assert default.usage.speculation["drafts"] > 0 and default.usage.speculation["draft_tokens"] > 0
    assert off.usage.speculation == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "tau": 1.0}
    cap = capped.usage.speculation
    assert 0 < cap["draft_tokens"] <= cap["drafts"]  # at most one draft token per step
    texts = {r.choices[0].message.content for r in (default, off, capped)}
    assert len(texts) == 1  # speculation never changes greedy output


def test_without_a_valid_key_the_answer_is_401_in_openais_shape(cluster):
    for key in ("wrong", ""):
        with openai.OpenAI(base_url=cluster["url"] + "/v1", api_key=key or "x", max_retries=0) as client:
            with pytest.raises(openai.AuthenticationError) as info:
                client.chat.completions.create(model="tiny", messages=USER, max_tokens=2)
            assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    bare = httpx.get(cluster["url"] + "/v1/models")  # no Authorization header at all
    assert bare.status_code == 401 and set(bare.json()["error"]) == {"message", "type", "param", "code"}
    other = httpx.get(cluster["url"] + "/v1/models", headers={"Authorization": "Bearer other-key"})
    assert other.status_code == 200  # several keys are accepted


BAD_FIELDS = [  # (param the error names, keyword arguments of chat.completions.create)
    ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])),
    ("tool_choice", dict(tool_choice="none")),
    ("response_format", dict(response_format={"type": "json_object"})),
    ("logprobs", dict(logprobs=True)),
    ("top_logprobs", dict(top_logprobs=3)),
    ("logit_bias", dict(logit_bias={"5": 10})),
    ("frequency_penalty", dict(frequency_penalty=1.0)),
    ("presence_penalty", dict(presence_penalty=-1.0)),
    ("temperature", dict(temperature=-0.5)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(extra_body={"top_k": -3})),
    ("max_tokens", dict(max_tokens=0)),
    ("n", dict(n=0)),
    ("n", dict(n=17)),
    ("seed", dict(seed=-1)),
    ("stop", dict(stop=["ok", ""])),
    ("stream_options", dict(stream_options={"include_usage": True})),  # without stream
    ("speculation.max_draft_tokens", dict(extra_body={"speculation": {"max_draft_tokens": -1}})),
    ("speculation", dict(extra_body={"speculation": {"k": 3}})),
    ("messages[0].role", dict(messages=[{"role": "tool", "content": "x", "tool_call_id": "1"}])),
    ("foo", dict(extra_body={"foo": 1})),
    ("model", dict(model="no-such-model")),  # the scheduler's NOT_FOUND: 404
]


@pytest.mark.parametrize("param,kwargs", BAD_FIELDS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_FIELDS)])
def test_each_bad_field_is_refused_in_openais_shape_and_the_server_keeps_serving(api, param, kwargs):
    request = dict(model="tiny", messages=USER, max_tokens=2) | kwargs
    expected = openai.NotFoundError if param == "model" else openai.BadRequestError
    with pytest.raises(expected) as info:
        api.chat.completions.create(**request)
    if param != "model":
        assert info.value.body["param"] == param, info.value.body
    assert set(info.value.body) == {"message", "type", "param", "code"}
    assert api.chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage.completion_tokens == 2


def test_upstream_refusals_and_limits_become_http_errors(cluster, api):
    with pytest.raises(openai.BadRequestError) as info:  # the verifier's OUT_OF_RANGE
        api.completions.create(model="tiny", prompt=[5] * 1024, max_tokens=2)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # the verifier's INVALID_ARGUMENT
        api.completions.create(model="tiny", prompt=[5, 10_000], max_tokens=2)
    big = httpx.post(cluster["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "tiny", "prompt": "w5 " * 30_000, "max_tokens": 2})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    broken = httpx.post(cluster["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        content=b'{"prompt": ')
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    with pytest.raises(openai.RateLimitError):  # more generations than --max-concurrent at once
        api.completions.create(model="tiny", prompt="w5", max_tokens=2, n=MAX_CONCURRENT + 1)
    assert api.completions.create(model="tiny", prompt="w5", max_tokens=2).usage.completion_tokens == 2


def running_on_verifier(address: str) -> int:
    with internal_channel(address) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).GetLoad(verifier_pb2.GetLoadRequest(), timeout=5).running


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_the_generation_upstream(cluster, stream):
    # 1000 tokens (the verifier's --max-len is 1024), every step a drafted one (explore=1): seconds here,
    # so the client waits 1 s at most (they once finished inside the 3 s it used to wait).
    body = {"model": "tiny", "messages": USER, "max_tokens": 1000, "temperature": 0, "stream": stream}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cluster["url"], headers=headers, timeout=httpx.Timeout(60, read=1.0)) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                lines = response.iter_lines()
                assert json.loads(next(line for line in lines if line.startswith("data:"))[5:])["choices"]
                assert running_on_verifier(cluster["verifier"]) == 1
        else:  # the request runs in a thread that gives up after 1 s without an answer
            waiting = concurrent.futures.ThreadPoolExecutor(1).submit(
                http.post, "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
            wait_until(lambda: running_on_verifier(cluster["verifier"]) == 1, 1.0, what="the generation running")
            with pytest.raises(httpx.ReadTimeout):
                waiting.result()
    left = time.monotonic()
    wait_until(lambda: running_on_verifier(cluster["verifier"]) == 0, 3, what="the verifier's slot freed")
    assert time.monotonic() - left < 3
    health = httpx.get(cluster["url"] + "/health").json()
    assert health["in_flight"] == 0
