"""python -m gateway_svc --port=8000 --scheduler-addr=HOST:50051 [--api-key=KEY ...]

OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health) in front
of the scheduler's Generation service. Keys: --api-key (repeatable) and DSPARK_API_KEYS
(comma-separated); none = no authentication. TLS to the scheduler: the DSPARK_TLS_* environment,
as for the other services (docs/deploy.md).
"""
from __future__ import annotations

import argparse
import logging

import uvicorn
from dspark_client import AsyncClient, TlsConfig

from dspark.serving import tracing
from dspark.serving.config import FlagParser, env, mutual_tls

from .app import Gateway, Limits, create_app
from .auth import configured_keys

log = logging.getLogger("gateway_svc")


def parse_args(argv=None):
    ap = FlagParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", env="DSPARK_HOST", default="0.0.0.0", help="address to bind")
    ap.add_argument("--port", type=int, env="DSPARK_PORT", default=8000)
    ap.add_argument("--scheduler-addr", env="DSPARK_SCHEDULER_ADDR", default="127.0.0.1:50051")
    ap.add_argument("--api-key", action="append", default=[], help="accepted bearer key (repeatable)")
    ap.add_argument("--max-request-bytes", type=int, env="DSPARK_MAX_REQUEST_BYTES", default=1 << 20)
    ap.add_argument("--max-concurrent", type=int, env="DSPARK_MAX_CONCURRENT", default=256,
                    help="upstream generations in flight (a request with n = 4 takes 4); more get 429")
    ap.add_argument("--max-n", type=int, env="DSPARK_MAX_N", default=16, help="choices per request")
    ap.add_argument("--upstream-timeout-s", type=float, env="DSPARK_UPSTREAM_TIMEOUT_S", default=600)
    ap.add_argument("--log-level", env="DSPARK_LOG_LEVEL", default="INFO")
    return ap.parse_args(argv)


def tls_from_env() -> TlsConfig | None:
    """The same DSPARK_TLS_* settings the services use to call their peers (dspark.serving.config)."""
    ca, cert, key = env("DSPARK_TLS_CA"), env("DSPARK_TLS_CERT"), env("DSPARK_TLS_KEY")
    if not ca and not cert:
        return None
    mutual = mutual_tls()
    return TlsConfig.from_files(ca, cert if mutual else None, key if mutual else None,
                                env("DSPARK_TLS_SERVER_NAME"))


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tracing.setup("gateway")
    keys = configured_keys(args.api_key)
    tls = tls_from_env()
    limits = Limits(args.max_request_bytes, args.max_concurrent, args.max_n)
    app = create_app(Gateway(lambda: AsyncClient(args.scheduler_addr, tls=tls, timeout=args.upstream_timeout_s),
                             keys, limits))
    log.info("gateway on http://%s:%d -> scheduler %s (%s)", args.host, args.port, args.scheduler_addr,
             f"{len(keys)} API key(s)" if keys else "no API key: open")
    # uvicorn handles SIGTERM: stops accepting, lets open requests finish (--timeout-graceful-shutdown).
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()
