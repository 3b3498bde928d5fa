"""A job's result in the forms CI systems read natively: JUnit XML and a markdown step summary.

JUnit (`--junit FILE` on convert, submit --wait and jobs watch): one testcase per verification
check of an artifact (per runtime, and per precision scheme where an int8 job has two), so a
pipeline's test view lists "model.onnx [onnxruntime]" passed or failed with the numbers. A
mismatch is a <failure> whose message names what was measured against what was allowed; an
inconclusive check is <skipped> with the reason; a target that was not built, and a job that
failed before any check, are <failure>s too, so a failed job never reads as an empty green run.
The checks of what a failed job built and did not keep (`withdrawn`) are listed as well: they
say which artifact differed, or that the others passed and only a target failed.

The step summary is markdown appended to $GITHUB_STEP_SUMMARY when it is set (GitHub Actions
renders it on the run's page); GitLab CI reads the JUnit file (`artifacts:reports:junit`).
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from fxport.results import ArtifactResult, Check, JobResult


def _case_name(artifact: ArtifactResult, check: Check) -> str:
    scheme = f", int8 for {check.scheme}" if check.scheme else ""
    return f"{artifact.path} [{check.runtime or artifact.format}{scheme}]"


def _measured(check: Check) -> str:
    parts = []
    if check.max_abs_diff is not None:
        atol = check.allowed.get("atol")
        parts.append(f"max |diff| {check.max_abs_diff:.3g}" + (f" (atol {atol:g}" + (
            f", rtol {check.allowed['rtol']:g})" if "rtol" in check.allowed else ")") if atol is not None else ""))
    if check.cosine is not None:
        floor = check.allowed.get("min_cosine")
        parts.append(f"cosine {check.cosine:.6f}" + (f" (at least {floor:g})" if floor is not None else ""))
    return ", ".join(parts) or "no numbers recorded"


def junit_xml(result: JobResult) -> str:
    """The JUnit XML document of `result`."""
    suite = ET.Element("testsuite", name=f"fxport {result.command}", hostname=result.job_id or "")
    cases: list[ET.Element] = []
    classname = f"fxport.{result.job_id or 'job'}"
    for artifact in [*result.artifacts, *result.withdrawn]:
        for check in artifact.checks:
            case = ET.Element("testcase", classname=classname, name=_case_name(artifact, check), file=artifact.path)
            if check.verdict == "failed":
                failure = ET.SubElement(case, "failure", type="mismatch",
                                        message=f"does not match the original model: {_measured(check)}")
                failure.text = (f"{artifact.path} ({artifact.format}, sha256 {artifact.sha256}) in "
                                f"{check.runtime}: {_measured(check)} over {check.shapes_checked} shape(s)"
                                + (f"; {check.reason}" if check.reason else ""))
            elif check.verdict == "inconclusive":
                ET.SubElement(case, "skipped", message=f"inconclusive: {check.reason or 'the inputs could not tell'}")
            else:
                ET.SubElement(case, "system-out").text = _measured(check)
            cases.append(case)
    for target in result.failed_targets:
        case = ET.Element("testcase", classname=classname, name=f"target {target.target}")
        ET.SubElement(case, "failure", type="not_built", message=f"not built ({target.stage}): {target.reason}")
        cases.append(case)
    if result.state != "SUCCEEDED" and (result.error is not None or not cases or result.timed_out):
        case = ET.Element("testcase", classname=classname, name="job")
        if result.timed_out:
            what = "cancelled" if result.cancelled else "still " + result.state
            ET.SubElement(case, "error", type="timeout", message=f"timed out waiting for job {result.job_id} ({what})")
        else:
            e = result.error
            message = f"{result.state}" + (f" during {e.stage} ({e.code}): {e.message}" if e else "")
            ET.SubElement(case, "failure" if result.state == "FAILED" else "error",
                          type=(e.code if e and e.code else result.state.lower()), message=message)
        cases.append(case)
    suite.extend(cases)
    suite.set("tests", str(len(cases)))
    suite.set("failures", str(sum(1 for c in cases if c.find("failure") is not None)))
    suite.set("errors", str(sum(1 for c in cases if c.find("error") is not None)))
    suite.set("skipped", str(sum(1 for c in cases if c.find("skipped") is not None)))
    root = ET.Element("testsuites", name="fxport")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(result: JobResult, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(junit_xml(result))


def _md(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def step_summary(result: JobResult) -> str:
    """The markdown summary: the job, its artifacts and verdicts, what was not built, the pick."""
    icon = {"SUCCEEDED": "✅", "FAILED": "❌", "CANCELLED": "⚪"}.get(result.state, "⏳")
    lines = [f"### {icon} fxport {result.command}: job `{result.job_id}` {result.state}", ""]
    if result.timed_out:
        lines += [f"Timed out waiting; the job was {'cancelled' if result.cancelled else 'left ' + result.state}.", ""]
    if result.error is not None:
        e = result.error
        lines += [f"**Error** during {_md(e.stage or '?')} (`{_md(e.code or '?')}`): {_md(e.message)}", ""]
    checked = [a for a in [*result.artifacts, *result.withdrawn] if a.checks]
    if checked:
        lines += ["| artifact | runtime | verdict | max abs diff | cosine | sha256 |", "|---|---|---|---|---|---|"]
        for a in checked:
            for c in a.checks:
                diff = f"{c.max_abs_diff:.3g}" if c.max_abs_diff is not None else "—"
                cos = f"{c.cosine:.6f}" if c.cosine is not None else "—"
                scheme = f" (int8 for {c.scheme})" if c.scheme else ""
                lines.append(f"| `{_md(a.path)}` | {_md(c.runtime)}{scheme} | {c.verdict} | {diff} | {cos} | "
                             f"`{a.sha256[:12]}` |")
        lines.append("")
    others = [a for a in result.artifacts if not a.checks]
    if others:
        lines += [f"Also stored: {', '.join(f'`{_md(a.path)}`' for a in others)}.", ""]
    if result.withdrawn:
        withdrawn = ", ".join(f"`{_md(a.path)}`" for a in result.withdrawn)
        lines += [f"Not kept (a failed job keeps no model file): {withdrawn}.", ""]
    for t in result.failed_targets:
        lines.append(f"- **{_md(t.target)}** not built ({_md(t.stage)}): {_md(t.reason)}")
    if result.recommendation is not None:
        r = result.recommendation
        lines += ["", f"**Recommended:** {_md(r.artifact)} at batch {r.batch}: {_md(r.reason)}"]
    return "\n".join(lines).rstrip() + "\n\n"


def append_step_summary(result: JobResult, env: dict[str, str] | None = None) -> Path | None:
    """Append the summary to $GITHUB_STEP_SUMMARY when set; returns the file written, if any."""
    target = (os.environ if env is None else env).get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    path = Path(target)
    with open(path, "a", encoding="utf-8") as f:
        f.write(step_summary(result))
    return path
