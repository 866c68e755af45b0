"""python -m drafter_svc --port=50053 --health-port=50060 --metrics-port=9400 --kind=dspark --checkpoint=DIR
       [--device=cpu|cuda|cuda:N]

Without --checkpoint (or with an empty one) a randomly initialised drafter of --kind is served,
so the pipeline runs before any drafter is trained (tests, local mode).
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch

from drafter_svc.service import DrafterService
from dspark.device import add_device_flag, describe, device_or_exit
from dspark.drafters import DrafterConfig, build_drafter
from dspark.drafters.checkpoint import load_calibration, load_config, load_drafter
from dspark.drafters.lookup import LookupDrafter
from dspark.models.config import spread_layers
from dspark.models.loader import DEFAULT_MODEL, load_model
from dspark.models.precision import add_precision_flag, apply_precision
from dspark.models.threads import configure_threads, share_gil_with_torch_thread
from dspark.proto_gen.v1 import drafter_pb2_grpc
from dspark.serving import metrics
from dspark.serving.config import common_parser, env
from dspark.serving.server import GrpcApp, setup_logging

log = logging.getLogger("drafter_svc")


def parse_args(argv=None):
    ap = common_parser(__doc__, port=50053)
    ap.add_argument("--kind", env="DSPARK_DRAFTER_KIND", default="dspark", choices=["dspark", "dflash", "eagle3"])
    ap.add_argument("--checkpoint", env="DSPARK_DRAFTER_CHECKPOINT", default="",
                    help="drafter checkpoint directory; empty = a random drafter of --kind")
    ap.add_argument("--target-model", env="DSPARK_TARGET_MODEL", default="",
                    help="target whose embedding and LM head the drafter shares "
                         "(default: the checkpoint's target, else DSPARK_MODEL, else smollm2-135m)")
    ap.add_argument("--gamma", type=int, default=7, help="block size of a random drafter")
    ap.add_argument("--num-layers", type=int, default=2, help="decoder layers of a random drafter")
    ap.add_argument("--seed", type=int, default=0, help="initialisation seed of a random drafter")
    ap.add_argument("--max-batch", type=int, env="DSPARK_MAX_BATCH", default=16,
                    help="sequences in one draft call (the verifiers' running batch)")
    ap.add_argument("--max-len", type=int, env="DSPARK_MAX_LEN", default=2048,
                    help="context positions of one sequence (the verifiers' --max-len)")
    ap.add_argument("--max-contexts-per-stream", type=int, env="DSPARK_MAX_CONTEXTS_PER_STREAM", default=0,
                    help="contexts one verifier stream may hold; least recently used evicted past it (0 = 2 x --max-batch)")
    ap.add_argument("--lookup", env="DSPARK_DRAFTER_LOOKUP", default="off", choices=["on", "off"],
                    help="on: prompt lookup here, before the drafter (for verifiers that do not look up "
                         "themselves; a verifier does by default, with no round trip: its --lookup)")
    add_precision_flag(ap)
    add_device_flag(ap)
    ap.set_defaults(max_message_mb=0.0)  # 0 = derived from the limits above (see message_mb)
    args = ap.parse_args(argv)
    args.max_contexts_per_stream = max(args.max_contexts_per_stream or 2 * args.max_batch, args.max_batch)
    return args


def message_mb(max_batch: int, max_len: int, width: int, itemsize: int = 2) -> float:
    """The largest DraftRequest a verifier within the limits sends: every sequence of a full batch
    with its whole context in one call (all prefilled in the same step), bf16 rows as verifiers
    send them, plus 1 MiB for tokens and framing."""
    return (max_batch * max_len * width * itemsize) / (1 << 20) + 1


def load(args):
    """The drafter plus the name of its target; only the target's embedding and LM head are kept."""
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    if checkpoint is not None and not (checkpoint / "config.json").exists():
        log.warning("no drafter checkpoint at %s: serving a random %s drafter", checkpoint, args.kind)
        checkpoint = None
    cfg = load_config(checkpoint) if checkpoint else None
    target_name = args.target_model or (cfg.target if cfg and cfg.target else "") or env("DSPARK_MODEL", DEFAULT_MODEL)
    loaded = load_model(target_name)  # on the host: only its embedding and LM head go to the device
    embed = loaded.model.model.embed_tokens.weight.detach().clone()
    lm_head = loaded.model.output_weight.detach().clone()
    target_cfg, name = loaded.model.config, loaded.name
    del loaded  # the rest of the target is not needed here
    if checkpoint:
        drafter = load_drafter(checkpoint, embed, lm_head).to(args.device)
    else:
        torch.manual_seed(args.seed)
        cfg = DrafterConfig.for_target(target_cfg, args.kind, ctx_layers=spread_layers(target_cfg.num_layers, 5),
                                       gamma=args.gamma, num_layers=args.num_layers, target=name,
                                       version=f"random-{args.kind}-{args.seed}")
        drafter = build_drafter(cfg, embed, lm_head).to(args.device).eval()
    log.info("drafter matmuls on %s kernels", apply_precision(drafter, args.precision))
    drafter.warm_up()  # before SERVING: the first request does not build the drafter's caches
    return (LookupDrafter(drafter) if args.lookup == "on" else drafter), name


async def serve(args) -> None:
    service = DrafterService(args.max_batch, args.max_len, args.max_contexts_per_stream)
    # Loaded before the port opens: the message limit derives from the drafter's row width.
    # On the thread that drafts: a second thread running torch would bring a second OpenMP team,
    # and libgomp throttles every worker's spin once threads outnumber cores.
    service.drafter, service.target_model = await asyncio.get_running_loop().run_in_executor(
        service.executor, load, args)
    if not args.max_message_mb:
        args.max_message_mb = message_mb(args.max_batch, args.max_len, service.width)
    log.info("drafter accepts messages up to %.1f MiB (%d sequences x %d positions), %d contexts per stream",
             args.max_message_mb, args.max_batch, args.max_len, args.max_contexts_per_stream)
    app = GrpcApp("drafter", args, [(drafter_pb2_grpc.add_DrafterServicer_to_server, service, "dspark.v1.Drafter")])
    await app.start()
    if args.checkpoint and service.drafter.has_confidence:
        service.sts_temperatures = load_calibration(args.checkpoint, service.drafter.version)
    metrics.report_device("drafter", describe(args.device))
    log.info("drafter %s%s (version %s, gamma %d, layers %s) for %s on %s; shipped STS temperatures: %s",
             service.drafter.kind, " + prompt lookup" if args.lookup == "on" else "", service.drafter.version,
             service.drafter.gamma, service.drafter.ctx_layers,
             service.target_model, describe(args.device), service.sts_temperatures)
    await app.set_serving()
    await app.wait_for_termination()
    service.executor.shutdown(wait=False)


def main(argv=None):
    args = parse_args(argv)
    setup_logging(args.log_level)
    args.device = device_or_exit(args.device, "drafter")  # refused before binding ports or loading weights
    torch.set_grad_enabled(False)
    configure_threads()
    share_gil_with_torch_thread()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
