"""One failure policy whichever way a job runs (README, "What a conversion does"): a model one of
whose targets cannot be built fails with exit 1 from `fxport convert` and from `fxport submit --wait`
on a server (a warm worker's sandbox), and `--out` then holds manifest.json and report.html only; with
`--allow-partial` both succeed and `--out` holds the verified artifacts. The result documents agree:
what was built, what was kept, the targets not built and why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from fxport.ci_report import junit_xml, step_summary
from fxport.results import from_job, from_manifest
from tests.client.packaged import UNTRACEABLE, package_model

FXPORT = [sys.executable, "-m", "fxport.cli"]
# torchscript is scripted from the eager model and verifies; exported_program needs a graph, which no rung captures
FLAGS = ["--input", "x:2,4", "-t", "torchscript", "-t", "exported_program"]


def fxport(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FXPORT, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def untraceable(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return package_model(UNTRACEABLE, "policy_cli_untraceable", tmp_path_factory.mktemp("untraceable"))


def _files(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def _outcome(result: dict[str, Any]) -> tuple[Any, ...]:
    """What both paths must agree on: state, exit code, what was kept and built, what failed and why."""
    kept = sorted(a["path"] for a in result["artifacts"] if a["format"] not in ("manifest", "report"))
    return (result["state"], result["exit_code"], kept, sorted(a["path"] for a in result["withdrawn"]),
            [(t["target"], t["stage"]) for t in result["failed_targets"]],
            (result["error"] or {}).get("code"), (result["error"] or {}).get("stage"))


@pytest.mark.slow  # four conversions, each a fresh interpreter and its sandbox: ~40 s on 2 cores
def test_a_failed_target_fails_convert_and_submit_alike_and_allow_partial_accepts_the_rest(
        embedded_server, untraceable: Path, tmp_path: Path) -> None:
    server = ["--server", embedded_server.address]
    results: dict[str, dict[str, Any]] = {}
    for partial in ((), ("--allow-partial",)):
        name = "partial" if partial else "strict"
        local = fxport("convert", str(untraceable), *FLAGS, *partial, "--out", str(tmp_path / f"{name}-convert"),
                       "--json", "--junit", str(tmp_path / f"{name}.xml"), cwd=tmp_path)
        remote = fxport("submit", str(untraceable), *FLAGS, *partial, *server, "--wait", "--timeout", "240",
                        "--out", str(tmp_path / f"{name}-submit"), "--json", cwd=tmp_path)
        assert local.returncode == remote.returncode == (0 if partial else 1), (local.stderr, remote.stderr)
        results[f"{name}-convert"], results[f"{name}-submit"] = json.loads(local.stdout), json.loads(remote.stdout)
        assert _outcome(results[f"{name}-convert"]) == _outcome(results[f"{name}-submit"])

    strict = results["strict-convert"]
    assert _outcome(strict) == ("FAILED", 1, [], ["model.ts"], [("exported_program", "capture")], "capture_failed",
                                "capture")
    assert _files(tmp_path / "strict-convert") == _files(tmp_path / "strict-submit") == ["manifest.json",
                                                                                         "report.html"]
    for result in (strict, results["strict-submit"]):
        message = result["error"]["message"]
        assert "1 of 2 target(s) could not be built: exported_program: needs a graph" in message, message
        assert "if y.sum() > 0" in message and "--allow-partial" in message
        assert [a["verdict"] for a in result["withdrawn"]] == ["passed"]  # built and verified, not kept
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "strict.xml").getroot().iter("testcase")}
    assert set(cases) == {"model.ts [torch.jit]", "target exported_program", "job"}
    assert cases["target exported_program"].find("failure") is not None and cases["job"].find("failure") is not None

    assert _outcome(results["partial-convert"]) == ("SUCCEEDED", 0, ["model.ts"], [],
                                                    [("exported_program", "capture")], None, None)
    assert _files(tmp_path / "partial-convert") == _files(tmp_path / "partial-submit") == [
        "manifest.json", "model.ts", "report.html"]

    job_id = results["strict-submit"]["job_id"]
    watched = fxport("jobs", "watch", job_id, *server, cwd=tmp_path)
    assert watched.returncode == 1, watched.stderr
    assert "exported_program" in watched.stderr


# -- the result document and the CI report of a failed job, from its manifest --------------------------

MANIFEST = {
    "job_id": "local-0", "status": "failed", "spec": {},
    "artifacts": [{"format": "torchscript", "path": "model.ts", "bytes": 10, "sha256": "a" * 64}],
    "verification": [{"format": "torchscript", "runtime": "torch.jit", "passed": True, "verdict": "passed",
                      "max_abs_diff": 0.0, "cosine": 1.0}],
    "failed_targets": [{"target": "exported_program", "stage": "capture", "reason": "needs a graph"}],
    "error": {"stage": "capture", "code": "capture_failed", "message": "1 of 2 target(s) could not be built"},
}


def test_a_failed_jobs_result_lists_what_it_built_as_withdrawn() -> None:
    result = from_manifest("convert", MANIFEST, exit_code=1)
    assert result.artifacts == [] and [a.path for a in result.withdrawn] == ["model.ts"]
    assert result.withdrawn[0].verdict == "passed"
    kept = from_manifest("convert", MANIFEST, exit_code=2, kept={"model.ts"})  # a failure that kept its files
    assert [a.path for a in kept.artifacts] == ["model.ts"] and kept.withdrawn == []
    succeeded = from_manifest("convert", {**MANIFEST, "status": "succeeded", "error": None}, exit_code=0)
    assert [a.path for a in succeeded.artifacts] == ["model.ts"] and succeeded.withdrawn == []

    job = {"id": "j1", "state": "FAILED", "error": MANIFEST["error"],
           "artifacts": [{"name": "manifest.json", "format": "manifest", "bytes": 2, "sha256": "b" * 64}]}
    remote = from_job("submit", job, exit_code=1, manifest=MANIFEST)
    assert [a.path for a in remote.artifacts] == ["manifest.json"]
    assert [a.path for a in remote.withdrawn] == ["model.ts"]

    junit = ET.fromstring(junit_xml(result).split("\n", 1)[1])
    names = [c.get("name") for c in junit.iter("testcase")]
    assert names == ["model.ts [torch.jit]", "target exported_program", "job"]
    summary = step_summary(result)
    assert "| `model.ts` | torch.jit | passed |" in summary
    assert "Not kept (a failed job keeps no model file): `model.ts`." in summary
