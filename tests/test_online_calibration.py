"""Online STS through the scheduler service: synthetic step reports over gRPC to two real
scheduler processes sharing a real Redis.

Confidence logits come from a known over-confident model (test_calibration.overconfident_traffic:
true survival sigmoid(t), reported logit 2.5 t) with outcomes sampled from the true model.
The schedulers bin them into Redis, refit, and hand temperatures back in their BudgetDecision
replies; the fit must calibrate as well as the offline fit_sts on the same traffic.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import grpc
import numpy as np
import pytest
import torch
from service_helpers import (TOKEN, RedisServer, free_port, internal_address, internal_channel, start_scheduler,
                             wait_serving, wait_until)
from test_calibration import GAMMA, overconfident_traffic

from dspark.proto_gen.v1 import load_pb2, scheduler_pb2, scheduler_pb2_grpc
from dspark.sched.calibration import OnlineCalibrationStats, apply_sts, fit_sts, sigmoid
from dspark.sched.metrics import per_position_calibration
from dspark.sched.prefix_scheduler import budget_from_survival
from dspark.sched.verify_budget import calibrated_survival, pooled_survival, verify_budget
from scheduler_svc.budget_planner import seconds_table
from scheduler_svc.calibration_store import RedisCalibrationStore, bins_key, sts_key
from scheduler_svc.online_calibration import OnlineCalibrator

pytestmark = pytest.mark.slow
VERSION = "synthetic-dspark-v1"
ROWS = 16  # blocks per step report
RPC_S = 30  # generous: these machines may be starved of CPU
# (batch tokens, step seconds) as a verifier publishes them: 100 steps/s at B = 1 down to 18 at B = 128.
SPS = [(b, 1.0 / rate) for b, rate in [(1, 100.0), (2, 99.0), (4, 97.0), (8, 90.0), (16, 80.0), (32, 60.0),
                                       (64, 35.0), (128, 18.0)]]


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="module")
def schedulers(redis_server, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    started = []
    for _ in range(2):
        metrics_port = free_port()
        service, address = start_scheduler(logs, [], redis_url=redis_server.url, metrics_port=metrics_port,
                                           calibration_refit_reports=100000, calibration_refit_s=1,
                                           calibration_min_samples=200, min_draft_gain=1.0)  # the bare rule
        started.append((service, address, metrics_port))
    try:
        for service, address, _ in started:
            wait_serving(address, service, timeout=600)
        yield [(address, metrics_port) for _, address, metrics_port in started]
    finally:
        for service, _, _ in started:
            service.kill()


def load(verifier_id: str) -> load_pb2.VerifierLoad:
    return load_pb2.VerifierLoad(verifier_id=verifier_id, max_batch=16, model="synthetic",
                                 sps=[load_pb2.SpsPoint(batch_tokens=b, step_seconds=s) for b, s in SPS])


def register(stub, verifier_id: str, draft_cost=()) -> load_pb2.BudgetDecision:
    """draft_cost: [(requests, seconds)] the verifier publishes as its draft-cost table."""
    verifier_load = load(verifier_id)
    verifier_load.draft_cost.extend([load_pb2.DraftCostPoint(requests=r, seconds=s) for r, s in draft_cost])
    return stub.RegisterVerifier(scheduler_pb2.RegisterVerifierRequest(
        address="127.0.0.1:9", model="synthetic", drafter_kind="dspark", drafter_version=VERSION, gamma=GAMMA,
        load=verifier_load), timeout=RPC_S)


def report(verifier_id: str, step: int, logits: np.ndarray, accepted, verified) -> scheduler_pb2.StepReport:
    from dspark.proto_gen.v1 import tensor_pb2

    logits = np.ascontiguousarray(logits, dtype="<f4")
    return scheduler_pb2.StepReport(
        verifier_id=verifier_id, step=step, batch_size=len(logits), batch_tokens=int(len(logits) + np.sum(verified)),
        step_latency_s=0.01, drafter_version=VERSION, verified_len=[int(v) for v in verified],
        accepted_len=[int(a) for a in accepted],
        confidence_logits=tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_F32, shape=list(logits.shape),
                                            data=logits.tobytes()))


def temperatures_of(decision: load_pb2.BudgetDecision) -> np.ndarray:
    return np.frombuffer(decision.calibration.temperatures.data, dtype="<f4").astype(np.float64)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=RPC_S) as response:
        return response.read().decode()


def gauge(text: str, name: str, **labels) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_online_sts_through_redis_matches_offline_fit(schedulers, redis_server):
    logits, accepted_len, verified_len = overconfident_traffic(seed=3, num=12000)
    logits = logits.astype(np.float32).astype(np.float64)  # what travels: f32
    channels = [internal_channel(internal_address(address)) for address, _ in schedulers]
    stubs = [scheduler_pb2_grpc.SchedulerStub(c) for c in channels]
    try:
        for i, stub in enumerate(stubs):
            first = register(stub, f"synthetic-{i}")
            assert not first.decided and first.calibration.version == 0  # nothing reported yet
        # Alternate replicas: each scheduler only ever sees half of the reports.
        started = time.monotonic()
        for step, rows in enumerate(np.array_split(np.arange(len(logits)), len(logits) // ROWS)):
            i = step % 2
            reply = stubs[i].ReportStep(report(f"synthetic-{i}", step, logits[rows], accepted_len[rows],
                                               verified_len[rows]), timeout=RPC_S)
        send_s = time.monotonic() - started
        assert reply.decided  # the two-step rule answered as soon as confidences + SPS existed

        # The accumulated bins in Redis are exactly the statistics of all the traffic (merge-safe).
        expected = OnlineCalibrationStats(GAMMA)
        expected.add(logits, accepted_len, verified_len)
        client = redis_server.client()

        def all_binned():
            fields = client.hgetall(bins_key(VERSION))
            return fields and int(fields.get("reports", 0)) == len(logits) // ROWS and fields

        fields = wait_until(all_binned, 120, what="all reports binned in Redis")
        assert json.loads(fields["layout"]) == {"gamma": GAMMA, "bin_width": 1 / 16, "logit_limit": 16.0}
        for name, array in (("r", expected.reached), ("a", expected.accepted)):
            got = np.zeros_like(array)
            for field, value in fields.items():
                if field.startswith(f"{name}:"):
                    _, k, b = field.split(":")
                    got[int(k), int(b)] = int(value)
            np.testing.assert_array_equal(got, array)

        # A refit over all of it lands in Redis, with a version, and comes back in the replies.
        def fitted_on_everything():
            sts = client.hgetall(sts_key(VERSION))
            return sts and json.loads(sts["samples"]) == expected.num_samples.tolist() and sts

        sts = wait_until(fitted_on_everything, 120, what="a refit on all reports")
        stored = np.array(json.loads(sts["temperatures"]))
        version = int(sts["version"])
        assert version >= 1
        for i, stub in enumerate(stubs):
            def newest(stub=stub, i=i):
                reply = stub.Heartbeat(scheduler_pb2.HeartbeatRequest(load=load(f"synthetic-{i}")), timeout=RPC_S)
                return reply.calibration.version >= version and reply
            decision = wait_until(newest, 60, what="the newest temperatures in the replies")
            assert decision.calibration.drafter_version == VERSION
            np.testing.assert_allclose(temperatures_of(decision), stored, rtol=1e-6)

        # Calibration quality, measured the reference evaluator's way (prefix survival per position).
        def position_ece(temperatures):
            return per_position_calibration(apply_sts(logits, temperatures), accepted_len, verified_len)

        raw = per_position_calibration(sigmoid(logits), accepted_len, verified_len)
        offline, online = position_ece(fit_sts(logits, accepted_len, verified_len)), position_ece(stored)
        print(f"\nsent {len(logits) // ROWS} reports in {send_s:.1f} s; T online {np.round(stored, 3)}")
        print("ECE per position raw", np.round(raw.ece, 4), "offline", np.round(offline.ece, 4),
              "online", np.round(online.ece, 4))
        assert raw.mean_ece > 0.05  # over-confident to start with
        assert np.all(online.ece <= offline.ece + 0.02)
        assert online.mean_ece < offline.mean_ece + 0.02 and online.mean_ece < 0.025
        assert np.all(stored > 1.5)  # it really cooled the inflated logits (true factor 2.5)

        # The scheduler that fitted exports the per-position ECE of its fit.
        texts = [scrape(port) for _, port in schedulers]
        exported = [gauge(t, "dspark_calibration_ece", position="1") for t in texts]
        assert any(e is not None for e in exported)
        assert min(e for e in exported if e is not None) < 0.03

        # The budget: the two-step rule on the newest report, its temperatures and the published SPS.
        probe = logits[:ROWS] * 0.5
        for step in range(10**6, 10**6 + 4):  # the planner pools the last 4 reports: all this one
            reply = stubs[0].ReportStep(report("synthetic-0", step, probe, np.zeros(ROWS, int), np.zeros(ROWS, int)),
                                        timeout=RPC_S)
        sps = seconds_table([(b, float(np.float32(s))) for b, s in SPS])
        assert reply.decided
        # Survivals through the online temperatures and this verifier's live offset (its own outcomes).
        offset = gauge(scrape(schedulers[0][1]), "dspark_live_confidence_offset", verifier_id="synthetic-0")
        assert offset is not None
        survival = calibrated_survival(probe, temperatures_of(reply), offset)
        assert reply.verify_budget == budget_from_survival(pooled_survival([survival], ROWS), sps)
        raw = pooled_survival([calibrated_survival(probe)], ROWS)
        assert reply.verify_budget != budget_from_survival(raw, sps)  # calibrated survivals changed the decision
        # An older report (out-of-order reply) does not replace the newer confidences.
        stale = stubs[0].ReportStep(report("synthetic-0", 5, logits[:ROWS] * 3, np.zeros(ROWS, int),
                                           np.zeros(ROWS, int)), timeout=RPC_S)
        assert stale.verify_budget == reply.verify_budget
        assert gauge(scrape(schedulers[0][1]), "dspark_scheduled_verify_budget",
                     verifier_id="synthetic-0") == reply.verify_budget
    finally:
        for channel in channels:
            channel.close()


def test_malformed_confidences_are_refused(schedulers):
    with internal_channel(internal_address(schedulers[0][0])) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        register(stub, "synthetic-bad")
        bad = report("synthetic-bad", 1, np.zeros((3, GAMMA)), [0, 0, 0], [1, 1, 1])
        bad.verified_len.append(1)  # 4 lengths for 3 rows
        with pytest.raises(grpc.RpcError) as error:
            stub.ReportStep(bad, timeout=RPC_S)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        worse = report("synthetic-bad", 2, np.zeros((2, GAMMA)), [3, 0], [1, 0])  # accepted > verified
        with pytest.raises(grpc.RpcError) as error:
            stub.ReportStep(worse, timeout=RPC_S)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_shipped_temperatures_are_the_prior_until_an_online_fit(schedulers):
    from dspark.proto_gen.v1 import tensor_pb2

    def registration(verifier_id: str, temps) -> scheduler_pb2.RegisterVerifierRequest:
        temps = np.ascontiguousarray(temps, dtype="<f4")
        return scheduler_pb2.RegisterVerifierRequest(
            address="127.0.0.1:9", model="synthetic", drafter_kind="dspark", drafter_version="shipped-prior-v1",
            gamma=GAMMA, load=load(verifier_id), sts_temperatures=tensor_pb2.Tensor(
                dtype=tensor_pb2.DTYPE_F32, shape=[temps.size], data=temps.tobytes()))

    prior = np.full(GAMMA, 4.0)  # very soft: confident raw logits count for much less
    logits = np.full((4, GAMMA), 2.0)
    with internal_channel(internal_address(schedulers[0][0])) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        stub.RegisterVerifier(registration("synthetic-prior", prior), timeout=RPC_S)
        step = report("synthetic-prior", 1, logits, [0] * 4, [0] * 4)
        step.drafter_version = "shipped-prior-v1"
        reply = stub.ReportStep(step, timeout=RPC_S)
        assert reply.decided and reply.verify_budget == verify_budget(logits, prior, seconds_table(SPS))
        assert reply.min_draft_gain == 1.0  # the scheduler's --min-draft-gain, for the verifier's free blocks
        assert reply.verify_budget != verify_budget(logits, None, seconds_table(SPS))  # the prior made a difference
        assert not reply.HasField("calibration")  # no online fit to push yet
        for bad in (np.ones(GAMMA + 1), np.zeros(GAMMA)):  # wrong length, not positive
            with pytest.raises(grpc.RpcError) as error:
                stub.RegisterVerifier(registration("synthetic-bad-prior", bad), timeout=RPC_S)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_checked_outcomes_move_the_verifiers_offset_and_bad_ones_are_refused(schedulers):
    """A report whose drafts were not verified but checked afterwards (probe_check.py) teaches the
    scheduler like verified ones: drafts that do better than promised raise that verifier's live
    offset. A malformed checked tensor is INVALID_ARGUMENT, and the scheduler keeps serving."""
    from test_calibration import shifted_traffic

    from dspark.wire import tensor_to_proto

    address, port = schedulers[0]
    channel = internal_channel(internal_address(address))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    try:
        register(stub, "checked-0")
        z, accepted, verified = shifted_traffic(seed=7, shift=2.0, num=160)
        for step, rows in enumerate(np.array_split(np.arange(len(z)), 20)):
            msg = report("checked-0", step, z[rows], [0] * len(rows), [0] * len(rows))  # a probe: none verified
            msg.checked_confidence_logits.CopyFrom(tensor_to_proto(torch.tensor(z[rows], dtype=torch.float32)))
            msg.checked_verified_len.extend(int(v) for v in verified[rows])
            msg.checked_accepted_len.extend(int(a) for a in accepted[rows])
            stub.ReportStep(msg, timeout=RPC_S)
        offset = gauge(scrape(port), "dspark_live_confidence_offset", verifier_id="checked-0")
        assert offset is not None and offset > 1.2, offset
        bad = report("checked-0", 99, z[:2], [0, 0], [0, 0])
        bad.checked_confidence_logits.CopyFrom(tensor_to_proto(torch.zeros(3, GAMMA)))  # 3 rows, 1 length
        bad.checked_verified_len.append(2)
        bad.checked_accepted_len.append(1)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ReportStep(bad, timeout=RPC_S)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.ReportStep(report("checked-0", 100, z[:2], [0, 0], [1, 1]), timeout=RPC_S).decided
    finally:
        channel.close()


def test_steps_reported_in_one_call_teach_what_step_by_step_reports_do(schedulers):
    """The verifier sends every step since its last flush in one ReportSteps call. The same traffic,
    step by step to one verifier id and in calls of five steps to another (checked outcomes
    included), leaves both with the same live offset, and both get a budget (a call's newest
    reports are calibrated at the offset after the whole call, so the budgets may differ a little);
    a call mixing two verifiers, or of no steps, is INVALID_ARGUMENT and the scheduler keeps serving."""
    from test_calibration import shifted_traffic

    from dspark.wire import tensor_to_proto

    address, port = schedulers[0]
    channel = internal_channel(internal_address(address))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    z, accepted, verified = shifted_traffic(seed=11, shift=-1.0, num=240)

    def steps(verifier_id: str) -> list[scheduler_pb2.StepReport]:
        out = []
        for step, rows in enumerate(np.array_split(np.arange(len(z)), 20)):
            msg = report(verifier_id, step, z[rows], accepted[rows], verified[rows])
            if step % 3 == 0:  # some steps also carry earlier drafts checked since
                msg.checked_confidence_logits.CopyFrom(tensor_to_proto(torch.tensor(z[rows][:2], dtype=torch.float32)))
                msg.checked_verified_len.extend(int(v) for v in verified[rows][:2])
                msg.checked_accepted_len.extend(int(a) for a in accepted[rows][:2])
            out.append(msg)
        return out

    try:
        register(stub, "one-by-one")
        register(stub, "batched")
        singles = [stub.ReportStep(msg, timeout=RPC_S) for msg in steps("one-by-one")]
        batched = steps("batched")
        calls = [stub.ReportSteps(scheduler_pb2.StepReports(steps=batched[i:i + 5]), timeout=RPC_S)
                 for i in range(0, len(batched), 5)]
        metrics = scrape(port)
        one, many = (gauge(metrics, "dspark_live_confidence_offset", verifier_id=v) for v in ("one-by-one", "batched"))
        assert one is not None and one < -0.3 and one == pytest.approx(many, abs=1e-9)
        assert singles[-1].decided and calls[-1].decided
        for bad in (scheduler_pb2.StepReports(steps=[batched[0], steps("one-by-one")[1]]), scheduler_pb2.StepReports()):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ReportSteps(bad, timeout=RPC_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stub.ReportSteps(scheduler_pb2.StepReports(steps=batched[:1]), timeout=RPC_S).decided
    finally:
        channel.close()


def test_a_report_that_lands_during_a_flush_is_in_the_next_refit(redis_server):
    """A report that arrives while the calibrator's tick waits on Redis goes out with the next
    flush, and that tick refits on it: the fit ends up on every report, with no later traffic."""
    import redis.asyncio as aioredis

    logits, accepted, verified = overconfident_traffic(seed=5, num=2000)
    first, second = np.array_split(np.arange(len(logits)), 2)
    version = "flush-race-v1"

    async def run():
        client = aioredis.Redis(port=redis_server.port, decode_responses=True)
        calibrator = OnlineCalibrator(RedisCalibrationStore(client), refit_reports=1, refit_s=0.0, min_samples=100)
        calibrator.add(version, logits[first], accepted[first], verified[first])
        tick = asyncio.create_task(calibrator.tick())
        await asyncio.sleep(0)  # the tick is now inside its flush, waiting on Redis
        calibrator.add(version, logits[second], accepted[second], verified[second])
        await tick
        await calibrator.tick()
        await client.aclose()
        return calibrator.fits[version]

    fit = asyncio.run(run())
    expected = OnlineCalibrationStats(GAMMA)
    expected.add(logits, accepted, verified)
    np.testing.assert_array_equal(fit.samples, expected.num_samples)


def test_a_scheduler_started_on_a_taken_port_exits_and_the_first_keeps_serving(schedulers, tmp_path):
    """gRPC servers default to SO_REUSEPORT, under which a second process binds a taken port and
    the kernel quietly splits connections between the two. Ours refuse: the newcomer exits saying
    why, and every call keeps reaching the scheduler that had the port."""
    address, port = schedulers[0]
    taken = int(internal_address(address).rsplit(":", 1)[1])
    newcomer, _ = start_scheduler(tmp_path, [], internal_port=taken, metrics_port=free_port())
    try:
        assert newcomer.proc.wait(120) != 0
        assert f"cannot bind 127.0.0.1:{taken}" in newcomer.log()
    finally:
        newcomer.kill()
    channel = internal_channel(internal_address(address))
    try:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        register(stub, "after-newcomer")
        logits, accepted, verified = overconfident_traffic(seed=5, num=ROWS)
        stub.ReportStep(report("after-newcomer", 0, logits, accepted, verified), timeout=RPC_S)
        # The first scheduler took the call: its metrics hold the offset it learned.
        assert gauge(scrape(port), "dspark_live_confidence_offset", verifier_id="after-newcomer") is not None
    finally:
        channel.close()


def test_the_verifiers_step_reports_go_once_they_hold_a_budgets_blocks_or_a_probe(schedulers):
    """The verifier's reporter, against a real scheduler: its first reports go at once, then reports
    wait until they hold as many drafted blocks as a budget pools (fewer move the budget little, and
    each call costs the target's cores ~1.5 ms of the scheduler's CPU), but a probe's confidences,
    the way back to drafting while the budget is 0, go at the next look. Every report arrives, in calls
    the scheduler takes."""
    from dspark.serving.token_metadata import aio_interceptors
    from dspark.speculative.engine import StepReport
    from dspark.sched.verify_budget import POOLED_BLOCKS
    from verifier_svc.reporter import SchedulerReporter, flush_due

    assert flush_due(POOLED_BLOCKS, False, 0.0) and flush_due(0, True, 0.0) and flush_due(1, False, 10.0)
    assert not flush_due(POOLED_BLOCKS - 1, False, 0.0)
    address, port = schedulers[0]
    rng = np.random.default_rng(5)
    look_s = 0.02

    def drafted(blocks: int, verified: int) -> StepReport:
        return StepReport(batch_size=blocks, batch_tokens=blocks * (1 + verified), seconds=0.01,
                          req_ids=[f"r{i}" for i in range(blocks)], verified=[verified] * blocks,
                          accepted=[int(rng.integers(0, verified + 1)) for _ in range(blocks)],
                          conf_logits=torch.tensor(rng.normal(size=(blocks, GAMMA)), dtype=torch.float32))

    class Recording(SchedulerReporter):
        async def _flush(self, batch):
            await super()._flush(batch)  # raises unless the scheduler took the call
            sent.append(len(batch))

    async def main():
        reporter = Recording(internal_address(address), scheduler_pb2.RegisterVerifierRequest(
            address="127.0.0.1:9", model="synthetic", drafter_kind="dspark", drafter_version=VERSION, gamma=GAMMA,
            load=load("reporter")), lambda: load("reporter"), decisions.append, interval_s=0.5,
            step_interval_s=look_s, flush_max_s=600)  # only blocks and probes flush here
        reporter.channels = [grpc.aio.insecure_channel(internal_address(address),
                                                       interceptors=aio_interceptors([TOKEN]))]
        reporter.start()

        async def until(count: int) -> None:
            deadline = time.monotonic() + RPC_S
            while len(sent) < count:
                assert time.monotonic() < deadline, f"{count} flushes expected, saw {sent}"
                await asyncio.sleep(look_s)

        try:
            reporter.on_step(drafted(1, 3))
            await until(1)  # the first goes at once
            for _ in range(5):
                reporter.on_step(drafted(3, 3))  # 15 blocks
            await asyncio.sleep(20 * look_s)
            assert sent == [1], "15 blocks went before they made a budget's 16"
            reporter.on_step(drafted(1, 3))
            await until(2)
            assert sent == [1, 6]
            reporter.on_step(drafted(2, 0))  # a probe: drafted, none verified
            await until(3)
            assert sent == [1, 6, 1]
        finally:
            await reporter.close()

    sent, decisions = [], []
    asyncio.run(main())
    assert any(d.decided for d in decisions)
    assert gauge(scrape(port), "dspark_scheduled_verify_budget", verifier_id="reporter") is not None


def test_the_budget_prices_the_drafters_rows_at_their_whole_batch(schedulers):
    """A report's rows are the drafter's: prompt lookup's rows are not in it. The same sure row asks
    for a draft when it is the whole step, and for none when it is one row of a 16-request step,
    where its tokens would not pay for a draft (5 ms) on a 13 ms pass. Before, the row alone was
    taken for the batch, and one row left to the drafter at 16 requests bought a draft of every row."""
    address, _ = schedulers[0]
    channel = internal_channel(internal_address(address))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    sure = np.full((1, GAMMA), 4.0)  # survives every position with p ~ 0.98 each

    def budget(verifier_id: str, batch_size: int) -> int:
        register(stub, verifier_id, [(1, 0.005), (16, 0.02)])
        msg = report(verifier_id, 1, sure, [0], [0])  # a probe's confidences: nothing verified
        msg.batch_size = batch_size
        reply = stub.ReportSteps(scheduler_pb2.StepReports(steps=[msg]), timeout=RPC_S)
        assert reply.decided
        return reply.verify_budget

    try:
        assert budget("one-request", 1) == GAMMA
        assert budget("sixteen-requests", 16) == 0
    finally:
        channel.close()


def test_a_probes_sample_is_priced_as_the_rows_it_stands_for(schedulers):
    """A probe at 16 requests drafts four (the verifier's PROBE_SAMPLE) and its report says they stand
    for 16: the draft is priced at 16 rows (50 ms here), not at four (2 ms)."""
    address, _ = schedulers[0]
    channel = internal_channel(internal_address(address))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    sure = np.full((4, GAMMA), 4.0)

    def budget(verifier_id: str, sample_of: int) -> int:
        register(stub, verifier_id, [(1, 0.001), (4, 0.002), (16, 0.05)])
        msg = report(verifier_id, 1, sure, [0] * 4, [0] * 4)
        msg.batch_size, msg.sample_of = 16, sample_of
        reply = stub.ReportSteps(scheduler_pb2.StepReports(steps=[msg]), timeout=RPC_S)
        assert reply.decided
        return reply.verify_budget

    try:
        assert budget("four-rows", 0) > 0  # (the temperatures earlier tests fitted apply: not all 28)
        assert budget("four-of-sixteen", 16) == 0
    finally:
        channel.close()


def test_slow_steps_of_a_resuming_drafter_do_not_make_drafting_look_dear(schedulers):
    """Drafted steps that took far longer than the verifier's tables say teach the scheduler that
    drafting costs more than the tables hold, unless the verifier marks them as the drafter resuming
    (catching up on the positions it skipped, its weights out of the caches): the draft-cost table
    leaves those out, and so does the scheduler. At one request nearly every drafted step after a run
    of budget-0 steps is such a step, and counting them kept the budget at 0."""
    address, _ = schedulers[0]
    channel = internal_channel(internal_address(address))
    stub = scheduler_pb2_grpc.SchedulerStub(channel)
    sure = np.full((1, GAMMA), 4.0)

    def budget_after_slow_steps(verifier_id: str, resumed: bool) -> int:
        register(stub, verifier_id, [(1, 0.02)])
        steps = []
        for step in range(1, 21):  # 200 ms where the tables say ~31 (an 11 ms pass and a 20 ms draft)
            msg = report(verifier_id, step, sure, [GAMMA], [GAMMA])
            msg.step_latency_s, msg.draft_resumed = 0.2, resumed
            steps.append(msg)
        reply = stub.ReportSteps(scheduler_pb2.StepReports(steps=steps), timeout=RPC_S)
        assert reply.decided
        return reply.verify_budget

    try:
        assert budget_after_slow_steps("drafter-resuming", resumed=True) > 0
        assert budget_after_slow_steps("drafting-slowly", resumed=False) == 0
    finally:
        channel.close()
