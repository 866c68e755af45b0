"""Every drafter the speculative loop can be given meets DrafterContract: the three local ones,
prompt lookup in front of any of them, draft-ahead on a thread, and the verifier's client of a remote
drafter service.
Checked on the classes (a remote drafter only knows its gamma once connected), member by member:
properties stay properties, and each method takes the contract's parameters, in order, with any
extras optional."""
from __future__ import annotations

import inspect

import pytest

from dspark.drafters import DFlashDrafter, DSparkDrafter, Eagle3Drafter
from dspark.drafters.ahead import DraftAheadThread
from dspark.drafters.contract import DrafterContract
from dspark.drafters.lookup import LookupDrafter
from verifier_svc.remote_drafter import RemoteDrafter

MEMBERS = [name for name in vars(DrafterContract) if not name.startswith("_")]


def test_the_contract_names_what_the_loop_uses():
    assert set(MEMBERS) == {"gamma", "ctx_layers", "kind", "version", "remote", "context_len", "extend_context",
                            "rollback", "release", "push", "probe", "probe_result", "draft", "free_draft",
                            "drafts_ahead", "draft_ahead"}


@pytest.mark.parametrize("cls", [DSparkDrafter, DFlashDrafter, Eagle3Drafter, RemoteDrafter, LookupDrafter,
                                 DraftAheadThread])
def test_drafter_meets_the_contract(cls):
    for name in MEMBERS:
        want, have = inspect.getattr_static(DrafterContract, name), inspect.getattr_static(cls, name, None)
        assert have is not None, f"{cls.__name__} lacks {name}"
        assert isinstance(have, property) == isinstance(want, property), f"{cls.__name__}.{name}: property or not"
        if isinstance(want, property):
            continue
        wanted = list(inspect.signature(want).parameters.values())
        offered = list(inspect.signature(have).parameters.values())
        assert [p.name for p in offered[:len(wanted)]] == [p.name for p in wanted], f"{cls.__name__}.{name}"
        extras = offered[len(wanted):]
        assert all(p.default is not inspect.Parameter.empty for p in extras), f"{cls.__name__}.{name}"
