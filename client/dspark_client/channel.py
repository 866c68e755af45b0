"""Channels to the server: plaintext, TLS, or mutual TLS."""

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsConfig:
    """PEM bytes. No root_certificates = the system's trusted roots. certificate_chain and
    private_key together give the server a client certificate (mutual TLS)."""

    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # check the server's certificate against this name instead

    def __post_init__(self):
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("mutual TLS needs both certificate_chain and private_key")

    @classmethod
    def from_files(cls, root_certificates=None, certificate_chain=None, private_key=None, server_name=None) -> "TlsConfig":
        def read(path):
            return None if path is None else Path(path).read_bytes()

        return cls(read(root_certificates), read(certificate_chain), read(private_key), server_name)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.root_certificates, self.private_key, self.certificate_chain)


def _options(tls: TlsConfig | None, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    extra = [("grpc.ssl_target_name_override", tls.server_name)] if tls and tls.server_name else []
    return [*options, *extra]


def open_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    if tls is None:
        return grpc.insecure_channel(address, options=_options(tls, options))
    return grpc.secure_channel(address, tls.credentials(), options=_options(tls, options))


def open_aio_channel(address: str, tls: TlsConfig | None, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    if tls is None:
        return grpc.aio.insecure_channel(address, options=_options(tls, options))
    return grpc.aio.secure_channel(address, tls.credentials(), options=_options(tls, options))


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """"host:port", "a:1,b:2" or a list: the replicas to try in turn."""
    items = address.split(",") if isinstance(address, str) else list(address)
    addresses = [a.strip() for a in items if a.strip()]
    if not addresses:
        raise ValueError("no server address given")
    return addresses
