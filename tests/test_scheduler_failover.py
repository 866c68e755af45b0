"""Issue 15, finding 6: killing a scheduler failed every in-flight stream. Two scheduler replicas
share one Redis; the verifier reports to both (the next one when a call fails); the client SDK
knows both and resumes a broken stream on the other from the last token it received.

8 concurrent greedy streams, the scheduler they run through killed (SIGKILL) mid-stream:
0 failed, each output exactly plain greedy decoding (no token lost, none twice).
"""
from __future__ import annotations

import pytest
from dspark_client import RetryPolicy
from service_helpers import (RedisServer, StreamThread, start_drafter, start_scheduler, start_verifier, wait_registered,
                             wait_serving, wait_until, write_tiny_target)
from spec_helpers import greedy_reference

from dspark.models.loader import load_model

pytestmark = pytest.mark.slow
PROMPTS = [[5 + i, 9 + 2 * i, 30 + i, 41 + 3 * i][: 2 + i % 3] for i in range(8)]
MAX_TOKENS = 300


def test_scheduler_killed_mid_stream_fails_nothing_and_loses_no_token(tmp_path):
    path = str(write_tiny_target(tmp_path / "tiny"))
    reference = greedy_reference(load_model(path, precision="auto").model, PROMPTS, MAX_TOKENS, max_len=1024)
    redis_server = RedisServer().start()
    services = []
    try:
        drafter, d_addr = start_drafter(path, tmp_path)
        first, s1 = start_scheduler(tmp_path, [], redis_url=redis_server.url)
        second, s2 = start_scheduler(tmp_path, [], redis_url=redis_server.url)
        services += [drafter, first, second]
        verifier, v_addr = start_verifier(path, tmp_path, d_addr, f"{s1},{s2}")
        services.append(verifier)
        for service, address in ((drafter, d_addr), (first, s1), (second, s2), (verifier, v_addr)):
            wait_serving(address, service)
        wait_registered(s1, 1)
        wait_registered(s2, 1)  # through Redis: the verifier reports to the first replica only

        retry = RetryPolicy(max_attempts=4, initial_backoff=0.05)
        running = [StreamThread(f"{s1},{s2}", retry=retry, token_ids=p, max_tokens=MAX_TOKENS) for p in PROMPTS]
        wait_until(lambda: all(len(s.tokens) >= 10 for s in running), 120, what="tokens flowing")
        first.kill()
        before = [len(s.tokens) for s in running]
        results = [s.result() for s in running]
        assert all(n < MAX_TOKENS for n in before), "a stream ended before the kill: nothing was tested for it"
        for stream, result, want in zip(running, results, reference):
            assert list(result.token_ids) == want  # none lost, none twice, exactly plain greedy
            assert result.finish_reason.value == "length"
            assert [c.offset for c in stream.chunks] == \
                [sum(len(c.token_ids) for c in stream.chunks[:i]) for i in range(len(stream.chunks))]
        # The verifier moved its reports to the surviving replica, which still routes new work.
        fresh = StreamThread(s2, token_ids=PROMPTS[0], max_tokens=40).result()
        assert list(fresh.token_ids) == reference[0][:40]
    finally:
        for service in services:
            service.kill()
        redis_server.kill()
