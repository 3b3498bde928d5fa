"""deploy/k8s: every overlay renders, validates offline against Kubernetes schemas, and
keeps the invariants operators rely on (limits, probes, non-root, pinned images, GPU
requests, a NetworkPolicy per workload)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fxport.config import Settings

from .conftest import K8S, OVERLAYS, REPO, kustomize_build, with_component

VARIANTS = (*OVERLAYS, "gpu-without-keda", "cpu-only-gvisor")
# Oldest Kubernetes we claim (native gRPC probes, autoscaling/v2, policy/v1, PSA labels are
# all GA there) and a current one. kubernetes-validate ships schemas 1.25-1.37.
KUBERNETES_VERSIONS = ("1.30.0", "1.34.0")
# CRDs have no schema in kubernetes-validate: excluded from schema validation, listed here.
# Their shape is checked by test_keda_scaled_object_* below instead.
EXCLUDED_CRDS = {
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("keda.sh/v1alpha1", "TriggerAuthentication"),
    ("monitoring.coreos.com/v1", "PodMonitor"),  # test_the_pod_monitor_* below
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# FXPORT_* variables the manifests set that are not (yet) fields of fxport.config.Settings.
# FXPORT_TOKENS_FILE: the API's token file, read by the auth layer (service/).
# FXPORT_SANDBOX_REQUIRE: the layers a worker's sandbox must have (workers/sandbox/run.py).
NON_SETTINGS_ENV = {"FXPORT_TOKENS_FILE", "FXPORT_SANDBOX_REQUIRE"}


# ----------------------------------------------------------------------------- helpers
def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(workload: dict) -> list[dict]:
    spec = workload["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def labels_match(selector: dict, labels: dict) -> bool:
    """Kubernetes label-selector semantics (matchLabels + matchExpressions In/NotIn/Exists)."""
    for key, value in selector.get("matchLabels", {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def validate(docs: list[dict], version: str, tmp_path: Path) -> tuple[int, str]:
    path = tmp_path / f"rendered-{version}.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


def assert_valid(docs: list[dict], version: str, tmp_path: Path) -> None:
    rc, output = validate(docs, version, tmp_path)
    # A removed API version only prints WARN and exits 0: WARN is a failure here.
    problems = [line for line in output.splitlines() if not line.startswith("INFO")]
    assert rc == 0 and not problems, f"kubernetes-validate --strict -k {version}:\n{output}"
    assert output.count(" passed for resource ") == len(docs), output


def image_is_pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name_and_tag = image.rsplit("/", 1)[-1]
    return ":" in name_and_tag and name_and_tag.rsplit(":", 1)[1] not in ("", "latest")


# ----------------------------------------------------------------------------- render + validate
@pytest.mark.parametrize("variant", VARIANTS)
def test_overlay_builds(rendered, variant):
    docs = rendered[variant]
    assert docs, variant
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "fxport", (variant, doc["kind"], doc["metadata"]["name"])


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_overlay_passes_strict_schema_validation(rendered, variant, version, tmp_path):
    docs = [d for d in rendered[variant] if (d["apiVersion"], d["kind"]) not in EXCLUDED_CRDS]
    assert_valid(docs, version, tmp_path)


def test_validation_catches_unknown_fields_and_removed_apis(tmp_path):
    """The check above is only worth something if it fails on what it is meant to catch."""
    typo = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "x"},
        "dataa": {"k": "v"},
    }
    rc, output = validate([typo], "1.30.0", tmp_path)
    assert rc != 0, output
    removed = {
        "apiVersion": "policy/v1beta1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": "x"},
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"a": "b"}}},
    }
    with pytest.raises(AssertionError, match="WARN"):
        assert_valid([removed], "1.30.0", tmp_path)


# ----------------------------------------------------------------------------- invariants
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_has_requests_and_limits(rendered, variant):
    for workload in workloads(rendered[variant]):
        for c in containers(workload):
            resources = c.get("resources", {})
            for key in ("cpu", "memory"):
                assert key in resources.get("limits", {}), (workload["metadata"]["name"], c["name"], key)
                assert key in resources.get("requests", {}), (workload["metadata"]["name"], c["name"], key)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_container_runs_locked_down(rendered, variant):
    for workload in workloads(rendered[variant]):
        name = workload["metadata"]["name"]
        pod = workload["spec"]["template"]["spec"]
        pod_sc = pod.get("securityContext", {})
        assert pod.get("automountServiceAccountToken") is False, name
        mounts_tmp_volume = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for c in containers(workload):
            sc = c.get("securityContext", {})
            where = (name, c["name"])
            assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, where
            assert sc.get("runAsUser", pod_sc.get("runAsUser", 0)) != 0, where
            assert sc.get("allowPrivilegeEscalation") is False, where
            assert sc.get("readOnlyRootFilesystem") is True, where
            assert "ALL" in sc.get("capabilities", {}).get("drop", []), where
            assert not sc.get("capabilities", {}).get("add"), where
            assert not sc.get("privileged"), where
            seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
            assert seccomp.get("type") == "RuntimeDefault", where
            # read-only root: /tmp must be a writable emptyDir
            tmp = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp and tmp[0]["name"] in mounts_tmp_volume, where


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_pinned_never_latest(rendered, variant):
    for workload in workloads(rendered[variant]):
        for c in containers(workload):
            assert image_is_pinned(c["image"]), (workload["metadata"]["name"], c["image"])
            assert c.get("imagePullPolicy") != "Always", c["image"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes(rendered, variant):
    """Every container has a liveness probe. Pods a Service routes to have readiness too;
    workers have none (no Service; they pull work from Redis — base/worker-cpu.yaml)."""
    docs = rendered[variant]
    services = kinds(docs, "Service")
    for workload in workloads(docs):
        name = workload["metadata"]["name"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        served = any(labels_match({"matchLabels": s["spec"].get("selector", {})}, labels) for s in services)
        for c in containers(workload):
            assert "livenessProbe" in c, (name, c["name"])
            if served:
                assert "readinessProbe" in c, (name, c["name"])
    api = next(w for w in kinds(docs, "Deployment") if w["metadata"]["name"] == "fxport-api")
    (container,) = containers(api)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        # native gRPC probe: grpc.health.v1.Health/Check on the serving port
        assert container[probe]["grpc"]["port"] == 50051, probe


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_workers_only_in_gpu_overlays_and_request_a_gpu(rendered, variant):
    gpu_containers = []
    for workload in workloads(rendered[variant]):
        pod = workload["spec"]["template"]["spec"]
        for c in containers(workload):
            if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}):
                gpu_containers.append((workload, pod, c))
    if not variant.startswith("gpu"):
        assert not gpu_containers
        return
    names = {w["metadata"]["name"] for w, _, _ in gpu_containers}
    assert names == {"fxport-worker-gpu"}
    for _workload, pod, c in gpu_containers:
        assert int(c["resources"]["limits"]["nvidia.com/gpu"]) >= 1
        assert c["args"] == ["worker", "--queues", "gpu"]
        assert pod.get("nodeSelector"), "GPU workers must be pinned to the GPU node pool"
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_workload_has_its_own_network_policy(rendered, variant):
    docs = rendered[variant]
    policies = kinds(docs, "NetworkPolicy")
    default_deny = [p for p in policies if p["spec"]["podSelector"] == {}]
    assert default_deny, "a default-deny NetworkPolicy selecting every pod"
    assert set(default_deny[0]["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    assert not default_deny[0]["spec"].get("ingress") and not default_deny[0]["spec"].get("egress")
    for workload in workloads(docs):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        own = [p for p in policies if p["spec"]["podSelector"] and labels_match(p["spec"]["podSelector"], labels)]
        assert own, f"{workload['metadata']['name']} has no NetworkPolicy selecting its pods"


@pytest.mark.parametrize("variant", VARIANTS)
def test_workers_reach_only_redis_object_store_and_dns(rendered, variant):
    docs = rendered[variant]
    worker_labels = {"app.kubernetes.io/name": "fxport", "app.kubernetes.io/component": "worker"}
    egress_ports = set()
    for policy in kinds(docs, "NetworkPolicy"):
        spec = policy["spec"]
        if not spec["podSelector"] or not labels_match(spec["podSelector"], worker_labels):
            continue
        if "Ingress" in spec.get("policyTypes", []):
            for rule in spec.get("ingress", []):
                assert rule.get("from"), f"{policy['metadata']['name']}: ingress to workers from anywhere"
                assert {p["port"] for p in rule["ports"]} == {9100}
        for rule in spec.get("egress", []):
            egress_ports |= {(p.get("protocol", "TCP"), p["port"]) for p in rule["ports"]}
    object_store = ("TCP", 8333) if variant == "trial" else ("TCP", 443)
    assert egress_ports == {("TCP", 6379), object_store, ("UDP", 53), ("TCP", 53)}, egress_ports


@pytest.mark.parametrize("variant", VARIANTS)
def test_settings_env_names_exist_in_fxport_config(rendered, variant):
    """A typo in an FXPORT_* name would silently fall back to the default."""
    known = {f"FXPORT_{field.upper()}" for field in Settings.model_fields} | NON_SETTINGS_ENV
    used = set()
    for cm in kinds(rendered[variant], "ConfigMap"):
        used |= {k for k in cm.get("data", {}) if k.startswith("FXPORT_")}
    for workload in workloads(rendered[variant]):
        for c in containers(workload):
            used |= {e["name"] for e in c.get("env", []) if e["name"].startswith("FXPORT_")}
    assert used - known == set()


@pytest.mark.parametrize("variant", VARIANTS)
def test_env_references_are_defined_before_use(rendered, variant):
    """Kubernetes expands $(VAR) only from variables defined earlier; otherwise the literal
    text "$(VAR)" ends up in, say, the broker URL."""
    for workload in workloads(rendered[variant]):
        for c in containers(workload):
            defined: set[str] = set()
            for entry in c.get("env", []):
                for ref in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
                    assert ref in defined, (workload["metadata"]["name"], entry["name"], ref)
                defined.add(entry["name"])
            for arg in c.get("args", []) + c.get("command", []):
                for ref in re.findall(r"\$\((\w+)\)", arg):
                    assert ref in defined, (workload["metadata"]["name"], arg)


def test_time_limits_grace_periods_and_metrics_port_agree(rendered):
    docs = rendered["gpu"]
    (config,) = [cm for cm in kinds(docs, "ConfigMap") if cm["metadata"]["name"] == "fxport-config"]
    data = config["data"]
    assert int(data["FXPORT_JOB_SOFT_TIME_LIMIT_S"]) < int(data["FXPORT_JOB_HARD_TIME_LIMIT_S"])
    for workload in kinds(docs, "Deployment"):
        pod = workload["spec"]["template"]
        (c,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert pod["metadata"]["annotations"]["prometheus.io/port"] == data["FXPORT_METRICS_PORT"]
        assert {"name": "metrics", "containerPort": int(data["FXPORT_METRICS_PORT"])} in c["ports"]
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        if workload["metadata"]["labels"]["app.kubernetes.io/component"] == "worker":
            # SIGTERM → Celery soft shutdown → unfinished job requeued (acks_late)
            assert env.get("REMAP_SIGTERM") == "SIGQUIT"
            assert env.get("PROMETHEUS_MULTIPROC_DIR")
            assert grace >= 300
        else:
            pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
            assert grace > int(pre_stop[-1]) + 30


def test_redis_persists_with_aof_on_a_volume(rendered):
    (redis,) = kinds(rendered["cpu-only"], "StatefulSet")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    args = c["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    data_dir = args[args.index("--dir") + 1]
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": data_dir} in c["volumeMounts"]


def test_api_is_autoscaled_and_disruption_bounded(rendered):
    docs = rendered["cpu-only"]
    (hpa,) = kinds(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "fxport-api"
    assert hpa["spec"]["minReplicas"] >= 2
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    api = next(w for w in kinds(docs, "Deployment") if w["metadata"]["name"] == "fxport-api")
    assert "replicas" not in api["spec"], "the HPA owns the API's replica count"
    pdb_targets = {p["metadata"]["name"] for p in kinds(docs, "PodDisruptionBudget")}
    assert "fxport-api" in pdb_targets


def test_keda_scaled_object_targets_the_gpu_queue(rendered):
    docs = rendered["gpu"]
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    gpu = next(w for w in kinds(docs, "Deployment") if w["metadata"]["name"] == "fxport-worker-gpu")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "fxport-worker-gpu"
    assert "replicas" not in gpu["spec"], "KEDA owns the GPU worker count"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis" and trigger["metadata"]["listName"] == "gpu"
    assert trigger["metadata"]["address"].startswith(f"redis.{gpu['metadata']['namespace']}.svc")
    auth = next(d for d in docs if d["kind"] == "TriggerAuthentication")
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (secret_ref,) = auth["spec"]["secretTargetRef"]
    assert any(s["metadata"]["name"] == secret_ref["name"] for s in kinds(docs, "Secret"))


def test_keda_is_optional(rendered):
    docs = rendered["gpu-without-keda"]
    assert not [d for d in docs if d["apiVersion"].startswith("keda.sh/")]
    gpu = next(w for w in kinds(docs, "Deployment") if w["metadata"]["name"] == "fxport-worker-gpu")
    assert gpu["spec"]["replicas"] >= 1


def test_readme_documents_every_setting():
    """deploy/README.md's configuration reference keeps up with fxport/config.py."""
    readme = (REPO / "deploy" / "README.md").read_text()
    missing = [f"FXPORT_{f.upper()}" for f in Settings.model_fields if f"FXPORT_{f.upper()}" not in readme]
    assert not missing, f"deploy/README.md does not document {missing}"


def test_every_overlay_is_tested():
    on_disk = {p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()}
    assert on_disk == set(OVERLAYS)


def test_the_worker_sandbox_needs_no_privilege(rendered):
    """The sandbox's layers (seccomp, Landlock) need no capability: every worker keeps all of
    them dropped, no privilege escalation and RuntimeDefault seccomp (which allows landlock_*),
    and so its jobs need no setting to run with the default FXPORT_SANDBOX_REQUIRE."""
    for variant in ("cpu-only", "gpu"):
        for workload in workloads(rendered[variant]):
            if workload["metadata"]["labels"].get("app.kubernetes.io/component") != "worker":
                continue
            pod = workload["spec"]["template"]["spec"]
            assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
            for c in containers(workload):
                assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                assert "FXPORT_SANDBOX_REQUIRE" not in {e["name"] for e in c.get("env", [])}
            assert "runtimeClassName" not in pod


def test_the_gvisor_component_moves_only_the_cpu_workers_and_requires_seccomp(rendered):
    """gVisor has no Landlock: its workers must require the seccomp layer only, or every job fails closed."""
    docs = rendered["cpu-only-gvisor"]
    for workload in workloads(docs):
        pod = workload["spec"]["template"]["spec"]
        is_worker = workload["metadata"]["name"] == "fxport-worker-cpu"
        assert pod.get("runtimeClassName") == ("gvisor" if is_worker else None), workload["metadata"]["name"]
        env = {e["name"]: e.get("value") for c in containers(workload) for e in c.get("env", [])}
        assert env.get("FXPORT_SANDBOX_REQUIRE") == ("seccomp" if is_worker else None)


# ----------------------------------------------------------------------------- Prometheus Operator
# Fields of monitoring.coreos.com/v1 PodMonitor used here (the operator's API reference).
POD_MONITOR_SPEC_FIELDS = {"selector", "namespaceSelector", "podMetricsEndpoints", "podTargetLabels", "jobLabel"}
POD_METRICS_ENDPOINT_FIELDS = {"port", "path", "scheme", "interval", "scrapeTimeout", "honorLabels", "relabelings"}


@pytest.fixture(scope="module")
def gpu_with_pod_monitor(tmp_path_factory) -> list[dict]:
    """The gpu overlay (API, CPU and GPU workers) with the optional prometheus-operator
    component added, as deploy/README.md says."""
    directory = with_component("gpu", "prometheus-operator", tmp_path_factory.mktemp("gpu-prometheus-operator"))
    return kustomize_build(directory, "--load-restrictor", "LoadRestrictionsNone")


def test_the_pod_monitor_scrapes_every_metrics_endpoint_and_only_those(rendered, gpu_with_pod_monitor):
    docs = gpu_with_pod_monitor
    (monitor,) = [d for d in docs if d["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["namespace"] == "fxport"
    spec = monitor["spec"]
    assert set(spec) <= POD_MONITOR_SPEC_FIELDS and {"selector", "podMetricsEndpoints"} <= set(spec)
    (endpoint,) = spec["podMetricsEndpoints"]
    assert set(endpoint) <= POD_METRICS_ENDPOINT_FIELDS
    # the component only adds the PodMonitor: everything else is the gpu overlay as it was
    assert [d for d in docs if d is not monitor] == rendered["gpu"]

    scraped = {w["metadata"]["name"]: w for w in workloads(docs)
               if labels_match(spec["selector"], w["spec"]["template"]["metadata"]["labels"])}
    annotated = {w["metadata"]["name"] for w in workloads(docs)
                 if w["spec"]["template"]["metadata"].get("annotations", {}).get("prometheus.io/scrape") == "true"}
    assert set(scraped) == annotated == {"fxport-api", "fxport-worker-cpu", "fxport-worker-gpu"}
    policies = kinds(docs, "NetworkPolicy")
    for name, workload in scraped.items():
        template = workload["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        (port,) = [p for c in containers(workload) for p in c.get("ports", []) if p.get("name") == endpoint["port"]]
        # the same endpoint the prometheus.io/* annotations name
        assert str(port["containerPort"]) == annotations["prometheus.io/port"], name
        assert endpoint.get("path", "/metrics") == annotations["prometheus.io/path"], name
        # and a NetworkPolicy admits the scrape
        admitted = [rule for p in policies if p["spec"]["podSelector"]
                    and labels_match(p["spec"]["podSelector"], template["metadata"]["labels"])
                    for rule in p["spec"].get("ingress", [])
                    if {q["port"] for q in rule.get("ports", [])} == {port["containerPort"]} and rule.get("from")]
        assert admitted, f"no NetworkPolicy admits scrapes of {name} on {port['containerPort']}"
    for label in spec.get("podTargetLabels", []):
        assert all(label in w["spec"]["template"]["metadata"]["labels"] for w in scraped.values()), label
