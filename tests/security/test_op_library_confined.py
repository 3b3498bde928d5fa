"""An op library's own start-up code (FXPORT_OP_LIBRARIES) runs inside the sandbox, like the model.

The child loads the operator's libraries after its layers are applied (workers/sandbox/child.py),
so a library that misbehaves as it loads (a build pulled from somewhere, a compromised wheel)
gets no more than a model would. The probe library (tests/workers/op_library.py) opens a TCP
socket, reads a file outside the job's folder and forks as it loads, and aborts the process if
any of it works: loaded unconfined it aborts (the probe works); loaded by a worker's sandbox
the job succeeds.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.servers import scaled
from tests.workers.op_library import CACHE, build, save_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the probe library, a model that calls its op); the secret lies outside any job's folder."""
    base = tmp_path_factory.mktemp("op-probe")
    secret = base / "secret.txt"
    secret.write_text("the worker's secret")
    lib = build(base / "build", defines=(f'FXTEST_PROBE_SECRET="{secret}"',))
    return lib, base


def test_the_probe_escapes_where_nothing_confines_it(probe: tuple[Path, Path]) -> None:
    lib, _ = probe
    proc = subprocess.run([sys.executable, "-c", f"import torch; torch.ops.load_library({str(lib)!r})"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGABRT
    assert "fxtest probe escaped: 7" in proc.stderr  # socket, the secret and fork all worked


# As the isolation tests run their workers: with every capability the container has, and with
# CAP_SYS_ADMIN dropped as in a Kubernetes pod (no network namespace: seccomp and Landlock alone).
MODES = {"full capabilities": [], "no CAP_SYS_ADMIN": ["setpriv", "--bounding-set", "-sys_admin", "--"]}

RUN_CONFINED = """
import json, sys
from pathlib import Path
from fxport.spec import parse_spec
from fxport.workers.engine.request import EngineRequest
from fxport.workers.sandbox import run_engine_job
lib, model, out = sys.argv[1:4]
spec = parse_spec({"inputs": [{"name": "x", "shape": [2, 3]}], "targets": ["torchscript"]})
manifest = run_engine_job(EngineRequest(model_path=Path(model), spec=spec, out_dir=Path(out), job_id="t-probe"),
                          op_libraries=[lib], warm=False)
print(json.dumps({"libraries": manifest.toolchain["op_libraries"],
                  "verdicts": [v.verdict for v in manifest.verification],
                  "sockets_blocked": manifest.sandbox.sockets_blocked,
                  "network_isolated": manifest.sandbox.network_isolated}))
"""


@pytest.mark.parametrize("mode", list(MODES))
def test_an_op_librarys_start_up_code_runs_confined(probe: tuple[Path, Path], tmp_path: Path, mode: str) -> None:
    lib, _ = probe
    if MODES[mode] and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    # Saving the model loads the library unconfined, which the probe would abort: a clean build saves it.
    model = save_model(build(CACHE), tmp_path / "twice.ts")
    proc = subprocess.run([*MODES[mode], sys.executable, "-c", RUN_CONFINED, str(lib), str(model),
                           str(tmp_path / "out")], capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["libraries"][0]["library"] == str(lib)  # loaded, and nothing it tried worked
    assert seen["verdicts"] == ["passed"] and seen["sockets_blocked"] is True
    assert seen["network_isolated"] is (not MODES[mode])  # no namespace without CAP_SYS_ADMIN: seccomp holds alone
