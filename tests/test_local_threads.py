"""dspark.local splits the host's cores between the services it starts on it, and runs the drafter
inside the verifier where the two would share them."""
from __future__ import annotations

import pytest

from dspark.local import runs_drafter_service, service_threads


@pytest.mark.parametrize("cores, verifier", [(1, 1), (2, 2), (4, 4), (16, 16)])
def test_the_verifier_takes_every_core_and_the_other_services_one(cores, verifier):
    threads = service_threads(cores)
    assert threads["verifier_svc"] == verifier
    # everything else (drafter, scheduler, gateway) runs on one thread
    assert threads.get("drafter_svc", 1) == 1 and threads.get("scheduler_svc", 1) == 1


@pytest.mark.parametrize("cores, requested", [(2, 2), (2, 1), (16, 4)])
def test_omp_num_threads_sets_the_verifiers_threads_only(cores, requested):
    threads = service_threads(cores, requested)
    assert threads["verifier_svc"] == requested
    # a drafter with a second OpenMP team beside the verifier's spins on its cores: never more than one
    assert threads.get("drafter_svc", 1) == 1 and threads.get("scheduler_svc", 1) == 1


@pytest.mark.parametrize("choice, cores, checkpoint, service", [
    ("auto", 2, "drafters/x/dspark", False),  # a small host: inside the verifier, no round trip
    ("auto", 8, "drafters/x/dspark", True),   # cores to spare: the deployed layout
    ("on", 2, "drafters/x/dspark", True),
    ("off", 16, "drafters/x/dspark", False),
    ("off", 2, "", True),                     # a random drafter exists only in the drafter service
])
def test_the_drafter_runs_as_a_service_where_it_gets_cores_of_its_own(choice, cores, checkpoint, service):
    assert runs_drafter_service(choice, cores, checkpoint) is service
