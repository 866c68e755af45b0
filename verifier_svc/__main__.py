"""python -m verifier_svc --port=50052 --health-port=50060 --metrics-port=9400 --model=smollm2-135m
       --drafter-addr=HOST:50053 --scheduler-addr=HOST:50051 [--verifier-id=...]
       [--max-batch=16] [--max-len=2048] [--draft-len=N] [--schedule=on|off] [--device=cpu|cuda|cuda:N]

--drafter-addr empty = plain decoding, unless --drafter names a drafter to run inside the verifier;
--scheduler-addr empty = no reports (direct use only).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import socket

from dspark.device import add_device_flag, describe, device_or_exit
from dspark.drafters.ahead import DraftAheadThread
from dspark.drafters.lookup import LookupDrafter
from dspark.drafters.shipped import load_datastore_for, load_drafter_for
from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.models.precision import add_precision_flag
from dspark.models.threads import SMALL_HOST_CORES, available_cores, configure_threads, share_gil_with_torch_thread
from dspark.proto_gen.v1 import generation_pb2_grpc, scheduler_pb2, verifier_pb2_grpc
from dspark.sched.verify_budget import POOLED_BLOCKS
from dspark.serving import metrics, tracing
from dspark.serving.config import common_parser, env
from dspark.serving.drafter_info import drafter_info
from dspark.serving.server import GrpcApp, setup_logging
from dspark.speculative.engine import SpecEngine
from verifier_svc.budget_control import BudgetControl
from verifier_svc.remote_drafter import RemoteDrafter, ahead_pays
from verifier_svc.reporter import FLUSH_MAX_S, SchedulerReporter, make_load
from verifier_svc.runner import EngineRunner
from verifier_svc.service import CoreSlot, GenerationService, VerifierCore, VerifierService
from verifier_svc.step_spans import StepSpans

log = logging.getLogger("verifier_svc")


def parse_args(argv=None):
    ap = common_parser(__doc__, port=50052)
    ap.add_argument("--model", env="DSPARK_MODEL", default=DEFAULT_MODEL)
    ap.add_argument("--drafter-addr", env="DSPARK_DRAFTER_ADDR", default="", help="the drafter service")
    ap.add_argument("--drafter", env="DSPARK_DRAFTER", default="",
                    help="instead of a drafter service: run this drafter inside the verifier, on its torch thread "
                         "(a checkpoint directory, or a shipped kind: dspark, dflash, eagle3). For a host whose few "
                         "cores a drafter service would share: there each draft waits on a round trip and on a "
                         "drafter on one thread, and the target's pass after it on waking threads (2 cores: a "
                         "drafted step 44 ms through the service against 34 ms inside, docs/results.md)")
    ap.add_argument("--scheduler-addr", env="DSPARK_SCHEDULER_ADDR", default="")
    ap.add_argument("--verifier-id", default=env("DSPARK_VERIFIER_ID", env("POD_NAME", "")),
                    help="default: $POD_NAME, else host-port")
    ap.add_argument("--advertise-addr", env="DSPARK_ADVERTISE_ADDR", default="",
                    help="host:port the scheduler dials (default: $POD_IP or 127.0.0.1, with --port)")
    add_precision_flag(ap)
    add_device_flag(ap)
    ap.add_argument("--max-batch", type=int, env="DSPARK_MAX_BATCH", default=16)
    ap.add_argument("--max-len", type=int, env="DSPARK_MAX_LEN", default=2048)
    ap.add_argument("--lookup", env="DSPARK_LOOKUP", default="on", choices=["on", "off"],
                    help="on: prompt lookup first, here where the tokens are (a request whose text repeats drafts "
                         "what followed before, no round trip; dspark/drafters/lookup.py), the drafter service "
                         "for the rest")
    ap.add_argument("--prefix-reuse", env="DSPARK_PREFIX_REUSE", default="on", choices=["on", "off"],
                    help="on: a request whose prompt starts with what a finished request's KV slot still holds (a "
                         "shared system prompt, a conversation's earlier turns) computes only the rest; the same "
                         "output (dspark/models/kv_cache.py)")
    ap.add_argument("--datastore", env="DSPARK_DATASTORE", default="auto",
                    help="with --lookup on, where a request's text did not repeat itself: the continuation of its "
                         "suffix in the target's own answers to other prompts (dspark/drafters/datastore.py). auto: "
                         "drafters/<model>/datastore.npz when shipped; off; or a datastore file")
    ap.add_argument("--draft-ahead", env="DSPARK_DRAFT_AHEAD", default="auto", choices=["auto", "on", "off"],
                    help="on: while the target verifies a block, the drafter service drafts the next one on the "
                         "guess that the block is accepted (dspark/speculative/engine.py _draft_ahead); a step "
                         "whose guess held waits for no draft. auto: on unless the drafter is on this machine "
                         f"and it has fewer than {SMALL_HOST_CORES} cores (there it slows the target's pass)")
    ap.add_argument("--draft-len", type=int, env="DSPARK_DRAFT_LEN", default=-1,
                    help="draft tokens a request verifies per step when not scheduled, and per request while the "
                         "scheduler is silent (default: the drafter's block size)")
    ap.add_argument("--schedule", choices=["on", "off"], env="DSPARK_SCHEDULE", default="on",
                    help="on: spend the scheduler's verify budget (two-step rule; --draft-len is the fallback); "
                         "off: always --draft-len per request")
    ap.add_argument("--explore", type=float, env="DSPARK_EXPLORE", default=0.05,
                    help="share of requests that verify their whole block anyway (labels for low-confidence tails)")
    ap.add_argument("--draft-probe-every", type=int, env="DSPARK_DRAFT_PROBE_EVERY", default=16,
                    help="while the scheduler's budget is 0 the drafter is skipped but for probes in the background, "
                         "whose confidences tell when drafting pays again: the first on the first skipped step, then "
                         "gaps doubling up to 4 x N steps (1 = draft every step)")
    ap.add_argument("--context-push-every", type=int, env="DSPARK_CONTEXT_PUSH_EVERY", default=0,
                    help="while no draft is asked for, push the drafter its new context every N-th step; 0 = "
                         "never (the background probes carry it, and the first draft after them the rest). "
                         "Each push costs the verifier's threads: every 8th step cost 13%% of plain decoding's "
                         "tokens/s at c = 16 on a 2-core host (docs/results.md)")
    ap.add_argument("--budget-ttl-steps", type=int, env="DSPARK_BUDGET_TTL_STEPS", default=100,
                    help="the scheduler's last budget stays in force this many steps without a fresh one ...")
    ap.add_argument("--budget-ttl-s", type=float, env="DSPARK_BUDGET_TTL_S", default=5,
                    help="... and this many seconds (both must pass), then --draft-len per request applies")
    ap.add_argument("--sps-warmup-s", type=float, env="DSPARK_SPS_WARMUP_S", default=10,
                    help="time budget of the SPS warm-up profile before serving (0 = none: live steps only)")
    ap.add_argument("--report-interval-s", type=float, env="DSPARK_REPORT_INTERVAL_S", default=0.5,
                    help="how often the load goes to the scheduler")
    ap.add_argument("--step-report-interval-s", type=float, env="DSPARK_STEP_REPORT_INTERVAL_S", default=0.05,
                    help="how often the pending step reports (confidences, outcomes) are looked at; they go to "
                         "the scheduler in one call once they hold --step-report-blocks drafted blocks, a probe's "
                         "confidences, or are --step-report-max-s old (docs/results.md, session 37)")
    ap.add_argument("--step-report-blocks", type=int, env="DSPARK_STEP_REPORT_BLOCKS", default=POOLED_BLOCKS,
                    help="drafted blocks that make the pending step reports worth a call (the scheduler pools "
                         f"{POOLED_BLOCKS} for a budget; 1 = every look)")
    ap.add_argument("--step-report-max-s", type=float, env="DSPARK_STEP_REPORT_MAX_S", default=FLUSH_MAX_S,
                    help="longest the step reports wait for a call")
    ap.add_argument("--default-max-tokens", type=int, env="DSPARK_DEFAULT_MAX_TOKENS", default=256)
    ap.add_argument("--max-tokens-cap", type=int, env="DSPARK_MAX_TOKENS_CAP", default=0,
                    help="largest max_tokens a request may ask for (0 = --max-len); above it: INVALID_ARGUMENT")
    ap.add_argument("--drafter-timeout-s", type=float, env="DSPARK_DRAFTER_TIMEOUT_S", default=2.0,
                    help="deadline of one draft round trip; past it the step runs as plain decoding")
    ap.add_argument("--drafter-wait-s", type=float, env="DSPARK_DRAFTER_WAIT_S", default=120,
                    help="at startup, how long to wait for the drafter before serving without one")
    args = ap.parse_args(argv)
    if args.drafter and args.drafter_addr:
        ap.error("--drafter runs a drafter inside the verifier, --drafter-addr calls a drafter service: give one")
    if args.context_push_every < 0:
        ap.error(f"--context-push-every must be >= 0, got {args.context_push_every}")
    args.verifier_id = args.verifier_id or f"{socket.gethostname()}-{args.port}"
    args.advertise_addr = args.advertise_addr or f"{env('POD_IP', '127.0.0.1')}:{args.port}"
    return args


async def serve(args) -> None:
    slot = CoreSlot()
    if args.draft_probe_every < 1:
        raise SystemExit("--draft-probe-every must be >= 1")
    if args.step_report_blocks < 1:
        raise SystemExit("--step-report-blocks must be >= 1")
    if not args.step_report_interval_s > 0:
        raise SystemExit("--step-report-interval-s must be > 0")
    control = BudgetControl(args.explore, args.budget_ttl_steps, args.budget_ttl_s, args.sps_warmup_s,
                              args.draft_probe_every)

    def load_fn():
        core = slot.core
        return control.fill_load(make_load(args.verifier_id, core.runner, args.max_batch, args.max_len,
                                           core.model_name))


    app = GrpcApp("verifier", args, [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(slot), "dspark.v1.Generation"),
        (verifier_pb2_grpc.add_VerifierServicer_to_server, VerifierService(slot, load_fn, control.apply),
         "dspark.v1.Verifier"),
    ])
    await app.start()
    # All torch work (load, SPS warm-up, every step) on one thread: see EngineRunner.start.
    torch_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="torch")

    async def on_torch(fn, *fn_args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(torch_thread, functools.partial(fn, *fn_args, **kwargs))

    loaded = await on_torch(load_model, args.model, device=args.device, precision=args.precision)
    metrics.report_device("verifier", describe(args.device))
    drafter = remote = info = None  # info: the DrafterInfo of whichever drafter runs
    ahead = False
    if args.drafter:
        drafter = await on_torch(load_drafter_for, loaded, args.drafter, loaded.model.precision)
        if drafter is None:
            raise SystemExit(f"--drafter {args.drafter!r}: no checkpoint directory and no shipped drafter of that "
                             f"kind for {loaded.name}")
        info = drafter_info(drafter, loaded.name, drafter.sts_temperatures)
        await on_torch(drafter.warm_up)  # before SERVING: the first request does not build its caches
        # Beside the target's pass only on a thread of its own, and only where it has a core to itself.
        ahead = args.draft_ahead == "on" or (args.draft_ahead == "auto" and available_cores() >= SMALL_HOST_CORES)
        if ahead and drafter.drafts_ahead:
            drafter = DraftAheadThread(drafter)
    elif args.drafter_addr:
        remote = RemoteDrafter(args.drafter_addr, timeout_s=args.drafter_timeout_s)
        if await asyncio.to_thread(remote.connect, args.drafter_wait_s):
            drafter, info = remote, remote.info
            app.on_shutdown.append(lambda: asyncio.to_thread(remote.close))
        else:
            log.error("no drafter at %s after %.0f s: serving with plain decoding", args.drafter_addr,
                      args.drafter_wait_s)
        ahead = args.draft_ahead == "on" or (args.draft_ahead == "auto" and ahead_pays(args.drafter_addr,
                                                                                       available_cores()))
    datastore = None
    if drafter is not None and args.lookup == "on":
        datastore = await asyncio.to_thread(load_datastore_for, loaded.name, args.datastore)
        drafter = LookupDrafter(drafter, datastore=datastore)
    draft_len = (args.draft_len if args.draft_len >= 0 else drafter.gamma) if drafter is not None else 0
    policy = control.make_policy(drafter, draft_len, args.schedule == "on")
    # Built on the torch thread too: its KV-cache fill is a parallel region, and a second thread's
    # OpenMP team makes libgomp throttle every worker's spin (more threads than cores).
    engine = await on_torch(SpecEngine, loaded.model, drafter, policy, max_batch=args.max_batch,
                            max_len=args.max_len, context_push_every=args.context_push_every,
                            draft_ahead=drafter is not None and ahead, reuse_prefixes=args.prefix_reuse == "on")
    await control.warmup(engine, args.max_batch, run=on_torch)
    metrics.VERIFY_BUDGET.set(policy.budget_in_force)

    reporter = None
    if args.scheduler_addr:
        register = scheduler_pb2.RegisterVerifierRequest(
            address=args.advertise_addr, model=loaded.name, drafter_kind=drafter.kind if drafter else "",
            drafter_version=drafter.version if drafter else "", gamma=drafter.gamma if drafter else 0)
        if info is not None and info.HasField("sts_temperatures"):
            register.sts_temperatures.CopyFrom(info.sts_temperatures)
        reporter = SchedulerReporter(args.scheduler_addr, register, load_fn, control.apply,
                                     interval_s=args.report_interval_s,
                                     step_interval_s=args.step_report_interval_s,
                                     flush_blocks=args.step_report_blocks, flush_max_s=args.step_report_max_s)

    def on_step(report) -> None:  # engine thread: cheap bookkeeping only
        metrics.STEP_LATENCY.labels(metrics.batch_tokens_bucket(report.batch_tokens)).observe(report.seconds)
        control.on_step(report)
        if report.verified:  # every request that had drafts, verified or not (0)
            metrics.NUM_DRAFTS.inc(sum(1 for n in report.verified if n))
            metrics.NUM_DRAFT_TOKENS.inc(sum(report.verified))
            metrics.NUM_ACCEPTED.inc(sum(report.accepted))
            for n in report.accepted:
                for pos in range(n):
                    metrics.ACCEPTED_PER_POS.labels(str(pos)).inc()
        if reporter is not None:
            reporter.on_step(report, drafter.version if drafter else "")

    runner = EngineRunner(engine, on_step)
    if tracing.enabled():  # per-step spans, and their context sent along with each draft call
        runner.step_spans = StepSpans()
        if remote is not None:
            remote.trace_context = runner.step_spans.carrier
    runner.start(torch_thread)
    slot.core = VerifierCore(runner, loaded.tokenizer, loaded.name, args.max_len, loaded.model.config.vocab_size,
                             info if drafter is not None else None, args.default_max_tokens,
                             args.max_tokens_cap)
    if reporter is not None:
        reporter.start()
        app.on_shutdown.insert(0, reporter.close)
    app.on_shutdown.append(lambda: asyncio.to_thread(runner.stop))
    drafting = (drafter.kind + (" + prompt lookup" if args.lookup == "on" else "")
                + (f" + a datastore of {datastore.tokens:,} tokens" if datastore is not None else "")
                + (" inside the verifier" if remote is None else "")
                + (", drafting ahead" if ahead and drafter.drafts_ahead else "")) if drafter else "none"
    log.info("verifier %s serving %s (%s matmuls on %s) at %s (drafter: %s, draft len %d, max batch %d, "
             "max len %d)", args.verifier_id, loaded.name, loaded.model.precision, describe(args.device),
             args.advertise_addr, drafting, draft_len, args.max_batch, args.max_len)
    await app.set_serving()
    await app.wait_for_termination()


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.log_level)
    args.device = device_or_exit(args.device, "verifier")  # refused before binding ports or loading weights
    configure_threads()
    share_gil_with_torch_thread()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
