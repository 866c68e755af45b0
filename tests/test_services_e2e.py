"""End to end through three separate server processes on localhost and real Redis, with the
real SmolLM2 target and a random-initialised DSpark drafter: greedy output through the services
equals in-process plain greedy decoding, and seeded sampling is reproducible."""
from __future__ import annotations

import pytest
from service_helpers import (RedisServer, StreamThread, start_drafter, start_scheduler, start_verifier, wait_registered,
                             wait_serving)

from dspark.engine.generate import Engine
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams

pytestmark = pytest.mark.slow
TOPICS = ["the moon", "rivers", "bread", "chess", "volcanoes", "owls", "the ocean", "trains", "music", "glass",
          "bees", "winter", "maps", "clocks", "salt", "bridges"]
PROMPTS = [f"Write one sentence about {t}." for t in TOPICS]
MAX_TOKENS = [24 + (i * 7) % 25 for i in range(len(PROMPTS))]  # 24..48, all different lengths mixed


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    # A Redis of its own: on a shared one, verifiers of other runs register and get our requests.
    redis_server = RedisServer().start()
    drafter, d_addr = start_drafter("smollm2-135m", logs, gamma=7, num_layers=1)
    scheduler, s_addr = start_scheduler(logs, [], redis_url=redis_server.url)
    verifier, v_addr = start_verifier("smollm2-135m", logs, d_addr, s_addr, max_len=512, drafter_timeout_s=10)
    try:
        for service, address in ((drafter, d_addr), (scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service, timeout=300)
        wait_registered(s_addr, 1)
        yield s_addr
    finally:
        for service in (verifier, scheduler, drafter):
            service.kill()
        redis_server.kill()


def test_greedy_through_services_equals_plain_greedy_for_16_concurrent_streams(cluster):
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    streams = [StreamThread(cluster, messages=m, max_tokens=n) for m, n in zip(messages, MAX_TOKENS)]
    loaded = load_model(precision="auto")  # meanwhile, the in-process reference at the services' default precision
    engine = Engine(loaded.model, max_batch=len(PROMPTS), max_len=512)
    prompts = [loaded.tokenizer.encode_chat(m) for m in messages]
    reference = engine.generate(prompts, [SamplingParams(max_tokens=n) for n in MAX_TOKENS])
    results = [s.result(timeout=600) for s in streams]
    for result, ref in zip(results, reference):
        assert list(result.token_ids) == ref.output
        assert result.text == loaded.tokenizer.decode(ref.output)
        assert result.metrics.generated_tokens == len(ref.output)
    assert sum(r.metrics.draft_tokens for r in results) > 0  # the drafter really took part


def test_seeded_sampling_is_reproducible(cluster):
    from dspark_client import Client, FinishReason

    request = dict(prompt="Once upon a time", temperature=0.8, top_p=0.95, seed=1234, max_tokens=32)
    with Client(cluster, timeout=300) as client:
        first, second = client.generate(**request), client.generate(**request)
        other = client.generate(**dict(request, seed=99))
    assert first.text == second.text and first.token_ids == second.token_ids
    # 32 tokens, or fewer where the sample ended the text (the draw depends on the CPU's int8 kernels).
    assert (len(first.token_ids) == 32 and first.finish_reason == FinishReason.LENGTH) or \
        (0 < len(first.token_ids) < 32 and first.finish_reason == FinishReason.STOP)
    assert first.metrics.draft_tokens > 0
    assert other.token_ids != first.token_ids  # the seed does matter


def test_a_stream_interval_sends_the_same_tokens_in_fewer_chunks(cluster):
    """stream_interval_ms crosses the scheduler to the verifier: an hour's interval gives the first
    chunk and the last one, with every token of the stream that had a chunk each step."""
    request = dict(messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=32)
    every_step = StreamThread(cluster, **request)
    every_step_result = every_step.result(timeout=600)
    held = StreamThread(cluster, stream_interval_ms=3_600_000, **request)
    held_result = held.result(timeout=600)
    assert held_result.token_ids == every_step_result.token_ids and held_result.text == every_step_result.text
    assert len(held.chunks) == 2 < len(every_step.chunks)
    assert held.chunks[0].offset == 0 and held.chunks[1].offset == len(held.chunks[0].token_ids)
