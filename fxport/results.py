"""What `--json` prints: one versioned result document for every command that ends with a job.

`fxport convert`, `fxport submit` (with and without --wait), `fxport jobs watch` and `fxport jobs
get` print a `JobResult`; its JSON Schema is `fxport schema result` (docs/result.schema.json).
A pipeline reads one shape whichever way the job ran: the job id, its state as the API names it
(`SUCCEEDED`), times in RFC 3339 (UTC), one entry per artifact with its path, sha256 and
verification verdict, the targets that were not built, and the error with its stage and code.
The exit code the command returns is in it too, so a step that captured stdout alone can branch.

Versioning: `schema_version` changes only when a field is removed, renamed or retyped; fields
are added without a change, so a reader must ignore keys it does not know.

The same facts feed the JUnit report and the CI step summary (fxport/ci_report.py).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

RESULT_SCHEMA_VERSION: Literal[1] = 1
JobStateName = Literal["QUEUED", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
Verdict = Literal["passed", "failed", "inconclusive", "not_checked"]


class _Doc(BaseModel):
    model_config = ConfigDict(extra="ignore")  # a reader ignores keys it does not know: no additionalProperties


class Check(_Doc):
    """One verification of an artifact: in one runtime, for one precision scheme."""

    runtime: str | None = Field(None, description="The runtime the artifact ran in (onnxruntime, torch.jit, ...).")
    scheme: str | None = Field(None, description="The int8 scheme this check is for, when a job has two.")
    verdict: Literal["passed", "failed", "inconclusive"]
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    cosine: float | None = None
    allowed: dict[str, float] = Field(default_factory=dict, description="The tolerances the verdict used: "
                                      "atol, rtol, min_cosine, ...")
    shapes_checked: int = 0
    reason: str | None = Field(None, description="Why the verdict is inconclusive or failed, where one was recorded.")


class ArtifactResult(_Doc):
    path: str = Field(description="Relative to the output folder (convert --out, submit --out).")
    format: str
    bytes: int
    sha256: str
    verdict: Verdict = Field(description="passed: every check passed; failed: one failed; inconclusive: none "
                             "failed and one could not decide; not_checked: no check applies (a package file).")
    checks: list[Check] = Field(default_factory=list)


class FailedTarget(_Doc):
    target: str
    stage: str | None = None
    reason: str = ""


class ErrorResult(_Doc):
    stage: str | None = None
    code: str | None = None
    message: str = ""
    hint: str | None = None
    field: str | None = None


class Recommendation(_Doc):
    artifact: str
    batch: int | None = None
    reason: str = ""


class UploadResult(_Doc):
    sent_bytes: int = 0
    skipped: str | None = Field(None, description="cache_hit, model_stored, or null when the model was sent.")
    direct: bool = Field(False, description="The bytes went straight to the object store (a presigned PUT).")


class JobResult(_Doc):
    """The outcome of one job, as a command that ran or followed it saw it."""

    schema_version: Literal[1] = RESULT_SCHEMA_VERSION
    command: str = Field(description="convert, submit, jobs watch or jobs get.")
    job_id: str | None = Field(None, description="The server's job id; convert's is local-<hex>.")
    state: JobStateName = Field(description="The job's state when the command ended (its last known state after a "
                                "timeout).")
    stage: str | None = Field(None, description="The stage it was in, or failed in.")
    exit_code: int = Field(description="What the command exits with: 0 ok, 1 the job failed, 2 invalid input, "
                           "3 timed out, 4 server unreachable.")
    timed_out: bool = Field(False, description="--timeout passed before the job ended.")
    cancelled: bool = Field(False, description="--cancel-on-timeout cancelled the job after the timeout.")
    created_at: dt.datetime | None = None
    started_at: dt.datetime | None = None
    finished_at: dt.datetime | None = None
    cache_hit: bool = False
    labels: dict[str, str] = Field(default_factory=dict)
    artifacts: list[ArtifactResult] = Field(default_factory=list)
    failed_targets: list[FailedTarget] = Field(default_factory=list)
    error: ErrorResult | None = None
    recommendation: Recommendation | None = Field(None, description="The benchmark's pick, when it ran.")
    upload: UploadResult | None = None
    downloaded: list[str] = Field(default_factory=list, description="Files written by --out, sha256 checked.")
    manifest: str | None = Field(None, description="Path of the job's manifest.json, where the command has one.")

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)


def result_schema() -> dict[str, Any]:
    """The JSON Schema of `JobResult` (`fxport schema result`)."""
    schema = JobResult.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["$id"] = f"https://fxport.dev/schemas/result-v{RESULT_SCHEMA_VERSION}.json"
    return schema


def timestamp(value: float | str | None) -> dt.datetime | None:
    """An epoch (seconds) or an RFC 3339 string as an aware UTC datetime."""
    if value in (None, "", 0):
        return None
    if isinstance(value, str):
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).astimezone(dt.timezone.utc)
    return dt.datetime.fromtimestamp(float(value), tz=dt.timezone.utc)


def _reason(v: Mapping[str, Any]) -> str | None:
    if v.get("error"):
        return str(v["error"])
    found = [i for i in v.get("inconclusive") or () if isinstance(i, Mapping)]
    return "; ".join(f"{i.get('output')}: {i.get('reference')}" for i in found) or None


def _checks(manifest: Mapping[str, Any], fmt: str, scheme: str | None = None) -> list[Check]:
    checks = []
    for v in manifest.get("verification") or ():
        if not isinstance(v, Mapping) or v.get("format") != fmt:
            continue
        verdict = v.get("verdict") or ("passed" if v.get("passed") else "failed")
        tolerances = v.get("tolerances")
        tol: Mapping[str, Any] = tolerances if isinstance(tolerances, Mapping) else {}
        allowed = {k: float(tol[k]) for k in ("atol", "rtol", "scale_atol", "min_cosine", "min_top1_agreement")
                   if isinstance(tol.get(k), int | float)}
        checks.append(Check(runtime=v.get("runtime"), scheme=scheme, verdict=verdict,
                            max_abs_diff=v.get("max_abs_diff"), max_rel_diff=v.get("max_rel_diff"),
                            cosine=v.get("cosine"), allowed=allowed, shapes_checked=len(v.get("shapes_checked") or ()),
                            reason=_reason(v)))
    return checks


def _artifact_verdict(checks: Sequence[Check]) -> Verdict:
    if not checks:
        return "not_checked"
    verdicts = {c.verdict for c in checks}
    return "failed" if "failed" in verdicts else "inconclusive" if "inconclusive" in verdicts else "passed"


def artifacts_of(manifest: Mapping[str, Any]) -> list[ArtifactResult]:
    """Every artifact the manifest lists, each with the checks of its format."""
    out = []
    for a in manifest.get("artifacts") or ():
        if not isinstance(a, Mapping):
            continue
        checks = _checks(manifest, str(a.get("format")), a.get("int8_scheme"))
        out.append(ArtifactResult(path=str(a.get("path")), format=str(a.get("format")), bytes=int(a.get("bytes") or 0),
                                  sha256=str(a.get("sha256") or ""), verdict=_artifact_verdict(checks),
                                  checks=checks))
    return out


def _error(error: Mapping[str, Any] | None) -> ErrorResult | None:
    if not error:
        return None
    return ErrorResult(stage=error.get("stage") or None, code=error.get("code") or None,
                       message=str(error.get("message") or ""), hint=error.get("hint") or None,
                       field=error.get("field") or None)


def _recommendation(manifest: Mapping[str, Any]) -> Recommendation | None:
    rec = (manifest.get("benchmark") or {}).get("recommendation") if isinstance(manifest.get("benchmark"),
                                                                                Mapping) else None
    if not isinstance(rec, Mapping) or not rec.get("artifact"):
        return None
    return Recommendation(artifact=str(rec["artifact"]), batch=rec.get("batch"), reason=str(rec.get("reason") or ""))


def from_manifest(command: str, manifest: Mapping[str, Any], *, exit_code: int, manifest_path: str | None = None,
                  started: float | None = None, finished: float | None = None) -> JobResult:
    """`fxport convert`'s result: everything from the manifest it wrote."""
    status = manifest.get("status")
    state: JobStateName = "SUCCEEDED" if status == "succeeded" else "FAILED" if status == "failed" else "RUNNING"
    error = manifest.get("error") if isinstance(manifest.get("error"), Mapping) else None
    return JobResult(
        command=command, job_id=manifest.get("job_id"), state=state, stage=(error or {}).get("stage"),
        exit_code=exit_code, created_at=timestamp(started), started_at=timestamp(started),
        finished_at=timestamp(finished), labels=dict((manifest.get("spec") or {}).get("labels") or {}),
        artifacts=artifacts_of(manifest), failed_targets=_failed_targets(manifest), error=_error(error),
        recommendation=_recommendation(manifest), manifest=manifest_path)


def _failed_targets(manifest: Mapping[str, Any]) -> list[FailedTarget]:
    return [FailedTarget(target=str(t.get("target")), stage=t.get("stage"), reason=str(t.get("reason") or ""))
            for t in manifest.get("failed_targets") or () if isinstance(t, Mapping)]


def from_job(command: str, job: Mapping[str, Any], *, exit_code: int, manifest: Mapping[str, Any] | None = None,
             timed_out: bool = False, cancelled: bool = False, upload: Mapping[str, Any] | None = None,
             downloaded: Sequence[str] = (), manifest_path: str | None = None) -> JobResult:
    """A server job's result: `job` is Job.to_dict(); `manifest`, when fetched, adds the checks,
    the targets not built and the recommendation."""
    checks_from = manifest or {}
    by_path = {a.path: a for a in artifacts_of(checks_from)}
    artifacts = []
    for a in job.get("artifacts") or ():
        known = by_path.get(a["name"])
        checks = known.checks if known else _checks(checks_from, a["format"])
        artifacts.append(ArtifactResult(path=a["name"], format=a["format"], bytes=int(a["bytes"]), sha256=a["sha256"],
                                        verdict=_artifact_verdict(checks), checks=checks))
    return JobResult(
        command=command, job_id=job["id"], state=job["state"], stage=job.get("stage") or None, exit_code=exit_code,
        timed_out=timed_out, cancelled=cancelled, created_at=timestamp(job.get("created_at")),
        started_at=timestamp(job.get("started_at")), finished_at=timestamp(job.get("finished_at")),
        cache_hit=bool(job.get("cache_hit")), labels=dict(job.get("labels") or {}), artifacts=artifacts,
        failed_targets=_failed_targets(checks_from), error=_error(job.get("error")),
        recommendation=_recommendation(checks_from), upload=UploadResult(**upload) if upload else None,
        downloaded=list(downloaded), manifest=manifest_path)
