"""The optional PrometheusRule component (deploy/k8s/components/prometheus-rules): its rule groups
are what `promtool check rules` accepts, its unit tests (rules.test.yaml) pass under `promtool
test rules`, and every alert the README's "Metrics" section lists is in it, over metric names
fxport actually serves. promtool comes from scripts/install_promtool.sh (scripts/test.sh runs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry

from fxport.metrics import build_metrics

from .conftest import K8S, REPO, kustomize_build, with_component

COMPONENT = K8S / "components" / "prometheus-rules"


def _promtool() -> str:
    found = shutil.which("promtool") or str(REPO / ".venv" / "bin" / "promtool")
    if not os.access(found, os.X_OK):
        pytest.fail("promtool is missing: scripts/install_promtool.sh puts it in .venv/bin (scripts/test.sh runs it)")
    return found


@pytest.fixture(scope="module")
def rule(tmp_path_factory) -> dict:
    """The PrometheusRule as the component adds it to an overlay."""
    directory = with_component("cpu-only", "prometheus-rules", tmp_path_factory.mktemp("with-rules"))
    (found,) = [d for d in kustomize_build(directory, "--load-restrictor", "LoadRestrictionsNone")
                if d["kind"] == "PrometheusRule"]
    return found


def test_promtool_accepts_the_rules_and_their_unit_tests_pass(rule, tmp_path):
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["namespace"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    shutil.copyfile(COMPONENT / "rules.test.yaml", tmp_path / "rules.test.yaml")
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", "rules.yaml"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = subprocess.run([promtool, "test", "rules", "rules.test.yaml"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_uses_metrics_fxport_serves(rule):
    registry = CollectorRegistry()
    build_metrics(registry)
    served = {m.name for m in registry.collect()} | {f"{m.name}_total" for m in registry.collect()}
    exprs = [r["expr"] for g in rule["spec"]["groups"] for r in g["rules"]]
    used = {name for e in exprs for name in re.findall(r"\b((?:fxport|grpc_server)_[a-z_]+)\b", e)}
    assert used and not used - served - {"grpc_server_handled_total"}, used - served


def test_the_readme_names_the_component_and_its_alerts(rule):
    readme = (REPO / "deploy" / "README.md").read_text()
    assert "components/prometheus-rules" in readme
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert {"FxportQueueGrowing", "FxportPlatformFailingJobs", "FxportApiBackendErrors",
            "FxportSandboxOutOfMemory"} <= alerts
