"""Flags with DSPARK_* environment defaults, and how the process talks to its peers: TLS and internal
tokens (docs/deploy.md)."""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

MiB = 1 << 20


def env(name: str, default=None):
    """An environment value, with the empty string treated as unset (Helm renders missing values as "")."""
    value = os.environ.get(name, "")
    return value if value != "" else default


TRUE = ("1", "true", "yes", "on")


class FlagParser(argparse.ArgumentParser):
    """argparse where a flag names its environment variable too, `env="DSPARK_..."`: one place for
    both, the variable's value as the default, and a bad value in either ends the process with a
    message naming the flag and the variable (not a traceback)."""

    def add_argument(self, *names, env: str | None = None, **kw):
        return super().add_argument(*names, **self._from_env(names, env, kw))

    def add_argument_group(self, *args, **kwargs):
        group = super().add_argument_group(*args, **kwargs)
        plain = group.add_argument
        group.add_argument = lambda *names, env=None, **kw: plain(*names, **self._from_env(names, env, kw))
        return group

    def _from_env(self, names, env_name: str | None, kw: dict) -> dict:
        if env_name is None:
            return kw
        kw["help"] = f"{kw.get('help', '')} [${env_name}]".strip()
        raw = env(env_name)
        if raw is None:
            return kw
        if kw.get("action") == "store_true":
            kw["default"] = str(raw).lower() in TRUE
            return kw
        convert = kw.get("type", str)
        try:
            value = convert(raw)
        except (TypeError, ValueError):
            kind = getattr(convert, "__name__", convert)
            self.error(f"${env_name}={raw!r} is not a valid value for {names[0]} ({kind})")
        if kw.get("choices") is not None and value not in kw["choices"]:
            self.error(f"${env_name}={raw!r} for {names[0]}: choose from {', '.join(map(str, kw['choices']))}")
        kw["default"] = value
        return kw


def common_parser(description: str, port: int) -> FlagParser:
    ap = FlagParser(description=description)
    ap.add_argument("--port", type=int, env="DSPARK_PORT", default=port, help="main gRPC port")
    ap.add_argument("--health-port", type=int, env="DSPARK_HEALTH_PORT", default=0,
                    help="plaintext port serving only grpc.health.v1 (0 = none)")
    ap.add_argument("--metrics-port", type=int, env="DSPARK_METRICS_PORT", default=0,
                    help="Prometheus /metrics port (0 = none)")
    ap.add_argument("--host", env="DSPARK_HOST", default="127.0.0.1",
                    help="address to bind (loopback unless told otherwise; the chart sets the pod's address)")
    ap.add_argument("--reflection", action="store_true", env="DSPARK_REFLECTION", default=False,
                    help="serve gRPC server reflection (off: it lists every internal method to anyone)")
    ap.add_argument("--max-message-mb", type=float, env="DSPARK_MAX_MESSAGE_MB", default=4,
                    help="largest gRPC message accepted or sent, in MiB")
    ap.add_argument("--grace-s", type=float, env="DSPARK_GRACE_S", default=30,
                    help="on SIGTERM: seconds in-flight requests get to finish")
    ap.add_argument("--log-level", env="DSPARK_LOG_LEVEL", default="INFO")
    tls = ap.add_argument_group("TLS", "files in PEM; the flags override the DSPARK_TLS_* environment")
    tls.add_argument("--tls-cert", env="DSPARK_TLS_CERT", default="", help="certificate (server and client)")
    tls.add_argument("--tls-key", env="DSPARK_TLS_KEY", default="", help="its private key")
    tls.add_argument("--tls-ca", env="DSPARK_TLS_CA", default="", help="CA that peers' certificates must chain to")
    tls.add_argument("--tls-mutual", env="DSPARK_TLS_MUTUAL", default="0",
                     help="1: require and verify client certificates; present ours to peers")
    tls.add_argument("--tls-server-name", env="DSPARK_TLS_SERVER_NAME", default="",
                     help="name to verify in peers' certificates (peers are dialled by IP)")
    auth = ap.add_argument_group("internal plane", "who may call the Scheduler, Verifier and Drafter services")
    auth.add_argument("--internal-token", env="DSPARK_INTERNAL_TOKEN", default="",
                      help="shared secret(s), comma-separated: callers must send one; the first is sent to peers "
                           "(two during a rotation: new,old)")
    auth.add_argument("--insecure-internal", action="store_true",
                      env="DSPARK_INSECURE_INTERNAL", default=False,
                      help="allow an unauthenticated internal plane on a non-loopback address (never in production)")
    return ap


TLS_FLAGS = {"tls_cert": "DSPARK_TLS_CERT", "tls_key": "DSPARK_TLS_KEY", "tls_ca": "DSPARK_TLS_CA",
             "tls_mutual": "DSPARK_TLS_MUTUAL", "tls_server_name": "DSPARK_TLS_SERVER_NAME"}


@dataclass(frozen=True)
class PeerSettings:
    """How this process talks to its peers: TLS files and internal tokens. Taken from the DSPARK_*
    environment until a service's flags set them (apply_tls, apply_auth); every channel and
    server here reads them from `peer_settings()`, none from the environment."""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    tls_mutual: bool = False
    tls_server_name: str = ""
    internal_tokens: tuple[str, ...] = ()  # the first is sent to peers; all are accepted

    @classmethod
    def from_env(cls) -> PeerSettings:
        return cls(env("DSPARK_TLS_CERT", ""), env("DSPARK_TLS_KEY", ""), env("DSPARK_TLS_CA", ""),
                   str(env("DSPARK_TLS_MUTUAL", "0")).lower() in TRUE, env("DSPARK_TLS_SERVER_NAME", ""),
                   split_tokens(env("DSPARK_INTERNAL_TOKEN", "")))


_settings: PeerSettings | None = None


def peer_settings() -> PeerSettings:
    global _settings
    if _settings is None:
        _settings = PeerSettings.from_env()
    return _settings


def reset_peer_settings() -> None:
    """Forget what flags set: read the environment again (tests)."""
    global _settings
    _settings = None


def split_tokens(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in str(text).split(",") if t.strip())


def apply_tls(args) -> None:
    """Make the TLS flags (over the environment) the process's settings and check them
    (SystemExit with the reason)."""
    global _settings
    flags = {attr: getattr(args, attr, None) for attr in TLS_FLAGS}
    current = peer_settings()
    settings = dataclasses.replace(
        current, **{attr: value for attr, value in flags.items() if value and attr != "tls_mutual"})
    if flags["tls_mutual"]:
        settings = dataclasses.replace(settings, tls_mutual=str(flags["tls_mutual"]).lower() in TRUE)
    cert, key, ca = settings.tls_cert, settings.tls_key, settings.tls_ca
    if bool(cert) != bool(key):
        raise SystemExit("TLS: --tls-cert and --tls-key (DSPARK_TLS_CERT/KEY) go together")
    if settings.tls_mutual and not (cert and ca):
        raise SystemExit("mutual TLS needs a certificate, its key and the CA to verify peers with")
    for path in filter(None, (cert, key, ca)):
        if not Path(path).is_file():
            raise SystemExit(f"TLS: no such file {path}")
    _settings = settings


def apply_auth(args) -> None:
    """Make --internal-token the process's setting and refuse an unauthenticated internal plane
    reachable from other machines."""
    global _settings
    token = getattr(args, "internal_token", "")
    if token:
        _settings = dataclasses.replace(peer_settings(), internal_tokens=split_tokens(token))
    if internal_tokens() or mutual_tls() or getattr(args, "insecure_internal", False):
        return
    if not is_loopback(args.host):
        raise SystemExit(f"refusing to serve the internal plane on {args.host} without authentication: set "
                         "DSPARK_INTERNAL_TOKEN (or --internal-token), or mutual TLS, or --insecure-internal")


def internal_tokens() -> list[str]:
    return list(peer_settings().internal_tokens)


def bind_address(host: str, port: int) -> str:
    """host:port, with an IPv6 address in brackets (a pod's IP may be one)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    return host.strip("[]") in ("127.0.0.1", "::1", "localhost")


def mutual_tls() -> bool:
    return peer_settings().tls_mutual


def message_options(max_message_mb: float) -> list[tuple[str, int]]:
    """Explicit size limits: over them gRPC itself answers RESOURCE_EXHAUSTED."""
    limit = int(max_message_mb * MiB)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


# gRPC servers set SO_REUSEPORT by default: a second service started on a port already taken
# binds too and the kernel splits new connections between the two, silently. One port, one
# service: a taken port fails the start instead.
EXCLUSIVE_PORT = [("grpc.so_reuseport", 0)]


def _read(path: str) -> bytes | None:
    return Path(path).read_bytes() if path else None


def server_credentials() -> grpc.ServerCredentials | None:
    """TLS from the certificate and key (+ the CA, and mutual TLS to require client certificates)."""
    settings = peer_settings()
    cert, key = _read(settings.tls_cert), _read(settings.tls_key)
    if not cert or not key:
        return None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=_read(settings.tls_ca),
                                       require_client_auth=settings.tls_mutual)


def channel_credentials() -> tuple[grpc.ChannelCredentials | None, list[tuple[str, str]]]:
    """Credentials for calls to peers, plus the server-name override (peers are dialled by IP).

    TLS as soon as a CA or a certificate is configured (our servers then speak TLS too); no CA
    means the system's roots. With mutual TLS our certificate goes along as the client's."""
    settings = peer_settings()
    ca = _read(settings.tls_ca)
    if not ca and not settings.tls_cert:
        return None, []
    mutual = settings.tls_mutual
    creds = grpc.ssl_channel_credentials(ca, _read(settings.tls_key) if mutual else None,
                                         _read(settings.tls_cert) if mutual else None)
    name = settings.tls_server_name
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
