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
    ap.add_argument("--host", default=env("DSPARK_HOST", "127.0.0.1"),
                    help="address to bind (loopback unless told otherwise; the chart sets the pod's address)")
    ap.add_argument("--reflection", action="store_true", default=env("DSPARK_REFLECTION", "0") in ("1", "true"),
                    help="serve gRPC server reflection (off: it lists every internal method to anyone)")
    ap.add_argument("--max-message-mb", type=float, default=float(env("DSPARK_MAX_MESSAGE_MB", 4)),
                    help="largest gRPC message accepted or sent, in MiB")
    ap.add_argument("--grace-s", type=float, default=float(env("DSPARK_GRACE_S", 30)),
                    help="on SIGTERM: seconds in-flight requests get to finish")
    ap.add_argument("--log-level", default=env("DSPARK_LOG_LEVEL", "INFO"))
    tls = ap.add_argument_group("TLS", "files in PEM; the flags override the DSPARK_TLS_* environment")
    tls.add_argument("--tls-cert", default=env("DSPARK_TLS_CERT", ""), help="certificate (server and client)")
    tls.add_argument("--tls-key", default=env("DSPARK_TLS_KEY", ""), help="its private key")
    tls.add_argument("--tls-ca", default=env("DSPARK_TLS_CA", ""), help="CA that peers' certificates must chain to")
    tls.add_argument("--tls-mutual", default=env("DSPARK_TLS_MUTUAL", "0"),
                     help="1: require and verify client certificates; present ours to peers")
    tls.add_argument("--tls-server-name", default=env("DSPARK_TLS_SERVER_NAME", ""),
                     help="name to verify in peers' certificates (peers are dialled by IP)")
    auth = ap.add_argument_group("internal plane", "who may call the Scheduler, Verifier and Drafter services")
    auth.add_argument("--internal-token", default=env("DSPARK_INTERNAL_TOKEN", ""),
                      help="shared secret(s), comma-separated: callers must send one; the first is sent to peers "
                           "(two during a rotation: new,old)")
    auth.add_argument("--insecure-internal", action="store_true",
                      default=env("DSPARK_INSECURE_INTERNAL", "0") in ("1", "true"),
                      help="allow an unauthenticated internal plane on a non-loopback address (never in production)")
    return ap


TLS_FLAGS = {"tls_cert": "DSPARK_TLS_CERT", "tls_key": "DSPARK_TLS_KEY", "tls_ca": "DSPARK_TLS_CA",
             "tls_mutual": "DSPARK_TLS_MUTUAL", "tls_server_name": "DSPARK_TLS_SERVER_NAME"}


def apply_tls(args) -> None:
    """Make the TLS flags the process's settings and check them (SystemExit with the reason).

    The flags are written back into the environment because channels to peers are opened in
    several places (drafter link, scheduler reports, routing) and all read it from there."""
    for attr, name in TLS_FLAGS.items():
        value = getattr(args, attr, None)
        if value:
            os.environ[name] = str(value)
    cert, key, ca = env("DSPARK_TLS_CERT"), env("DSPARK_TLS_KEY"), env("DSPARK_TLS_CA")
    if bool(cert) != bool(key):
        raise SystemExit("TLS: --tls-cert and --tls-key (DSPARK_TLS_CERT/KEY) go together")
    if mutual_tls() and not (cert and ca):
        raise SystemExit("mutual TLS needs a certificate, its key and the CA to verify peers with")
    for path in filter(None, (cert, key, ca)):
        if not Path(path).is_file():
            raise SystemExit(f"TLS: no such file {path}")


def apply_auth(args) -> None:
    """Make --internal-token the process's setting (channels to peers read it from the environment)
    and refuse an unauthenticated internal plane reachable from other machines."""
    token = getattr(args, "internal_token", "")
    if token:
        os.environ["DSPARK_INTERNAL_TOKEN"] = token
    if internal_tokens() or mutual_tls() or getattr(args, "insecure_internal", False):
        return
    if not is_loopback(args.host):
        raise SystemExit(f"refusing to serve the internal plane on {args.host} without authentication: set "
                         "DSPARK_INTERNAL_TOKEN (or --internal-token), or mutual TLS, or --insecure-internal")


def internal_tokens() -> list[str]:
    return [t.strip() for t in str(env("DSPARK_INTERNAL_TOKEN", "")).split(",") if t.strip()]


def bind_address(host: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets (a pod's IP may be one)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    return host.strip("[]") in ("127.0.0.1", "::1", "localhost")


def mutual_tls() -> bool:
    return str(env("DSPARK_TLS_MUTUAL", "0")).lower() in ("1", "true", "yes")


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
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read("DSPARK_TLS_CA"),
                                       require_client_auth=mutual_tls())


def channel_credentials() -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """Credentials for calls to peers, plus the server-name override (peers are dialled by IP).

    TLS as soon as a CA or a certificate is configured (our servers then speak TLS too); no CA
    means the system's roots. With mutual TLS our certificate goes along as the client's."""
    ca = _read("DSPARK_TLS_CA")
    if not ca and not env("DSPARK_TLS_CERT"):
        return None, []
    mutual = mutual_tls()
    creds = grpc.ssl_channel_credentials(ca, _read("DSPARK_TLS_KEY") if mutual else None,
                                         _read("DSPARK_TLS_CERT") if mutual else None)
    name = env("DSPARK_TLS_SERVER_NAME")
    return creds, [("grpc.ssl_target_name_override", name)] if name else []


def aio_channel(address: str, max_message_mb: float) -> grpc.aio.Channel:
    """A channel to a peer service: TLS as configured, and our internal token on every call."""
    from dspark.serving.token_metadata import aio_interceptors

    creds, extra = channel_credentials()
    options = message_options(max_message_mb) + extra
    interceptors = aio_interceptors(internal_tokens()[:1])
    if creds is None:
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(address, creds, options=options, interceptors=interceptors)


def sync_channel(address: str, max_message_mb: float) -> grpc.Channel:
    from dspark.serving.token_metadata import with_token

    creds, extra = channel_credentials()
    options = message_options(max_message_mb) + extra
    if creds is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, creds, options=options)
    return with_token(channel, internal_tokens()[:1])
