"""Failure rules (method.md 6): a drafter, Redis or a verifier dying costs speed, never a request.

Real processes on localhost with a tiny target written here (no EOS, so every request runs to
max_tokens); outputs are checked against in-process plain greedy decoding of the same target.
"""
from __future__ import annotations

import time

import pytest
from service_helpers import (RedisServer, StreamThread, free_port, scrape, start_drafter, start_scheduler, start_verifier,
                             tiny_target_and_reference, wait_registered, wait_serving, wait_until)


pytestmark = pytest.mark.slow
PROMPTS = [[5 + i, 9 + 2 * i, 30 + i, 41 + 3 * i][: 2 + i % 3] for i in range(6)]
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target_and_reference(tmp_path_factory, PROMPTS, MAX_TOKENS)


@pytest.fixture
def logs(tmp_path):
    return tmp_path


@pytest.fixture
def services():
    started = []
    yield started
    for service in started:
        service.kill()


def start(services, pair):
    services.append(pair[0])
    return pair


def streams(address, prompts=PROMPTS, **kw):
    return [StreamThread(address, token_ids=p, max_tokens=MAX_TOKENS, **kw) for p in prompts]


def kill_drafter_mid_stream(target, logs, services, tokens_first: int, before_kill=lambda: True,
                            **verifier_flags) -> tuple[str, str]:
    """A drafter and a verifier; streams running; the drafter killed once each has tokens_first
    tokens and before_kill() holds. Every stream must still finish with exactly the plain greedy
    text. Returns the verifier's and the dead drafter's addresses."""
    path, reference = target
    drafter, d_addr = start(services, start_drafter(path, logs))
    wait_serving(d_addr, drafter)
    verifier, v_addr = start(services, start_verifier(path, logs, d_addr, **verifier_flags))
    wait_serving(v_addr, verifier)
    running = streams(v_addr)
    wait_until(lambda: all(len(s.tokens) >= tokens_first for s in running) and before_kill(), 60,
               what="tokens flowing")
    drafter.kill()
    before = [len(s.tokens) for s in running]
    results = [s.result() for s in running]
    assert any(n < MAX_TOKENS for n in before), "the drafter died after the streams ended: nothing was tested"
    for result, want in zip(results, reference):
        assert list(result.token_ids) == want  # no failure, no corruption: still exactly plain greedy
        assert result.finish_reason.value == "length"
    return v_addr, d_addr


def test_drafter_killed_mid_stream_fails_nothing_and_speculation_resumes(target, logs, services):
    path, reference = target
    # No prompt lookup: it drafts with no drafter at all, and what is tested is the drafter's absence.
    v_addr, d_addr = kill_drafter_mid_stream(target, logs, services, 20, lookup="off")

    # Without a drafter requests decode plainly ...
    plain = StreamThread(v_addr, token_ids=PROMPTS[0], max_tokens=40).result()
    assert list(plain.token_ids) == reference[0][:40] and plain.metrics.draft_tokens == 0
    # ... and speculate again once a drafter is back on the same address.
    drafter2, _ = start(services, start_drafter(path, logs, port=int(d_addr.rsplit(":", 1)[1])))
    wait_serving(d_addr, drafter2)

    def speculating():
        r = StreamThread(v_addr, token_ids=PROMPTS[1], max_tokens=40).result()
        assert list(r.token_ids) == reference[1][:40]
        return r.metrics.draft_tokens > 0

    wait_until(speculating, 30, interval=0.5, what="speculation resumed")


def test_with_prompt_lookup_a_killed_drafter_changes_no_token_and_lookup_keeps_drafting(target, logs, services):
    """The verifier's default: lookup in front of the drafter service. The service dies mid-stream:
    no failure, the same greedy text, and lookup (which needs no drafter) still drafts."""
    _, reference = target
    v_addr, _ = kill_drafter_mid_stream(target, logs, services, 4)
    after = StreamThread(v_addr, token_ids=PROMPTS[0], max_tokens=40).result()
    assert list(after.token_ids) == reference[0][:40] and after.metrics.accepted_tokens > 0


def test_drafter_killed_while_drafting_ahead_changes_no_token_and_drafting_ahead_resumes(target, logs, services):
    """Draft-ahead on, 2 of 4 drafts verified a step, so every drafted step sends the
    next block's draft ahead: the drafter dies with drafts ahead in flight, comes back, and the
    text is the plain greedy text throughout."""
    path, reference = target
    port = free_port()
    sent = lambda: scrape(port).get("dspark_drafts_ahead_sent_total", 0)  # noqa: E731
    v_addr, d_addr = kill_drafter_mid_stream(target, logs, services, 8, before_kill=lambda: sent() > 0,
                                             lookup="off", draft_len=2, draft_ahead="on", metrics_port=port)
    before = sent()
    drafter2, _ = start(services, start_drafter(path, logs, port=int(d_addr.rsplit(":", 1)[1])))
    wait_serving(d_addr, drafter2)

    def drafting_ahead_again():
        r = StreamThread(v_addr, token_ids=PROMPTS[2], max_tokens=40).result()
        assert list(r.token_ids) == reference[2][:40]
        return sent() > before

    wait_until(drafting_ahead_again, 30, interval=0.5, what="drafting ahead again")


def test_verifier_killed_mid_stream_resumes_on_the_other(target, logs, services):
    path, reference = target
    drafter, d_addr = start(services, start_drafter(path, logs))
    wait_serving(d_addr, drafter)
    ports = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    scheduler, s_addr = start(services, start_scheduler(logs, ports))
    wait_serving(s_addr, scheduler)
    verifiers = [start(services, start_verifier(path, logs, d_addr, s_addr, port=int(a.rsplit(":", 1)[1])))[0]
                 for a in ports]
    for v, a in zip(verifiers, ports):
        wait_serving(a, v)
    wait_until(lambda: "registered at" in scheduler.log() and scheduler.log().count("registered at") >= 2, 30,
               what="both verifiers registered")

    running = streams(s_addr)
    wait_until(lambda: all(len(s.tokens) >= 20 for s in running), 60, what="tokens flowing")
    verifiers[0].kill()
    before = [len(s.tokens) for s in running]
    results = [s.result() for s in running]
    assert any(n < MAX_TOKENS for n in before)
    for stream, result, want in zip(running, results, reference):
        assert list(result.token_ids) == want  # identical greedy output, nothing duplicated or lost
        assert [c.offset for c in stream.chunks] == [sum(len(c.token_ids) for c in stream.chunks[:i])
                                                     for i in range(len(stream.chunks))]
        assert result.finish_reason.value == "length"
    assert "resuming elsewhere" in scheduler.log()


def test_redis_outage_fails_no_request_and_registry_recovers(target, logs, services):
    path, reference = target
    redis_server = RedisServer().start()
    try:
        drafter, d_addr = start(services, start_drafter(path, logs))
        scheduler, s_addr = start(services, start_scheduler(logs, [], redis_url=redis_server.url))
        wait_serving(d_addr, drafter)
        wait_serving(s_addr, scheduler)
        verifier, v_addr = start(services, start_verifier(path, logs, d_addr, s_addr))
        wait_serving(v_addr, verifier)
        wait_registered(s_addr, 1)
        assert redis_server.client().exists(f"dspark:verifier:verifier-{v_addr.rsplit(':', 1)[1]}")

        running = streams(s_addr, PROMPTS[:3])
        wait_until(lambda: all(len(s.tokens) >= 10 for s in running), 60, what="tokens flowing")
        redis_server.kill()
        time.sleep(1.0)
        # Redis is down: a new request is still routed (from the last known registry) and served.
        during = StreamThread(s_addr, token_ids=PROMPTS[3], max_tokens=30).result()
        assert list(during.token_ids) == reference[3][:30]
        time.sleep(2.0)
        redis_server.start()  # same port, empty (no persistence): the heartbeats must refill it
        key = f"dspark:verifier:verifier-{v_addr.rsplit(':', 1)[1]}"
        wait_until(lambda: redis_server.client().exists(key), 10, what="registry repopulated by heartbeats")
        for result, want in zip([s.result() for s in running], reference):
            assert list(result.token_ids) == want
        after = StreamThread(s_addr, token_ids=PROMPTS[4], max_tokens=30).result()
        assert list(after.token_ids) == reference[4][:30]
        assert "store unreachable" in scheduler.log() and "store reachable again" in scheduler.log()
    finally:
        redis_server.kill()


def test_sigterm_drains_in_flight_requests(target, logs, services):
    path, reference = target
    verifier, v_addr = start(services, start_verifier(path, logs, ""))
    wait_serving(v_addr, verifier)
    running = streams(v_addr, PROMPTS[:2])
    wait_until(lambda: all(len(s.tokens) >= 5 for s in running), 60, what="tokens flowing")
    assert verifier.terminate(timeout=60) == 0  # exits by itself, after the drain
    for result, want in zip([s.result() for s in running], reference):
        assert list(result.token_ids) == want
    assert "draining" in verifier.log() and "stopped" in verifier.log()
