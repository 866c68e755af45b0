"""One grpc.aio server with health, size limits, TLS, the call guard (dspark/serving/guard.py)
and graceful SIGTERM shutdown; reflection only with --reflection.

    app = GrpcApp("drafter", args, [(add_DrafterServicer_to_server, servicer, "dspark.v1.Drafter")])
    await app.start()          # health says NOT_SERVING until ...
    ... load the model ...
    await app.set_serving()    # ... the model is loaded
    await app.wait_for_termination()   # SIGTERM/SIGINT: stop accepting, drain, exit

The health service runs on the main port and, plaintext, alone on --health-port (the kubelet's
native gRPC probe cannot speak TLS). `internal=True`: the main port's services are internal
(callers authenticate). `internal_services` + `internal_port`: a second port for internal
services next to a public main port (the scheduler: Generation public, Scheduler internal).
"""
from __future__ import annotations

import asyncio
import logging
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from dspark.serving import config, otlp_metrics, tracing
from dspark.serving.guard import ServerGuard
from dspark.serving.metrics import start_metrics_server

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, str(level).upper(), logging.INFO),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")


class GrpcApp:
    def __init__(self, name: str, args, services: list[tuple], internal: bool = True,
                 internal_services: list[tuple] = (), internal_port: int = 0):
        """services: (add_XServicer_to_server, servicer, full service name) triples."""
        self.name, self.args, self.services, self.internal = name, args, services, internal
        self.internal_services, self.internal_port = list(internal_services), internal_port
        config.apply_tls(args)
        config.apply_auth(args)
        self.health = [HealthServicer()]
        self.server: grpc.aio.Server | None = None
        self.internal_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self.stopping = asyncio.Event()
        self.on_shutdown = []  # async callables run after the drain (close channels, stores)

    async def start(self) -> None:
        # Exporters from the environment (docs/deploy.md): OTLP traces and metrics, test span files.
        tracing.setup(self.name)
        self.meter_provider = otlp_metrics.setup(tracing.service_name(self.name))
        self.server = self._server(self.services, self.internal, self.args.port)
        if self.internal_services:
            self.internal_server = self._server(self.internal_services, True, self.internal_port)
        address = config.bind_address(self.args.host, self.args.port)
        if self.args.health_port:
            self.health_server = grpc.aio.server(options=config.EXCLUSIVE_PORT)
            self.health.append(HealthServicer())
            health_pb2_grpc.add_HealthServicer_to_server(self.health[1], self.health_server)
            self._bind(self.health_server, self.args.health_port, None)
            await self.health_server.start()
        await self._set_status(NOT_SERVING)
        await self.server.start()
        if self.internal_server is not None:
            await self.internal_server.start()
        if self.args.metrics_port:
            start_metrics_server(self.args.metrics_port)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        log.info("%s listening on %s (internal port %s, health port %s, metrics port %s; internal callers: %s)",
                 self.name, address, self.internal_port or ("this" if self.internal else "-"),
                 self.args.health_port or "-", self.args.metrics_port or "-", self._auth_summary())

    def _auth_summary(self) -> str:
        ways = (["token"] if config.internal_tokens() else []) + (["mutual TLS"] if config.mutual_tls() else [])
        return " + ".join(ways) or "UNAUTHENTICATED (loopback only)"

    def _server(self, services: list[tuple], internal: bool, port: int) -> grpc.aio.Server:
        """One port: its services, health, reflection when asked for, behind the guard."""
        settings = config.peer_settings()
        guard = ServerGuard(internal, config.internal_tokens(), settings.tls_server_name if settings.tls_mutual else "")
        server = grpc.aio.server(options=config.message_options(self.args.max_message_mb) + config.EXCLUSIVE_PORT,
                                 interceptors=[guard])
        names = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME]
        for add, servicer, full_name in services:
            add(servicer, server)
            names.append(full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health[0], server)
        if getattr(self.args, "reflection", False):
            reflection.enable_server_reflection(names, server)
        self._bind(server, port, config.server_credentials())
        return server

    def _bind(self, server: grpc.aio.Server, port: int, creds: grpc.ServerCredentials | None) -> None:
        address = config.bind_address(self.args.host, port)
        try:
            bound = server.add_insecure_port(address) if creds is None else server.add_secure_port(address, creds)
        except RuntimeError:  # grpcio raises where older versions returned 0
            bound = 0
        if not bound:
            raise SystemExit(f"{self.name}: cannot bind {address} (taken by another process?)")

    async def _set_status(self, status) -> None:
        for servicer in self.health:
            await servicer.set("", status)

    async def set_serving(self) -> None:
        await self._set_status(SERVING)
        log.info("%s ready", self.name)

    async def wait_for_termination(self) -> None:
        await self.stopping.wait()
        log.info("%s shutting down: draining for up to %.0f s", self.name, self.args.grace_s)
        await self._set_status(NOT_SERVING)  # readiness fails first, so no new traffic is routed here
        stops = [self.server.stop(self.args.grace_s)]  # refuses new calls, lets in-flight ones finish
        if self.internal_server is not None:
            stops.append(self.internal_server.stop(self.args.grace_s))
        await asyncio.gather(*stops)
        for close in self.on_shutdown:
            try:
                await close()
            except Exception:  # shutting down anyway
                log.exception("shutdown hook failed")
        if self.health_server is not None:
            await self.health_server.stop(0)
        log.info("%s stopped", self.name)
