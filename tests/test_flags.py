"""Service flags and their environment variables, declared once (FlagParser): the variable is the
default, the flag wins, and a bad value in either stops the process with a message that names it."""
from __future__ import annotations

import pytest

from dspark.serving.config import FlagParser


def parser() -> FlagParser:
    ap = FlagParser()
    ap.add_argument("--max-batch", type=int, env="DSPARK_T_MAX_BATCH", default=16)
    ap.add_argument("--schedule", choices=["on", "off"], env="DSPARK_T_SCHEDULE", default="on")
    group = ap.add_argument_group("g")
    group.add_argument("--reflection", action="store_true", env="DSPARK_T_REFLECTION", default=False)
    return ap


def test_env_is_the_default_and_the_flag_wins(monkeypatch):
    assert vars(parser().parse_args([])) == {"max_batch": 16, "schedule": "on", "reflection": False}
    monkeypatch.setenv("DSPARK_T_MAX_BATCH", "4")
    monkeypatch.setenv("DSPARK_T_SCHEDULE", "off")
    monkeypatch.setenv("DSPARK_T_REFLECTION", "1")
    assert vars(parser().parse_args([])) == {"max_batch": 4, "schedule": "off", "reflection": True}
    assert parser().parse_args(["--max-batch", "8"]).max_batch == 8
    monkeypatch.setenv("DSPARK_T_MAX_BATCH", "")  # Helm renders a missing value as "": unset
    assert parser().parse_args([]).max_batch == 16


@pytest.mark.parametrize("name, value", [("DSPARK_T_MAX_BATCH", "sixteen"), ("DSPARK_T_SCHEDULE", "maybe")])
def test_a_bad_environment_value_is_a_clear_error(monkeypatch, capsys, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stop:
        parser()
    assert stop.value.code == 2
    assert f"${name}={value!r}" in capsys.readouterr().err


def test_every_service_refuses_a_bad_environment_value(monkeypatch, capsys):
    from drafter_svc.__main__ import parse_args as drafter_args
    from gateway_svc.__main__ import parse_args as gateway_args
    from scheduler_svc.__main__ import parse_args as scheduler_args
    from verifier_svc.__main__ import parse_args as verifier_args

    for parse in (verifier_args, drafter_args, scheduler_args, gateway_args):
        monkeypatch.setenv("DSPARK_PORT", "fifty")
        with pytest.raises(SystemExit):
            parse([])
        assert "$DSPARK_PORT='fifty'" in capsys.readouterr().err
