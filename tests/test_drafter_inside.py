"""A drafter inside the verifier (--drafter): the shipped DSpark on the real SmolLM2 target, run on
the verifier's own torch thread, behind a real scheduler. Greedy output equals in-process plain
greedy decoding, seeded sampling replays, and the drafter's identity and shipped calibration reach
the scheduler as a drafter service's would."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from service_helpers import (REPO, TOKEN, StreamThread, free_port, start_scheduler, start_verifier, wait_registered,
                             wait_serving)

from dspark.drafters.checkpoint import load_calibration
from dspark.drafters.shipped import default_drafter_dir, load_drafter_for
from dspark.engine.generate import Engine
from dspark.models.loader import load_model
from dspark.sampling import SamplingParams

pytestmark = pytest.mark.slow
PROMPTS = ["Write a Python function that reverses a string.", "What is 17 times 23?",
           "List three uses of copper.", "Explain recursion in one sentence."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    scheduler, s_addr = start_scheduler(logs, [])
    # A fixed draft length: every step drafts, so the drafter surely takes part.
    verifier, v_addr = start_verifier("smollm2-135m", logs, "", s_addr, drafter="dspark", schedule="off",
                                      draft_len=3, max_len=512)
    try:
        for service, address in ((scheduler, s_addr), (verifier, v_addr)):
            wait_serving(address, service, timeout=300)
        wait_registered(s_addr, 1)
        yield s_addr, verifier
    finally:
        for service in (verifier, scheduler):
            service.kill()


def test_greedy_with_the_drafter_inside_equals_plain_greedy(cluster):
    s_addr, _ = cluster
    messages = [[{"role": "user", "content": p}] for p in PROMPTS]
    streams = [StreamThread(s_addr, messages=m, max_tokens=MAX_TOKENS) for m in messages]
    loaded = load_model(precision="auto")
    engine = Engine(loaded.model, max_batch=len(PROMPTS), max_len=512)
    reference = engine.generate([loaded.tokenizer.encode_chat(m) for m in messages],
                                SamplingParams(max_tokens=MAX_TOKENS))
    results = [s.result(timeout=600) for s in streams]
    for result, ref in zip(results, reference):
        assert list(result.token_ids) == ref.output
    assert sum(r.metrics.draft_tokens for r in results) > 0  # the drafter really took part
    assert sum(r.metrics.accepted_tokens for r in results) > 0  # and it is the trained one


def test_seeded_sampling_with_the_drafter_inside_replays(cluster):
    from dspark_client import Client

    request = dict(prompt="Once upon a time", temperature=0.8, top_p=0.95, seed=77, max_tokens=32)
    with Client(cluster[0], timeout=300) as client:
        first, second = client.generate(**request), client.generate(**request)
        models = client.list_models()
    assert first.token_ids == second.token_ids and len(first.token_ids) == 32
    assert first.metrics.draft_tokens > 0
    assert [(m.drafter, m.gamma) for m in models] == [("dspark", 7)]


def test_the_drafter_inside_carries_its_shipped_calibration():
    loaded = load_model(precision="auto")
    drafter = load_drafter_for(loaded, "dspark", loaded.model.precision)
    shipped = load_calibration(default_drafter_dir(loaded.name), drafter.version)
    assert shipped is not None and np.allclose(drafter.sts_temperatures, shipped)


def test_a_verifier_given_both_a_drafter_and_a_drafter_service_refuses_to_start():
    from verifier_svc.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--drafter=dspark", "--drafter-addr=127.0.0.1:1"])


def test_a_drafter_that_does_not_exist_stops_the_verifier_with_its_name(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSPARK_INTERNAL_TOKEN": TOKEN}
    proc = subprocess.run([sys.executable, "-m", "verifier_svc", f"--port={free_port()}", "--drafter=no-such-drafter",
                           "--sps-warmup-s=0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "no-such-drafter" in proc.stderr + proc.stdout
