"""Who may speak for a verifier id (plain functions).

A verifier id is bound to the credential and the network address it registered from. While its
record is live, a registration from another identity, peer or advertised address is refused,
and so are heartbeats and step reports for it from anyone else: a caller with the internal
credential cannot take over a running verifier's traffic. When the record has expired (the
verifier is gone), the id is free again. The advertised IP must be the caller's own IP, so a
registration cannot point the scheduler at a third machine (off behind proxies that hide it).
"""
from __future__ import annotations

import ipaddress


def peer_host(peer: str) -> str:
    """grpc's context.peer(): 'ipv4:10.0.0.5:4242', 'ipv6:[::1]:4242', 'unix:/x' -> the host part."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    return peer


def address_host(address: str) -> str:
    return address.rsplit(":", 1)[0].strip("[]") if ":" in address else address


def _ip(host: str):
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return None


def same_host(a: str, b: str) -> bool:
    ia, ib = _ip(a), _ip(b)
    if ia is None or ib is None:
        return a == b
    if ia.is_loopback and ib.is_loopback:
        return True
    return ia == ib or getattr(ia, "ipv4_mapped", None) == ib or getattr(ib, "ipv4_mapped", None) == ia


def registration_refusal(existing: dict | None, live: bool, address: str, identity: str, peer: str,
                         check_address: bool) -> str | None:
    """Why this registration is refused, or None."""
    host = address_host(address)
    if check_address and _ip(host) is not None and not same_host(host, peer):
        return f"advertised address {address} is not the caller's own ({peer})"
    if existing is not None and live and (existing.get("address") != address
                                          or caller_refusal(existing, identity, peer)):
        return (f"verifier id {existing.get('verifier_id')!r} is live at {existing.get('address')}; "
                "a registration from elsewhere is refused")
    return None


def caller_refusal(record: dict, identity: str, peer: str) -> str | None:
    """Why this caller may not speak for the verifier of `record`, or None."""
    bound_identity, bound_peer = record.get("identity"), record.get("peer")
    if bound_identity is not None and bound_identity != identity:
        return f"verifier {record.get('verifier_id')!r} is bound to another credential"
    if bound_peer is not None and not same_host(bound_peer, peer):
        return f"verifier {record.get('verifier_id')!r} is bound to another address"
    return None
