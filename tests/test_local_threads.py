"""dspark.local splits the host's cores between the services it starts on it."""
from __future__ import annotations

import pytest

from dspark.local import service_threads


@pytest.mark.parametrize("cores, verifier", [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_the_verifier_leaves_one_core_to_the_serving_path(cores, verifier):
    threads = service_threads(cores)
    assert threads["verifier_svc"] == verifier
    # everything else (drafter, scheduler, gateway) runs on one thread
    assert threads.get("drafter_svc", 1) == 1 and threads.get("scheduler_svc", 1) == 1
