"""Find the verifier (or drafter) replicas to talk to.

Two implementations behind one small interface:
  StaticDiscovery      fixed "host:port" list (local mode, tests, non-cluster runs)
  KubernetesDiscovery  ready pods in a namespace, read through the official client, either
                       from the EndpointSlices of a Service or from pods by label selector

Both give `addresses() -> list[str]` (sorted "host:port", ready endpoints only) and
`watch(on_change, stop)`, which calls on_change(addresses) at start and on every change until
`stop` is set. The scheduler's Role (deploy/helm) allows get/list/watch on both resources.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

log = logging.getLogger(__name__)

SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by Kubernetes on every EndpointSlice


class Discovery(Protocol):
    def addresses(self) -> list[str]: ...

    def watch(self, on_change: Callable[[list[str]], None], stop: threading.Event) -> None: ...


class StaticDiscovery:
    """A fixed list of addresses; watch reports it once and waits for stop."""

    def __init__(self, addresses: Iterable[str]):
        self._addresses = sorted(set(addresses))
        for addr in self._addresses:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"address must be host:port, got {addr!r}")

    def addresses(self) -> list[str]:
        return list(self._addresses)

    def watch(self, on_change: Callable[[list[str]], None], stop: threading.Event) -> None:
        on_change(self.addresses())
        stop.wait()


def _pod_is_ready(pod) -> bool:
    # A pod counts once it is Running, not being deleted, has an IP and its Ready condition is
    # True (the readiness probe passed: the model is loaded).
    status = pod.status
    if pod.metadata.deletion_timestamp is not None or status is None:
        return False
    if status.phase != "Running" or not status.pod_ip:
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (status.conditions or []))


def _endpoint_is_ready(endpoint) -> bool:
    # EndpointSlice API: a missing `ready` means unknown and should be read as ready;
    # terminating endpoints are never ready.
    cond = endpoint.conditions
    if cond is None:
        return True
    if cond.terminating:
        return False
    return cond.ready is None or cond.ready


class KubernetesDiscovery:
    """Ready replicas in one namespace.

    source="endpointslices": slices labelled kubernetes.io/service-name=<service>; the port is
        the slice port named `port_name`, falling back to `port`.
    source="pods": pods matching `label_selector` (e.g. "app.kubernetes.io/component=verifier")
        with the Ready condition; the port is `port`.
    """

    def __init__(self, namespace: str, *, source: str = "endpointslices", service: str | None = None,
                 label_selector: str | None = None, port: int | None = None, port_name: str = "grpc",
                 api_client=None, watch_timeout_s: int = 60):
        if source == "endpointslices" and not service:
            raise ValueError("source='endpointslices' needs a service name")
        if source == "pods" and (not label_selector or port is None):
            raise ValueError("source='pods' needs label_selector and port")
        if source not in ("endpointslices", "pods"):
            raise ValueError(f"unknown source {source!r}")
        from kubernetes import client  # imported here so local mode never needs it

        self.namespace = namespace
        self.source = source
        self.service = service
        self.label_selector = label_selector
        self.port = port
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s
        api_client = api_client or _default_api_client()
        self._core = client.CoreV1Api(api_client)
        self._discovery = client.DiscoveryV1Api(api_client)

    # -- listing -------------------------------------------------------------------------------

    def _list_call(self):
        """(list function, kwargs) for the resource this instance reads."""
        if self.source == "pods":
            return self._core.list_namespaced_pod, {"label_selector": self.label_selector}
        return (self._discovery.list_namespaced_endpoint_slice,
                {"label_selector": f"{SERVICE_NAME_LABEL}={self.service}"})

    def _list(self) -> tuple[list[str], str | None]:
        fn, kwargs = self._list_call()
        result = fn(self.namespace, **kwargs)
        if self.source == "pods":
            addrs = {f"{_host(p.status.pod_ip)}:{self.port}" for p in result.items if _pod_is_ready(p)}
        else:
            addrs = set()
            for eps in result.items:
                port = self._slice_port(eps)
                if port is None:
                    continue
                for endpoint in eps.endpoints or []:
                    if _endpoint_is_ready(endpoint):
                        addrs.update(f"{_host(a)}:{port}" for a in endpoint.addresses)
        return sorted(addrs), result.metadata.resource_version

    def _slice_port(self, eps) -> int | None:
        for p in eps.ports or []:
            if p.name == self.port_name and p.port is not None:
                return p.port
        return self.port

    def addresses(self) -> list[str]:
        return self._list()[0]

    # -- watching ------------------------------------------------------------------------------

    def watch(self, on_change: Callable[[list[str]], None], stop: threading.Event) -> None:
        """List, report, then follow a watch stream; any event triggers a fresh list (simple
        and always consistent). On errors or stream end: back off briefly and start over."""
        from kubernetes import watch as k8s_watch

        last: list[str] | None = None
        backoff = 0.5
        while not stop.is_set():
            try:
                addrs, version = self._list()
                if addrs != last:
                    last = addrs
                    on_change(addrs)
                fn, kwargs = self._list_call()
                w = k8s_watch.Watch()
                for _event in w.stream(fn, self.namespace, resource_version=version,
                                       timeout_seconds=self.watch_timeout_s, **kwargs):
                    if stop.is_set():
                        w.stop()
                        break
                    addrs, _ = self._list()
                    if addrs != last:
                        last = addrs
                        on_change(addrs)
                backoff = 0.5
            except Exception as exc:  # API server restarts, 410 Gone, network blips
                log.warning("discovery watch failed (%s); retrying", exc)
                stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip  # IPv6 needs brackets in host:port


def _default_api_client():
    """In-cluster service-account credentials, else the local kubeconfig."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def make_discovery(kind: str, *, addresses: Iterable[str] = (), namespace: str = "default",
                   label_selector: str | None = None, service: str | None = None,
                   port: int | None = None, api_client=None) -> Discovery:
    """Factory behind the services' `--discovery static|kubernetes` flag. With a service name
    EndpointSlices are used, otherwise pods by label selector."""
    if kind == "static":
        return StaticDiscovery(addresses)
    if kind == "kubernetes":
        source = "endpointslices" if service else "pods"
        return KubernetesDiscovery(namespace, source=source, service=service,
                                   label_selector=label_selector, port=port, api_client=api_client)
    raise ValueError(f"unknown discovery kind {kind!r}")


def wait_for(discovery: Discovery, predicate: Callable[[list[str]], bool], timeout_s: float,
             interval_s: float = 0.2) -> list[str]:
    """Poll addresses() until predicate holds (startup helper: wait for a first verifier)."""
    deadline = time.monotonic() + timeout_s
    while True:
        addrs = discovery.addresses()
        if predicate(addrs) or time.monotonic() >= deadline:
            return addrs
        time.sleep(interval_s)
