"""Flags with DSPARK_* environment defaults, and TLS credentials from the environment (docs/deploy.md)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import grpc

MiB = 1 << 20


def env(name: str, default=None):
    """An environment value, with the empty string treated as unset (Helm renders missing values as "")."""
    value = os.environ.get(name, "")
    return value if value != "" else default


def common_parser(description: str, port: int) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--port", type=int, default=int(env("DSPARK_PORT", port)), help="main gRPC port")
    ap.add_argument("--health-port", type=int, default=int(env("DSPARK_HEALTH_PORT", 0)),
                    help="plaintext port serving only grpc.health.v1 (0 = none)")
    ap.add_argument("--metrics-port", type=int, default=int(env("DSPARK_METRICS_PORT", 0)),
                    help="Prometheus /metrics port (0 = none)")
    ap.add_argument("--host", default=env("DSPARK_HOST", "[::]"), help="address to bind")
    ap.add_argument("--max-message-mb", type=float, default=float(env("DSPARK_MAX_MESSAGE_MB", 4)),
                    help="largest gRPC message accepted or sent, in MiB")
    ap.add_argument("--grace-s", type=float, default=float(env("DSPARK_GRACE_S", 30)),
                    help="on SIGTERM: seconds in-flight requests get to finish")
    ap.add_argument("--log-level", default=env("DSPARK_LOG_LEVEL", "INFO"))
    return ap


def message_options(max_message_mb: float) -> list[tuple[str, int]]:
    """Explicit size limits: over them gRPC itself answers RESOURCE_EXHAUSTED."""
    limit = int(max_message_mb * MiB)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


def _read(name: str) -> bytes | None:
    path = env(name)
    return Path(path).read_bytes() if path else None


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS from DSPARK_TLS_CERT/KEY (+ DSPARK_TLS_CA, DSPARK_TLS_MUTUAL=1 to require client certs)."""
    cert, key = _read("DSPARK_TLS_CERT"), _read("DSPARK_TLS_KEY")
    if not cert or not key:
        return None
    mutual = env("DSPARK_TLS_MUTUAL", "0") in ("1", "true", "yes")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read("DSPARK_TLS_CA"),
                                       require_client_auth=mutual)


def channel_credentials() -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """Credentials for calls to peers, plus the server-name override (peers are dialled by IP)."""
    ca = _read("DSPARK_TLS_CA")
    if not ca:
        return None, []
    mutual = env("DSPARK_TLS_MUTUAL", "0") in ("1", "true", "yes")
    creds = grpc.ssl_channel_credentials(ca, _read("DSPARK_TLS_KEY") if mutual else None,
                                         _read("DSPARK_TLS_CERT") if mutual else None)
    name = env("DSPARK_TLS_SERVER_NAME")
    return creds, [("grpc.ssl_target_name_override", name)] if name else []


def aio_channel(address: str, max_message_mb: float) -> grpc.aio.Channel:
    creds, extra = channel_credentials()
    options = message_options(max_message_mb) + extra
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, creds, options=options)


def sync_channel(address: str, max_message_mb: float) -> grpc.Channel:
    creds, extra = channel_credentials()
    options = message_options(max_message_mb) + extra
    if creds is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, creds, options=options)
