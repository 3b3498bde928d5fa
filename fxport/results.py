"""What `--json` prints: one versioned result document for every command that ends with a job.

`fxport convert`, `fxport submit` (with and without --wait), `fxport jobs watch` and `fxport jobs
get` print a `JobResult`; its JSON Schema is `fxport schema result` (docs/result.schema.json).
A pipeline reads one shape whichever way the job ran: the job id, its state as the API names it
(`SUCCEEDED`), times in RFC 3339 (UTC), one entry per artifact with its path, sha256 and
verification verdict, the targets that were not built, and the error with its stage and code.
A failed job keeps no model file (README, "What a conversion does"): what it built is listed
under `withdrawn`, with its checks, and `artifacts` holds only what is there to fetch.
The exit code the command returns is in it too, so a step that captured stdout alone can branch.

Versioning: `schema_version` changes only when a field is removed, renamed or retyped; fields
are added without a change, so a reader must ignore keys it does not know.

The same facts feed the JUnit report and the CI step summary (fxport/ci_report.py). The manifest
is read through its type (fxport/manifest.py), leniently: a section of another shape costs only
what it holds.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from fxport.errors import ErrorRecord
from fxport.manifest import Manifest, VerificationRecord, read_leniently

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
    artifacts: list[ArtifactResult] = Field(default_factory=list, description="What the job keeps: the files in "
                                            "the output folder (convert --out) or stored with the job.")
    withdrawn: list[ArtifactResult] = Field(default_factory=list, description="What the job built but did not "
                                            "keep: a failed job keeps no model file; its manifest lists these.")
    failed_targets: list[FailedTarget] = Field(default_factory=list, description="Requested targets that could not "
                                               "be built, with why. The job failed, unless it set allow_partial.")
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


def _manifest(manifest: Manifest | Mapping[str, Any] | None) -> Manifest:
    """The manifest as its type; one read from a file or the server is read leniently (a section of
    another shape is left out, not the result)."""
    if isinstance(manifest, Manifest):
        return manifest
    return read_leniently(manifest or {})[0]


def _reason(v: VerificationRecord) -> str | None:
    if v.error:
        return v.error
    found = [i for i in v.inconclusive or () if isinstance(i, Mapping)]
    return "; ".join(f"{i.get('output')}: {i.get('reference')}" for i in found) or None


def _checks(manifest: Manifest, fmt: str, scheme: str | None = None) -> list[Check]:
    checks = []
    for v in manifest.verification:
        if v.format != fmt:
            continue
        verdict = v.verdict or ("passed" if v.passed else "failed")
        tol: Mapping[str, Any] = v.tolerances or {}
        allowed = {k: float(tol[k]) for k in ("atol", "rtol", "scale_atol", "min_cosine", "min_top1_agreement")
                   if isinstance(tol.get(k), int | float)}
        checks.append(Check(runtime=v.runtime, scheme=scheme, verdict=verdict, max_abs_diff=v.max_abs_diff,
                            max_rel_diff=v.max_rel_diff, cosine=v.cosine, allowed=allowed,
                            shapes_checked=len(v.shapes_checked), reason=_reason(v)))
    return checks


def _artifact_verdict(checks: Sequence[Check]) -> Verdict:
    if not checks:
        return "not_checked"
    verdicts = {c.verdict for c in checks}
    return "failed" if "failed" in verdicts else "inconclusive" if "inconclusive" in verdicts else "passed"


def artifacts_of(manifest: Manifest | Mapping[str, Any]) -> list[ArtifactResult]:
    """Every artifact the manifest lists, each with the checks of its format."""
    m = _manifest(manifest)
    out = []
    for a in m.artifacts:
        checks = _checks(m, a.format, a.int8_scheme)
        out.append(ArtifactResult(path=a.path, format=a.format, bytes=a.bytes, sha256=a.sha256,
                                  verdict=_artifact_verdict(checks), checks=checks))
    return out


def _error(error: Mapping[str, Any] | ErrorRecord | None) -> ErrorResult | None:
    if not error:
        return None
    e = error.model_dump() if isinstance(error, ErrorRecord) else error
    return ErrorResult(stage=e.get("stage") or None, code=e.get("code") or None,
                       message=str(e.get("message") or ""), hint=e.get("hint") or None,
                       field=e.get("field") or None)


def _recommendation(manifest: Manifest) -> Recommendation | None:
    pick = manifest.benchmark.recommendation if manifest.benchmark else None
    if pick is None or not pick.artifact:
        return None
    return Recommendation(artifact=pick.artifact, batch=pick.batch, reason=pick.reason)


def from_manifest(command: str, manifest: Manifest | Mapping[str, Any], *, exit_code: int,
                  manifest_path: str | None = None, started: float | None = None,
                  finished: float | None = None, kept: Collection[str] | None = None) -> JobResult:
    """`fxport convert`'s result: everything from the manifest it wrote. `kept`: the paths of the
    manifest's artifacts still in the output folder; by default every one of a job that did not
    fail and none of one that did. The others are `withdrawn`."""
    m = _manifest(manifest)
    status = m.status if "status" in m.model_fields_set else None
    state: JobStateName = "SUCCEEDED" if status == "succeeded" else "FAILED" if status == "failed" else "RUNNING"
    built = artifacts_of(m)
    if kept is None:
        kept = {a.path for a in built} if state != "FAILED" else set()
    return JobResult(
        command=command, job_id=m.job_id, state=state, stage=m.error.stage if m.error else None,
        exit_code=exit_code, created_at=timestamp(started), started_at=timestamp(started),
        finished_at=timestamp(finished), labels=dict(m.spec.get("labels") or {}),
        artifacts=[a for a in built if a.path in kept], withdrawn=[a for a in built if a.path not in kept],
        failed_targets=_failed_targets(m), error=_error(m.error), recommendation=_recommendation(m),
        manifest=manifest_path)


def _failed_targets(manifest: Manifest) -> list[FailedTarget]:
    return [FailedTarget(target=t.target, stage=t.stage, reason=t.reason) for t in manifest.failed_targets]


def from_job(command: str, job: Mapping[str, Any], *, exit_code: int,
             manifest: Manifest | Mapping[str, Any] | None = None, timed_out: bool = False, cancelled: bool = False,
             upload: Mapping[str, Any] | None = None, downloaded: Sequence[str] = (),
             manifest_path: str | None = None) -> JobResult:
    """A server job's result: `job` is Job.to_dict(); `manifest`, when fetched, adds the checks,
    the targets not built, what a failed job built but did not keep, and the recommendation."""
    checks_from = _manifest(manifest)
    by_path = {a.path: a for a in artifacts_of(checks_from)}
    stored = {a["name"] for a in job.get("artifacts") or ()}
    withdrawn = [a for path, a in by_path.items() if path not in stored] if job.get("state") == "FAILED" else []
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
        withdrawn=withdrawn, failed_targets=_failed_targets(checks_from), error=_error(job.get("error")),
        recommendation=_recommendation(checks_from), upload=UploadResult(**upload) if upload else None,
        downloaded=list(downloaded), manifest=manifest_path)
