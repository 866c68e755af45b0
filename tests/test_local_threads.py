"""dspark.local splits the host's cores between the services it starts on it."""
from __future__ import annotations

import pytest

from dspark.local import service_threads


@pytest.mark.parametrize("cores, verifier", [(1, 1), (2, 2), (4, 4), (16, 16)])
def test_the_verifier_takes_every_core_and_the_other_services_one(cores, verifier):
    threads = service_threads(cores)
    assert threads["verifier_svc"] == verifier
    # everything else (drafter, scheduler, gateway) runs on one thread
    assert threads.get("drafter_svc", 1) == 1 and threads.get("scheduler_svc", 1) == 1
