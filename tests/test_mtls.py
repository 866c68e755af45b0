"""Mutual TLS between the three real services and on the public port (tiny target, random drafter).

Certificates are made here: a CA, one certificate for the services (server and client use, name
dspark.internal, as the Helm chart's Secret), a client certificate from the same CA, and a CA +
client certificate nobody trusts. The verifier takes its TLS settings by flags, the others from
the DSPARK_TLS_* environment.
"""
from __future__ import annotations

import datetime
import ipaddress
import os

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from service_helpers import (free_port, start_drafter, start_scheduler, start_verifier, wait_serving, wait_until,
                             write_tiny_target)

pytestmark = pytest.mark.slow
SERVER_NAME = "dspark.internal"
PROMPT = [5, 9, 30, 41]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _build(subject: str, key, issuer: str, issuer_key, *, ca: bool, sans=(), usages=()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_pki(directory, name: str) -> dict:
    """A CA with a service certificate (server + client auth) and a client certificate, as files."""
    ca_key, svc_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _build(f"{name} CA", ca_key, f"{name} CA", ca_key, ca=True)
    svc = _build(SERVER_NAME, svc_key, f"{name} CA", ca_key, ca=False,
                 sans=[x509.DNSName(SERVER_NAME), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
                 usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
    client = _build(f"{name} client", client_key, f"{name} CA", ca_key, ca=False,
                    usages=[ExtendedKeyUsageOID.CLIENT_AUTH])
    files = {"ca": _pem(ca), "cert": _pem(svc), "key": _key_pem(svc_key),
             "client_cert": _pem(client), "client_key": _key_pem(client_key)}
    paths = {}
    for key, data in files.items():
        paths[key] = directory / f"{name}-{key}.pem"
        paths[key].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mtls")
    target = str(write_tiny_target(tmp / "tiny"))
    pki, other = make_pki(tmp, "dspark"), make_pki(tmp, "other")
    env = pytest.MonkeyPatch()  # read by the drafter and the scheduler (the processes copy it)
    env.setenv("DSPARK_TLS_CERT", str(pki["cert"]))
    env.setenv("DSPARK_TLS_KEY", str(pki["key"]))
    env.setenv("DSPARK_TLS_CA", str(pki["ca"]))
    env.setenv("DSPARK_TLS_MUTUAL", "1")
    env.setenv("DSPARK_TLS_SERVER_NAME", SERVER_NAME)
    env.setenv("DSPARK_INTERNAL_TOKEN", "")  # mutual TLS alone authenticates the internal plane here
    health = {name: free_port() for name in ("drafter", "scheduler", "verifier")}
    services = []
    try:
        drafter, d_addr = start_drafter(target, tmp, health_port=health["drafter"])
        scheduler, s_addr = start_scheduler(tmp, [], health_port=health["scheduler"])
        services += [drafter, scheduler]
        for name in ("DSPARK_TLS_CERT", "DSPARK_TLS_KEY", "DSPARK_TLS_CA", "DSPARK_TLS_MUTUAL", "DSPARK_TLS_SERVER_NAME"):
            env.delenv(name)
        verifier, v_addr = start_verifier(target, tmp, d_addr, s_addr, health_port=health["verifier"],
                                          tls_cert=pki["cert"], tls_key=pki["key"], tls_ca=pki["ca"], tls_mutual=1,
                                          tls_server_name=SERVER_NAME)
        services.append(verifier)
        # The health ports stay plaintext (kubelet probes); the main ports speak only mTLS.
        for service, name in ((drafter, "drafter"), (scheduler, "scheduler"), (verifier, "verifier")):
            wait_serving(f"127.0.0.1:{health[name]}", service, timeout=120)
        yield dict(scheduler=s_addr, verifier=v_addr, drafter=d_addr, pki=pki, other=other)
    finally:
        env.undo()
        for service in services:
            service.kill()


def client(address: str, root, cert=None, key=None):
    from dspark_client import Client, RetryPolicy, TlsConfig

    tls = TlsConfig.from_files(root, cert, key, server_name=SERVER_NAME)
    return Client(address, tls=tls, timeout=30, retry=RetryPolicy(max_attempts=1))


def test_client_with_certificate_generates_through_mutual_tls(cluster):
    pki = cluster["pki"]
    with client(cluster["scheduler"], pki["ca"], pki["client_cert"], pki["client_key"]) as c:
        # The verifier registered with the scheduler over mTLS once the scheduler lists its model.
        wait_until(lambda: c.list_models(), 60, interval=0.3, what="verifier registered over mTLS")
        result = c.generate(token_ids=PROMPT, max_tokens=16)
    assert len(result.token_ids) == 16 and result.text
    # Drafts were verified: the verifier's link to the drafter works under mTLS too.
    assert result.metrics.draft_tokens > 0


def refused(make) -> grpc.StatusCode:
    from dspark_client import DSparkError

    with pytest.raises(DSparkError) as info, make() as c:
        c.generate(token_ids=PROMPT, max_tokens=4, timeout=10)
    return info.value.code


@pytest.mark.parametrize("who", ["scheduler", "verifier", "drafter"])
def test_clients_without_a_trusted_certificate_are_refused(cluster, who):
    from dspark_client import Client, RetryPolicy

    pki, other, address = cluster["pki"], cluster["other"], cluster[who]
    attempts = {
        "no client certificate": lambda: client(address, pki["ca"]),
        "certificate from another CA": lambda: client(address, pki["ca"], other["client_cert"], other["client_key"]),
        "not trusting the server's CA": lambda: client(address, other["ca"], other["client_cert"], other["client_key"]),
        "plaintext": lambda: Client(address, timeout=10, retry=RetryPolicy(max_attempts=1)),
    }
    for why, make in attempts.items():
        assert refused(make) == grpc.StatusCode.UNAVAILABLE, why


def test_peer_without_client_certificate_cannot_reach_the_drafter(cluster):
    """The drafter itself refuses a TLS peer without a certificate (not only the public port)."""
    from dspark.proto_gen.v1 import drafter_pb2, drafter_pb2_grpc

    pki = cluster["pki"]
    creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    with grpc.secure_channel(cluster["drafter"], creds, options=options) as channel, \
            pytest.raises(grpc.RpcError) as info:
        drafter_pb2_grpc.DrafterStub(channel).DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), pki["key"].read_bytes(), pki["cert"].read_bytes())
    with grpc.secure_channel(cluster["drafter"], creds, options=options) as channel:
        info = drafter_pb2_grpc.DrafterStub(channel).DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
    assert info.gamma == 4


def test_a_public_client_certificate_cannot_call_internal_services(cluster):
    """Under mutual TLS the internal plane takes only the services' own certificate: a client
    certificate from the same CA reaches the public Generation service, not the drafter."""
    from dspark.proto_gen.v1 import drafter_pb2, drafter_pb2_grpc

    pki = cluster["pki"]
    creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes(), pki["client_key"].read_bytes(),
                                         pki["client_cert"].read_bytes())
    options = [("grpc.ssl_target_name_override", SERVER_NAME)]
    with grpc.secure_channel(cluster["drafter"], creds, options=options) as channel, \
            pytest.raises(grpc.RpcError) as info:
        drafter_pb2_grpc.DrafterStub(channel).DrafterInfo(drafter_pb2.DrafterInfoRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_tls_settings_are_checked_and_flags_win(tmp_path, monkeypatch):
    import argparse

    from dspark.serving import config

    for name in config.TLS_FLAGS.values():
        monkeypatch.delenv(name, raising=False)
    pki = make_pki(tmp_path, "unit")
    args = lambda **kw: argparse.Namespace(**{**dict.fromkeys(config.TLS_FLAGS, ""), **kw})  # noqa: E731
    with pytest.raises(SystemExit, match="go together"):
        config.apply_tls(args(tls_cert=str(pki["cert"])))
    assert "DSPARK_TLS_CERT" not in os.environ and not config.peer_settings().tls_cert  # a refused flag left no trace
    with pytest.raises(SystemExit, match="mutual TLS needs"):
        config.apply_tls(args(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), tls_mutual="1"))
    with pytest.raises(SystemExit, match="no such file"):
        config.apply_tls(args(tls_ca=str(tmp_path / "missing.pem"), tls_mutual="0"))
    monkeypatch.setenv("DSPARK_TLS_CA", str(tmp_path / "env-ca-is-overridden.pem"))
    config.apply_tls(args(tls_cert=str(pki["cert"]), tls_key=str(pki["key"]), tls_ca=str(pki["ca"]), tls_mutual="1"))
    assert config.server_credentials() is not None and config.mutual_tls()
    creds, options = config.channel_credentials()
    assert creds is not None and options == []  # no server name given
    assert "DSPARK_TLS_CERT" not in os.environ  # the flags are the process's settings, not its environment
