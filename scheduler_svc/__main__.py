"""python -m scheduler_svc --port=50051 --internal-port=50054 --health-port=50060 --metrics-port=9400
       --redis-url=redis://HOST:6379/0
       [--verifiers=host:port,...] | [--discovery=kubernetes --namespace=NS --verifier-selector=LABELS] --verifier-port=50052

--port serves the public Generation service; --internal-port the verifiers' Scheduler service
(authenticated: DSPARK_INTERNAL_TOKEN or mutual TLS). Replicas may share one Redis.

Without --redis-url the state lives in this process (MemoryStore: local mode, tests).
Verifiers are used once they register and heartbeat; discovery (a static list or Kubernetes
pods) further limits routing to the addresses it reports.
"""
from __future__ import annotations

import asyncio
import logging
import threading

from dspark.proto_gen.v1 import generation_pb2_grpc, scheduler_pb2_grpc
from dspark.sched.verify_budget import POOLED_BLOCKS, POOLED_REPORTS
from dspark.serving.config import common_parser, env
from dspark.serving.server import GrpcApp, setup_logging
from scheduler_svc.budget_planner import BudgetPlanner
from scheduler_svc.calibration_store import make_calibration_store
from scheduler_svc.k8s_discovery import make_discovery
from scheduler_svc.online_calibration import OnlineCalibrator
from scheduler_svc.registry import Registry
from scheduler_svc.service import GenerationService, Router, SchedulerService
from scheduler_svc.store import make_store

log = logging.getLogger("scheduler_svc")


def parse_args(argv=None):
    ap = common_parser(__doc__, port=50051)
    ap.add_argument("--internal-port", type=int, env="DSPARK_INTERNAL_PORT", default=50054,
                    help="port of the internal Scheduler service (verifiers register and report here)")
    ap.add_argument("--redis-url", env="DSPARK_REDIS_URL", default="", help="empty = in-process store")
    ap.add_argument("--redis-max-connections", type=int, env="DSPARK_REDIS_MAX_CONNECTIONS", default=32,
                    help="one pool for all of this replica's Redis calls; when all are busy, calls wait for one")
    ap.add_argument("--verifier-address-check", choices=["on", "off"],
                    env="DSPARK_VERIFIER_ADDRESS_CHECK", default="on",
                    help="on: a verifier's advertised IP must be the IP it calls from (off behind proxies/meshes)")
    ap.add_argument("--verifiers", env="DSPARK_VERIFIERS", default="", help="static list host:port,host:port")
    ap.add_argument("--discovery", env="DSPARK_DISCOVERY", default="static", choices=["static", "kubernetes"])
    ap.add_argument("--namespace", default=env("POD_NAMESPACE", "default"))
    ap.add_argument("--verifier-selector", env="DSPARK_VERIFIER_SELECTOR", default="", help="pod label selector")
    ap.add_argument("--verifier-service", env="DSPARK_VERIFIER_SERVICE", default="",
                    help="read this Service's EndpointSlices instead of pods")
    ap.add_argument("--verifier-port", type=int, env="DSPARK_VERIFIER_PORT", default=50052)
    ap.add_argument("--heartbeat-ttl-s", type=float, default=3.0, help="a verifier silent this long is not routed to")
    ap.add_argument("--queue-timeout-s", type=float, default=60.0,
                    help="how long a request waits for a verifier with room before UNAVAILABLE")
    ap.add_argument("--calibration-refit-reports", type=int,
                    env="DSPARK_CALIBRATION_REFIT_REPORTS", default=500,
                    help="refit the STS temperatures after this many step reports ...")
    ap.add_argument("--calibration-refit-s", type=float, env="DSPARK_CALIBRATION_REFIT_S", default=30,
                    help="... or after this many seconds with new reports, whichever comes first")
    ap.add_argument("--calibration-min-samples", type=int, env="DSPARK_CALIBRATION_MIN_SAMPLES", default=200,
                    help="decided outcomes at block position 1 needed before the first fit; a later "
                         "position with fewer keeps the drafter's shipped temperature")
    ap.add_argument("--min-draft-gain", type=float, env="DSPARK_MIN_DRAFT_GAIN", default=1.3,
                    help="from two requests on, a verify budget > 0 must promise this many times plain "
                         "decoding's tokens/s: the per-step model misses what drafting costs in a short batch "
                         "(its requests finish at different steps); on a 2-core host promised 1.2-1.3x gave "
                         "0.6-0.8x at 2-4 requests (docs/results.md). One request drafts on any gain.")
    ap.add_argument("--pooled-reports", type=int, env="DSPARK_POOLED_REPORTS", default=POOLED_REPORTS,
                    help="a verifier's budget comes from the mean survival of its newest this many step reports")
    ap.add_argument("--pooled-blocks", type=int, env="DSPARK_POOLED_BLOCKS", default=POOLED_BLOCKS,
                    help="... and from more reports while those hold fewer than this many draft blocks (one request's "
                         "report is one block)")
    args = ap.parse_args(argv)
    if args.pooled_reports < 1:
        raise SystemExit("--pooled-reports must be >= 1")
    if args.pooled_blocks < 0:
        raise SystemExit("--pooled-blocks must be >= 0")
    if args.min_draft_gain < 1:
        raise SystemExit("--min-draft-gain must be >= 1")
    return args


def start_discovery(args, registry: Registry, stop: threading.Event) -> None:
    addresses = [a.strip() for a in args.verifiers.split(",") if a.strip()]
    if args.discovery == "static" and not addresses:
        return  # route to whichever verifiers register
    discovery = make_discovery(args.discovery, addresses=addresses, namespace=args.namespace,
                               label_selector=args.verifier_selector or None,
                               service=args.verifier_service or None, port=args.verifier_port)
    loop = asyncio.get_running_loop()

    def on_change(found: list[str]) -> None:
        loop.call_soon_threadsafe(setattr, registry, "discovered", list(found))
        log.info("discovered verifiers: %s", found)

    threading.Thread(target=discovery.watch, args=(on_change, stop), daemon=True, name="discovery").start()


async def refresh_loop(registry: Registry, interval_s: float = 0.5) -> None:
    while True:
        await registry.refresh()
        await asyncio.sleep(interval_s)


async def serve(args) -> None:
    store = make_store(args.redis_url, args.redis_max_connections)
    registry = Registry(store, ttl_s=args.heartbeat_ttl_s)
    router = Router(registry, args.max_message_mb, args.queue_timeout_s)
    calibrator = OnlineCalibrator(make_calibration_store(store), args.calibration_refit_reports,
                                  args.calibration_refit_s, args.calibration_min_samples)
    planner = BudgetPlanner(args.min_draft_gain, args.pooled_reports, args.pooled_blocks)
    scheduler = SchedulerService(registry, planner, calibrator,
                                 address_check=args.verifier_address_check == "on")
    app = GrpcApp("scheduler", args, [
        (generation_pb2_grpc.add_GenerationServicer_to_server, GenerationService(router), "dspark.v1.Generation"),
    ], internal=False, internal_services=[
        (scheduler_pb2_grpc.add_SchedulerServicer_to_server, scheduler, "dspark.v1.Scheduler"),
    ], internal_port=args.internal_port)
    await app.start()
    stop = threading.Event()
    start_discovery(args, registry, stop)
    refresher = asyncio.get_running_loop().create_task(refresh_loop(registry))
    calibrating = asyncio.get_running_loop().create_task(calibrator.run())

    async def close() -> None:
        stop.set()
        refresher.cancel()
        calibrating.cancel()
        await router.close()
        try:
            await calibrator.flush()  # the last reports' counts
        except Exception as error:
            log.warning("calibration counts not flushed: %s", error)
        await store.close()

    app.on_shutdown.append(close)
    log.info("scheduler using %s", f"Redis at {args.redis_url}" if args.redis_url else "the in-process store")
    await app.set_serving()  # nothing to load; requests wait in the queue until a verifier registers
    await app.wait_for_termination()


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.log_level)
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
