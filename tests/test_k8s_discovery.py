"""KubernetesDiscovery against a small in-memory Kubernetes API server.

No cluster runs here, so the test starts a real HTTP server on localhost that serves the
minimal JSON of list + watch for pods and EndpointSlices (label selectors, resourceVersion,
chunked watch streams), and drives it with the official `kubernetes` client.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest
from kubernetes import client

from scheduler_svc.k8s_discovery import KubernetesDiscovery, StaticDiscovery, make_discovery

NS = "inference"
VERIFIER_SELECTOR = "app.kubernetes.io/instance=ds,app.kubernetes.io/component=verifier"


class FakeApi:
    """Objects by (resource, namespace, name) plus an event log for watches."""

    def __init__(self):
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, object)
        self.version = 1
        self.cond = threading.Condition()
        self.requests: list[str] = []
        self.closed = False  # set at teardown so open watch streams end

    def put(self, resource: str, obj: dict, event_type: str | None = None):
        with self.cond:
            self.version += 1
            obj["metadata"]["resourceVersion"] = str(self.version)
            key = (resource, obj["metadata"]["namespace"], obj["metadata"]["name"])
            event_type = event_type or ("MODIFIED" if key in self.objects else "ADDED")
            self.objects[key] = obj
            self.events.append((self.version, resource, event_type, obj))
            self.cond.notify_all()

    def delete(self, resource: str, namespace: str, name: str):
        with self.cond:
            obj = self.objects.pop((resource, namespace, name))
            self.version += 1
            self.events.append((self.version, resource, "DELETED", obj))
            self.cond.notify_all()

    def matching(self, resource, namespace, selector, objs):
        return [o for o in objs if o["metadata"]["namespace"] == namespace
                and _selects(selector, o["metadata"].get("labels", {}))]


def _selects(selector: str | None, labels: dict) -> bool:
    # Equality-based selectors only ("a=b,c==d"), which is all discovery sends.
    for term in filter(None, (selector or "").split(",")):
        key, _, value = term.replace("==", "=").partition("=")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


def make_handler(api: FakeApi):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked watch streams need 1.1

        def log_message(self, *args):  # keep test output quiet
            pass

        def do_GET(self):
            url = urlparse(self.path)
            query = {k: v[0] for k, v in parse_qs(url.query).items()}
            api.requests.append(self.path)
            parts = url.path.strip("/").split("/")
            if url.path.startswith("/api/v1/namespaces/") and parts[-1] == "pods":
                resource, kind = "pods", "PodList"
            elif url.path.startswith("/apis/discovery.k8s.io/v1/namespaces/") and parts[-1] == "endpointslices":
                resource, kind = "endpointslices", "EndpointSliceList"
            else:
                return self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                        "message": "not found", "code": 404})
            namespace = parts[-2]
            selector = query.get("labelSelector")
            if query.get("watch") in ("true", "1"):
                return self._watch(resource, namespace, selector, int(query.get("resourceVersion", 0)),
                                   float(query.get("timeoutSeconds", 5)))
            with api.cond:
                objs = [o for (r, _, _), o in api.objects.items() if r == resource]
                items = api.matching(resource, namespace, selector, objs)
                version = api.version
            api_version = "v1" if resource == "pods" else "discovery.k8s.io/v1"
            self._send(200, {"kind": kind, "apiVersion": api_version,
                             "metadata": {"resourceVersion": str(version)}, "items": items})

        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _watch(self, resource, namespace, selector, since, timeout_s):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Connection", "close")
            self.end_headers()
            deadline = time.monotonic() + timeout_s
            try:
                while time.monotonic() < deadline and not api.closed:
                    with api.cond:
                        api.cond.wait(0.1)
                        new = [(v, t, o) for v, r, t, o in api.events if v > since and r == resource]
                    for version, event_type, obj in new:
                        since = version
                        if api.matching(resource, namespace, selector, [obj]):
                            line = json.dumps({"type": event_type, "object": obj}).encode() + b"\n"
                            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                            self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client stopped watching
            self.close_connection = True

    return Handler


def pod(name, *, component="verifier", instance="ds", ip, ready=True, phase="Running"):
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {
            "app.kubernetes.io/instance": instance, "app.kubernetes.io/component": component}},
        "spec": {"containers": [{"name": component, "image": "dspark:test"}]},
        "status": {"phase": phase, "podIP": ip, "conditions": [
            {"type": "Ready", "status": "True" if ready else "False"}]},
    }


def endpoint_slice(name, service, endpoints, port=50052):
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": NS, "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "metrics", "port": 9400, "protocol": "TCP"},
                  {"name": "grpc", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def ep(ip, ready=True, terminating=False):
    conditions = {} if ready is None else {"ready": ready, "terminating": terminating}
    return {"addresses": [ip], "conditions": conditions}


@pytest.fixture
def api():
    fake = FakeApi()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(fake))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    fake.client = client.ApiClient(config)
    yield fake
    fake.closed = True
    server.shutdown()
    server.server_close()


def seed_pods(api):
    api.put("pods", pod("verifier-a", ip="10.0.0.1"))
    api.put("pods", pod("verifier-b", ip="10.0.0.2", ready=False))          # still loading
    api.put("pods", pod("verifier-c", ip="10.0.0.3", phase="Pending"))
    api.put("pods", pod("verifier-d", ip="10.0.0.4", instance="other"))     # another release
    api.put("pods", pod("drafter-a", ip="10.0.1.1", component="drafter"))


def test_pods_by_selector_only_ready(api):
    seed_pods(api)
    verifiers = KubernetesDiscovery(NS, source="pods", label_selector=VERIFIER_SELECTOR,
                                    port=50052, api_client=api.client)
    assert verifiers.addresses() == ["10.0.0.1:50052"]
    assert any("labelSelector=" in r for r in api.requests)
    drafters = KubernetesDiscovery(NS, source="pods", label_selector="app.kubernetes.io/component=drafter",
                                   port=50053, api_client=api.client)
    assert drafters.addresses() == ["10.0.1.1:50053"]
    # Another namespace sees nothing.
    other = KubernetesDiscovery("elsewhere", source="pods", label_selector=VERIFIER_SELECTOR,
                                port=50052, api_client=api.client)
    assert other.addresses() == []


def test_pod_changes_picked_up(api):
    seed_pods(api)
    d = KubernetesDiscovery(NS, source="pods", label_selector=VERIFIER_SELECTOR, port=50052,
                            api_client=api.client)
    api.put("pods", pod("verifier-b", ip="10.0.0.2", ready=True))   # model finished loading
    assert d.addresses() == ["10.0.0.1:50052", "10.0.0.2:50052"]
    api.delete("pods", NS, "verifier-a")
    assert d.addresses() == ["10.0.0.2:50052"]


def test_endpointslices_ready_endpoints_and_named_port(api):
    api.put("endpointslices", endpoint_slice("ver-1", "ds-dspark-verifier", [
        ep("10.0.0.1"), ep("10.0.0.2", ready=False), ep("10.0.0.3", terminating=True),
        ep("10.0.0.5", ready=None)]))                   # unknown readiness counts as ready
    api.put("endpointslices", endpoint_slice("ver-2", "ds-dspark-verifier", [ep("10.0.0.6")]))
    api.put("endpointslices", endpoint_slice("dra-1", "ds-dspark-drafter", [ep("10.0.1.1")], port=50053))
    verifiers = make_discovery("kubernetes", namespace=NS, service="ds-dspark-verifier",
                               api_client=api.client)
    assert verifiers.addresses() == ["10.0.0.1:50052", "10.0.0.5:50052", "10.0.0.6:50052"]
    drafters = KubernetesDiscovery(NS, service="ds-dspark-drafter", api_client=api.client)
    assert drafters.addresses() == ["10.0.1.1:50053"]


def test_watch_reports_changes(api):
    seed_pods(api)
    d = KubernetesDiscovery(NS, source="pods", label_selector=VERIFIER_SELECTOR, port=50052,
                            api_client=api.client, watch_timeout_s=30)
    seen: list[list[str]] = []
    changed = threading.Condition()

    def on_change(addrs):
        with changed:
            seen.append(addrs)
            changed.notify_all()

    # The watch stream stays open for 30 s, so a change seen within 2 s came through the stream.
    def wait_until(expected, timeout=2.0):
        with changed:
            assert changed.wait_for(lambda: seen and seen[-1] == expected, timeout), seen

    stop = threading.Event()
    thread = threading.Thread(target=d.watch, args=(on_change, stop), daemon=True)
    thread.start()
    try:
        wait_until(["10.0.0.1:50052"])
        api.put("pods", pod("verifier-e", ip="10.0.0.9"))
        wait_until(["10.0.0.1:50052", "10.0.0.9:50052"])
        # A change outside the selector does not produce a callback.
        n = len(seen)
        api.put("pods", pod("drafter-b", ip="10.0.1.2", component="drafter"))
        api.put("pods", pod("verifier-a", ip="10.0.0.1", ready=False))
        wait_until(["10.0.0.9:50052"])
        assert len(seen) == n + 1
        assert any("watch=true" in r for r in api.requests)
    finally:
        stop.set()
        # watch() notices stop at the next event (or the watch timeout): send one.
        api.put("pods", pod("verifier-z", ip="10.0.0.99"))
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_static_discovery():
    s = make_discovery("static", addresses=["b:2", "a:1", "b:2"])
    assert isinstance(s, StaticDiscovery)
    assert s.addresses() == ["a:1", "b:2"]
    stop = threading.Event()
    stop.set()
    got = []
    s.watch(got.append, stop)
    assert got == [["a:1", "b:2"]]
    with pytest.raises(ValueError):
        StaticDiscovery(["no-port"])
    with pytest.raises(ValueError):
        make_discovery("dns")
    with pytest.raises(ValueError):
        KubernetesDiscovery(NS, source="pods", api_client=object())


@pytest.mark.slow
def test_scheduler_routes_only_to_verifier_pods_discovery_reports_ready(api, tmp_path, monkeypatch):
    """scheduler_svc --discovery=kubernetes, reaching this API server through a kubeconfig: a
    registered verifier gets traffic only once its pod is Ready."""
    from dspark_client import Client, RetryPolicy
    from service_helpers import free_port, start_scheduler, start_verifier, wait_serving, wait_until, write_tiny_target

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(json.dumps({  # JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "fake", "cluster": {"server": api.client.configuration.host}}],
        "users": [{"name": "nobody", "user": {}}],
        "contexts": [{"name": "test", "context": {"cluster": "fake", "user": "nobody", "namespace": NS}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: use the kubeconfig
    target = str(write_tiny_target(tmp_path / "tiny"))
    v_port = free_port()
    api.put("pods", pod("verifier-0", ip="127.0.0.1", ready=False))  # still loading, as far as Kubernetes knows
    services = []
    try:
        scheduler, s_addr = start_scheduler(tmp_path, [], discovery="kubernetes", namespace=NS,
                                            verifier_selector=VERIFIER_SELECTOR, verifier_port=v_port,
                                            queue_timeout_s=1)
        services.append(scheduler)
        verifier, v_addr = start_verifier(target, tmp_path, "", s_addr, port=v_port)
        services.append(verifier)
        wait_serving(s_addr, scheduler, timeout=120)
        wait_serving(v_addr, verifier, timeout=120)
        with Client(s_addr, timeout=30, retry=RetryPolicy(max_attempts=1)) as c:
            # Registered and heartbeating, but its pod is not Ready: not routed to.
            wait_until(lambda: f"registered at 127.0.0.1:{v_port}" in scheduler.log(), 30, what="registration")
            time.sleep(1.0)
            assert c.list_models() == []
            assert any("labelSelector=" in r for r in api.requests)
            api.put("pods", pod("verifier-0", ip="127.0.0.1", ready=True))
            wait_until(lambda: c.list_models(), 30, interval=0.2, what="verifier routed to once Ready")
            assert len(c.generate(token_ids=[5, 9, 30], max_tokens=8).token_ids) == 8
            api.delete("pods", NS, "verifier-0")  # scaled down: no longer routed to
            wait_until(lambda: c.list_models() == [], 30, interval=0.2, what="verifier dropped with its pod")
    finally:
        for service in services:
            service.kill()
