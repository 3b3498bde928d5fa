"""`fxport package`: deployment packages from a job's folder, offline, from the client install.

    fxport package triton JOB_DIR --name NAME --out REPO     a Triton model repository
    fxport package kserve REPO --name NAME --storage-uri URI  a KServe InferenceService for it

JOB_DIR is what `fxport convert --out` or `fxport jobs download` wrote (manifest.json and the
artifacts). Exit 0 when written, 2 when refused (the message names the field and what to do).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Console

from fxport.cli.errors import error_doc, print_error
from fxport.errors import EXIT_OK, FxportError

package_app = typer.Typer(no_args_is_help=True, help="Deployment packages from a job's verified artifacts: a "
                          "Triton model repository, a KServe InferenceService.")
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fail(command: str, exc: FxportError, as_json: bool) -> None:
    print_error(_err, command, exc)
    if as_json:
        sys.stdout.write(json.dumps(error_doc(command, exc), indent=2) + "\n")
    raise typer.Exit(exc.exit_code or 2) from None


@package_app.command("triton")
def triton_command(
    job_dir: Path = typer.Argument(..., help="A job's folder: `fxport convert --out` or `fxport jobs download`."),
    name: str = typer.Option("model", "--name", help="Model name; each artifact's model is NAME_<format>."),
    out: Path = typer.Option(..., "--out", "-o", help="The repository folder to write (new or empty)."),
    as_json: bool = typer.Option(False, "--json", help="Print what was written as one JSON document."),
) -> None:
    """Write a Triton model repository: one model per verified onnx, torchscript or tensorrt artifact,
    each config checked against Triton's ModelConfig, with sample requests and a model card."""
    from fxport.serving.triton import write_triton_repository

    try:
        package = write_triton_repository(job_dir, name, out)
    except FxportError as exc:
        _fail("package triton", exc, as_json)
    if as_json:
        sys.stdout.write(json.dumps({"repository": str(out), **package.to_dict()}, indent=2) + "\n")
    else:
        for model in package.models:
            mark = "  (recommended)" if model.recommended else ""
            _err.print(f"  {model.name}: {model.artifact}, max_batch_size {model.max_batch_size}, {model.kind}{mark}")
        for fmt, why in package.skipped.items():
            _err.print(f"  not served: {fmt}: {why}")
        for note in package.notes:
            _err.print(f"  note: {note}")
        _err.print(f"ok: Triton repository in {out}/ (configs checked against {package.validated_with})")
    raise typer.Exit(EXIT_OK)


@package_app.command("kserve")
def kserve_command(
    repository: Path = typer.Argument(..., help="The Triton repository (`fxport package triton --out`, or a "
                                      "job's triton/ folder)."),
    name: str = typer.Option(..., "--name", help="The InferenceService's name (lowercase, digits, '-')."),
    storage_uri: str | None = typer.Option(None, "--storage-uri", help="Where the repository is in the object "
                                           "store, s3://BUCKET/PATH."),
    store: str | None = typer.Option(None, "--store", help="The server's FXPORT_STORE (s3://BUCKET or "
                                     "s3://BUCKET/PREFIX): with --tenant, the storage URI of the job's own triton/ "
                                     "folder."),
    tenant: str | None = typer.Option(None, "--tenant", help="The job's tenant, with --store."),
    namespace: str | None = typer.Option(None, "--namespace", help="metadata.namespace."),
    service_account: str | None = typer.Option(None, "--service-account", help="The service account holding "
                                               "the store's credentials (KServe's S3 secret annotations)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the YAML here (default: stdout)."),
) -> None:
    """Write a KServe InferenceService (serving.kserve.io/v1beta1) serving the repository with Triton."""
    from fxport.errors import InvalidInput
    from fxport.serving.kserve import inference_service, inference_service_yaml
    from fxport.serving.kserve import storage_uri as job_uri
    from fxport.serving.triton import read_job

    try:
        job_id = None
        for folder in (repository, repository.parent):
            if (folder / "manifest.json").is_file():
                job_id = read_job(folder).job_id
                break
        if storage_uri is None:
            if not (store and tenant and job_id):
                raise InvalidInput("give --storage-uri, or --store and --tenant of a job's folder (its manifest.json "
                                   "names the job)", field="storage_uri")
            storage_uri = job_uri(store, tenant, job_id)
        service = inference_service(repository / "triton" if (repository / "triton").is_dir() else repository,
                                    name, storage_uri, namespace=namespace, job_id=job_id,
                                    service_account=service_account)
    except FxportError as exc:
        _fail("package kserve", exc, False)
    text = inference_service_yaml(service)
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        _err.print(f"ok: InferenceService {name} in {out}; kubectl apply -f {out}")
    raise typer.Exit(EXIT_OK)
