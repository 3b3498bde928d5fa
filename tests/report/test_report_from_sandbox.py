"""report.html of a job run in the sandbox: the child may not start processes, so its trusted
parent draws the report, running Graphviz's `dot` confined (workers/sandbox/confine.py confined_dot)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from fxport import report
from fxport.spec import parse_spec
from tests.report.conftest import ReportIndex

FORKS: list[int] = []
os.register_at_fork(before=lambda: FORKS.append(os.getpid()))  # every fork of this process, subprocess's too


def test_a_sandboxed_job_report_has_both_graph_drawings(tiny_pt2: Path, tmp_path: Path, dot_binary: str):
    from fxport.workers.engine.request import EngineRequest
    from fxport.workers.sandbox import run_engine_job

    run_engine_job(EngineRequest(model_path=tiny_pt2, spec=parse_spec({"targets": ["torchscript"],
                                 "verify": {"samples": 1}}), out_dir=tmp_path / "out", job_id="report-box"))
    text = (tmp_path / "out" / "report.html").read_text()
    assert "Graph not drawn" not in text, text[text.find("Graph not drawn"):][:300]
    assert ReportIndex(text).svg_in.get("graph") == 2
    assert "sandbox" in (tmp_path / "out" / "manifest.json").read_text()  # drawn from the parent's manifest


def test_dot_runs_with_no_writes_no_processes_and_no_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The same preexec confinement, on a shell instead of dot: what dot could do if subverted."""
    from fxport.workers.sandbox.confine import _dot_preexec

    monkeypatch.setenv("FXPORT_S3_SECRET_KEY", "not-for-dot")
    probe = tmp_path / "written"
    script = f"echo x > {probe}; echo write=$?; (true &); echo env=${{FXPORT_S3_SECRET_KEY:-none}}"
    res = subprocess.run(["sh", "-c", script], capture_output=True, text=True, preexec_fn=_dot_preexec(),
                         env={"PATH": "/usr/bin:/bin"}, timeout=30)
    assert "write=2" in res.stdout and not probe.exists(), (res.stdout, res.stderr)
    assert "Cannot fork" in res.stderr  # the subshell could not be started
    assert "env=" not in res.stdout or "env=none" in res.stdout


def test_a_graph_is_laid_out_once_per_architecture(dot_binary: str):
    calls: list[bytes] = []

    def counting(source: bytes) -> bytes:
        calls.append(source)
        return report.run_dot(source)

    graph = {"node_count": 3, "nodes": [{"name": "x", "op": "placeholder", "target": "x", "inputs": []},
                                        {"name": "relu_unique_42", "op": "call_function", "target": "aten.relu",
                                         "inputs": ["x"]},
                                        {"name": "output", "op": "output", "target": "output",
                                         "inputs": ["relu_unique_42"]}]}
    manifest = {"job_id": "a", "status": "succeeded", "graph_before": graph, "graph_after": graph}
    first = report.render_report(manifest, layout=counting)
    second = report.render_report({**manifest, "job_id": "b"}, layout=counting)
    assert len(calls) == 1  # before == after, and the second job's graph is the first's
    assert ReportIndex(first).svg_in.get("graph") == ReportIndex(second).svg_in.get("graph") == 2


def test_links_the_sandbox_left_in_its_output_folder_are_not_followed(tmp_path: Path):
    """A failed child's folder is drawn from too: a report.html symlink it planted is replaced,
    not written through, and a manifest.json symlink is not read."""
    import json

    from fxport.workers.sandbox import draw_report

    out, victim = tmp_path / "out", tmp_path / "credentials"
    out.mkdir()
    victim.write_text("keep me")
    (out / "manifest.json").write_text(json.dumps({"job_id": "hostile", "status": "failed"}))
    (out / "report.html").symlink_to(victim)
    draw_report(out)
    assert victim.read_text() == "keep me"
    assert not (out / "report.html").is_symlink() and "hostile" in (out / "report.html").read_text()

    (out / "report.html").unlink()
    (out / "manifest.json").unlink()
    (out / "manifest.json").symlink_to(victim)
    draw_report(out)
    assert not (out / "report.html").exists() and victim.read_text() == "keep me"


def test_a_worker_without_graphviz_forks_nothing_for_the_graphs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  manifest: dict):
    """No `dot` on PATH: the report says so, and drawing it starts no process. Each confined
    `dot` is a fork of the whole worker (preexec_fn rules out vfork), which on a worker without
    Graphviz bought only a failed exec, twice per job."""
    import json

    from fxport.workers.sandbox import draw_report

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    report.clear_layout_cache()  # nothing laid out earlier
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps(manifest))
    before = len(FORKS)
    draw_report(out)
    assert "Graphviz <code>dot</code> is not installed" in (out / "report.html").read_text()
    assert len(FORKS) == before
