"""The sandbox contains a model that misbehaves while it loads: no credentials, no network,
bounded memory and time — and the job fails naming the stage and the limit."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fxport.errors import FxportError, ResourceLimitExceeded
from fxport.spec import parse_spec
from fxport.workers.engine.request import EngineRequest
from fxport.workers.sandbox import run_engine_job
from tests.fixtures.servers import process_state, sandbox_pids, wait_until

SPEC = parse_spec({"inputs": [{"name": "x", "shape": [2, 4]}], "targets": ["onnx"], "passes": []})

# Misbehaves only inside the sandbox (which sets FXPORT_SANDBOX), so the test itself
# can build and package the model safely.
TEMPLATE = """
import os, torch
if os.environ.get("FXPORT_SANDBOX"):
{payload}
class Hostile(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.fc(x)
"""


def _failures(reason: str) -> float:
    from fxport.metrics import METRICS

    return METRICS.sandbox_failures_total.labels(reason)._value.get()


def hostile_package(tmp_path: Path, name: str, payload: str) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / f"{name}.py").write_text(TEMPLATE.format(payload=textwrap.indent(textwrap.dedent(payload), "    ")))
    sys.path.insert(0, str(src))
    try:
        module = importlib.import_module(name)
        from torch.package import PackageExporter

        path = tmp_path / f"{name}.pkg"
        with PackageExporter(str(path)) as exporter:
            exporter.extern("torch.**")
            exporter.intern(name)
            exporter.save_pickle("model", "model.pkl", module.Hostile().eval())
        return path
    finally:
        sys.path.remove(str(src))
        sys.modules.pop(name, None)


def test_environment_is_scrubbed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("FXPORT_BROKER_URL", "redis://:pw@127.0.0.1:1/0")
    model = hostile_package(tmp_path, "leak_env", """
        raise RuntimeError("ENV=" + ";".join(f"{k}={v}" for k, v in os.environ.items()))
    """)
    with pytest.raises(FxportError) as info:
        run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out", job_id="t-env"))
    text = str(info.value)
    assert "ENV=" in text  # the payload ran, inside the sandbox
    assert "s3cr3t" not in text and "AWS_SECRET" not in text and "FXPORT_BROKER_URL" not in text
    assert info.value.stage == "load"


def test_no_network_even_to_loopback(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    port = listener.getsockname()[1]
    try:
        model = hostile_package(tmp_path, "dial_out", f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2).close()
                raise RuntimeError("NET=reached")
            except OSError as exc:
                raise RuntimeError(f"NET=blocked {{exc}}")
        """)
        with pytest.raises(FxportError) as info:
            run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out", job_id="t-net"))
    finally:
        listener.close()
    assert "NET=blocked" in str(info.value), str(info.value)


def test_unbounded_allocation_hits_the_memory_limit(tmp_path: Path) -> None:
    model = hostile_package(tmp_path, "eat_memory", """
        hog = [bytearray(256 << 20) for _ in range(10_000)]
    """)
    spec = SPEC.model_copy(update={"limits": SPEC.limits.model_copy(update={"memory_mb": 3072})})
    before = _failures("memory")
    with pytest.raises(ResourceLimitExceeded) as info:
        run_engine_job(EngineRequest(model_path=model, spec=spec, out_dir=tmp_path / "out", job_id="t-mem"))
    assert "memory" in str(info.value) and info.value.stage == "load"
    assert _failures("memory") == before + 1  # fxport_sandbox_failures_total{reason="memory"}


def test_a_hang_is_killed_at_the_wall_clock_limit(tmp_path: Path) -> None:
    model = hostile_package(tmp_path, "hang", """
        import time
        time.sleep(3600)
    """)
    before = _failures("timeout")
    with pytest.raises(ResourceLimitExceeded) as info:
        run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out", job_id="t-hang",
                                     timeout_s=8))
    assert _failures("timeout") == before + 1
    assert "8 s wall-clock limit during load" in str(info.value)


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_thread_the_model_leaves_running_does_not_hold_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  mode: str) -> None:
    """Once the engine has written its result the child ends, whatever the model left behind:
    a non-daemon thread would make a normal interpreter exit wait for it until the job's
    wall-clock limit (generous here, so a child that waits fails the job instead of the suite)."""
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", mode)
    model = hostile_package(tmp_path, f"linger_{mode}", """
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    """)
    manifest = run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out",
                                            job_id=f"t-linger-{mode}", timeout_s=240)).to_dict()
    assert manifest["verification"][0]["passed"]
    assert (tmp_path / "out" / "model.onnx").is_file()


def _running(pid: int) -> bool:
    return process_state(pid) not in ("Z", "X", None)


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_hung_sandbox_dies_with_the_worker_that_started_it(tmp_path: Path, mode: str) -> None:
    """A worker process killed outright (Celery's hard time limit, the OOM killer) leaves no
    sandbox behind: the hung model's process goes with it."""
    model = hostile_package(tmp_path, f"hang_orphan_{mode}", """
        import time
        time.sleep(3600)
    """)
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from fxport.spec import parse_spec; "
         "from fxport.workers.sandbox import run_engine_job; from fxport.workers.engine.request import EngineRequest; "
         "run_engine_job(EngineRequest(model_path=Path(sys.argv[1]), spec=parse_spec({'inputs': [{'name': 'x', "
         "'shape': [2, 4]}], 'targets': ['onnx']}), out_dir=Path(sys.argv[2]), job_id='t-orphan', timeout_s=600))",
         str(model), str(tmp_path / "out")],
        env={**os.environ, "FXPORT_SANDBOX_MODE": mode}, cwd=Path(__file__).resolve().parents[2])
    try:
        (box,) = wait_until(lambda: sandbox_pids(worker.pid, "t-orphan"), 120, "the sandbox to start")
        time.sleep(1.0)  # inside the model's sleep by now
        assert _running(box)
    finally:
        worker.kill()
        worker.wait()
    wait_until(lambda: not _running(box), 15, "the sandbox to die with its worker")


def test_the_zygote_kills_a_child_its_worker_lost_track_of(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The zygote's backstop: a child still running its wall-clock limit plus BACKSTOP_GRACE_S
    after the fork is killed, even if the worker never does (here the worker waits 600 s)."""
    from fxport.workers.sandbox import launch

    monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
    monkeypatch.setattr(launch, "BACKSTOP_GRACE_S", 4.0 - 600)  # the backstop strikes at 4 s
    model = hostile_package(tmp_path, "hang_backstop", """
        import time
        time.sleep(3600)
    """)
    started = time.monotonic()
    with pytest.raises(FxportError) as info:
        run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out", job_id="t-backstop",
                                     timeout_s=600))
    assert time.monotonic() - started < 60
    assert "SIGKILL" in str(info.value) or "killed" in str(info.value), info.value


def test_a_time_limit_while_the_zygote_starts_is_not_swallowed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Celery raises its soft time limit wherever the task is, e.g. waiting for the zygote to come
    up: that must end the job, not fall back to a cold sandbox that no clock watches."""
    from billiard.exceptions import SoftTimeLimitExceeded

    from fxport.workers.sandbox import launch

    class Starting:
        def launch(self, *args: object) -> None:
            raise SoftTimeLimitExceeded()

    cold: list[object] = []
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
    monkeypatch.setattr(launch, "warm_sandbox", lambda: Starting())
    monkeypatch.setattr(launch, "_ColdLaunch", lambda *args: cold.append(args))
    with pytest.raises(SoftTimeLimitExceeded):
        launch.launch(tmp_path / "request.json", {}, tmp_path / "log", 10.0)
    assert cold == []


@pytest.mark.parametrize("mode", ["warm", "cold"])
def test_a_good_model_still_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", mode)
    model = hostile_package(tmp_path, f"benign_{mode}", "pass")
    request = EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / "out", job_id="t-ok")
    manifest = run_engine_job(request).to_dict()
    assert manifest["verification"][0]["passed"]
    assert manifest["sandbox"]["memory_limit_mb"] == SPEC.limits.memory_mb
    assert (tmp_path / "out" / "model.onnx").is_file()


def _memory_kib(pid: int) -> dict[str, int]:
    rows = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    return {k: int(v.split()[0]) for k, v in (row.split(":", 1) for row in rows)}


@pytest.mark.parametrize("huge", [True, False], ids=["huge pages", "small pages"])
def test_the_zygote_forks_from_huge_pages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, huge: bool) -> None:
    """Warm, the zygote moves its heap (~0.3 GB: the imported ML stack) onto 2 MiB pages, so a
    fork copies, and a child's exit tears down, a few hundred page-table entries instead of
    ~85k. Its children convert as before."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if huge and (not thp.exists() or "[never]" in thp.read_text()):
        pytest.skip("transparent huge pages are off on this machine ([never]): the zygote keeps small pages")
    from fxport.workers.sandbox import launch

    monkeypatch.setattr(launch, "SANDBOX_HUGE_PAGES", huge)
    zygote = launch.WarmSandbox()
    try:
        with zygote._lock:
            proc = zygote._ensure()
        memory = _memory_kib(proc.pid)
        on_huge_pages = memory["AnonHugePages"] / memory["Anonymous"]
        if huge:
            assert on_huge_pages > 0.6, memory
            assert zygote.ready["huge_pages"]["huge_mib"] > 100, zygote.ready  # what it reports is what it holds
        elif thp.exists() and "[madvise]" in thp.read_text():
            # (only under [madvise]: under [always] the kernel may use huge pages for it anyway)
            assert on_huge_pages < 0.2, memory
        monkeypatch.setattr(launch, "_warm", zygote)
        monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
        manifest = run_engine_job(EngineRequest(model_path=hostile_package(tmp_path, "benign_huge", "pass"),
                                                spec=SPEC, out_dir=tmp_path / "out", job_id="t-huge")).to_dict()
        assert manifest["verification"][0]["passed"]
    finally:
        zygote.close()


def test_warm_children_use_all_threads_and_do_not_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a multithreaded conv net, twice through the same zygote: the fork-after-warm-up must not deadlock
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
    monkeypatch.setenv("FXPORT_SANDBOX_THREADS", "2")
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2, spec_dict

    case = get("resnet18_small")
    model = save_pt2(case, tmp_path / "r.pt2")
    spec = parse_spec(spec_dict(case, targets=("onnx",)))
    for i in range(2):
        manifest = run_engine_job(EngineRequest(model_path=model, spec=spec, out_dir=tmp_path / f"out{i}",
                                                job_id=f"t-r{i}", timeout_s=120)).to_dict()
        assert manifest["verification"][0]["passed"]


def test_thread_budget_follows_a_cgroup_cpu_limit(tmp_path: Path) -> None:
    from fxport.workers.sandbox import available_cpus

    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a Kubernetes limit of 1.5 CPUs
    assert available_cpus(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("10000 100000\n")
    assert available_cpus(tmp_path) == 1
    assert available_cpus(tmp_path / "no-cgroup") == affinity


def test_each_job_gets_its_share_of_the_cpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A worker running two jobs at once gives each half the CPUs it may use, never all of them
    (two jobs at two threads each on two cores spin in torch's thread pool: 9x slower)."""
    from fxport.workers.sandbox import launch

    monkeypatch.delenv("FXPORT_SANDBOX_THREADS", raising=False)
    monkeypatch.setattr(launch, "available_cpus", lambda: 8)
    for slots, threads in ((None, 8), ("1", 8), ("2", 4), ("3", 2), ("16", 1)):
        if slots is None:
            monkeypatch.delenv("FXPORT_WORKER_CONCURRENCY", raising=False)
        else:
            monkeypatch.setenv("FXPORT_WORKER_CONCURRENCY", slots)
        assert launch.job_threads() == threads, slots
        assert launch.scrubbed_env(tmp_path)["OMP_NUM_THREADS"] == str(threads)
    monkeypatch.setenv("FXPORT_SANDBOX_THREADS", "3")  # the operator's word wins
    assert launch.scrubbed_env(tmp_path)["OMP_NUM_THREADS"] == "3"
    # a waiting OpenMP thread sleeps soon instead of spinning for a core another process holds
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert launch.scrubbed_env(tmp_path)["GOMP_SPINCOUNT"] == launch.SANDBOX_GOMP_SPINCOUNT == "10000"
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")
    assert launch.scrubbed_env(tmp_path)["GOMP_SPINCOUNT"] == "500"


def test_fxport_worker_tells_its_jobs_its_concurrency(monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from fxport.cli import commands as cli

    seen: dict[str, str | None] = {}
    monkeypatch.setenv("FXPORT_WORKER_CONCURRENCY", "1")  # the command sets it: restored after the test
    monkeypatch.setenv("FXPORT_BROKER_URL", "redis://127.0.0.1:1/0")  # never reached: worker_main is the stand-in
    from fxport.workers.celery_app import app as celery_app

    monkeypatch.setattr(celery_app, "worker_main",
                        lambda argv: seen.update(env=os.environ.get("FXPORT_WORKER_CONCURRENCY"), argv=" ".join(argv)))
    result = CliRunner().invoke(cli.app, ["worker", "-c", "3"])
    assert result.exit_code == 0, result.output
    assert seen["env"] == "3" and "-c 3" in str(seen["argv"])


def test_onnxruntime_sessions_keep_to_the_torch_thread_budget() -> None:
    import torch

    from fxport.workers.engine.verify.runners import ort_session_options

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert ort_session_options().intra_op_num_threads == 1
        torch.set_num_threads(2)
        assert ort_session_options().intra_op_num_threads == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_a_required_layer_that_cannot_be_had_fails_closed_before_the_model_runs(tmp_path: Path) -> None:
    """FXPORT_SANDBOX_REQUIRE names layers without which no model runs. A worker without
    CAP_SYS_ADMIN (a Kubernetes pod) cannot give its child a network namespace: a worker that
    requires one refuses every job, naming the layer, before the model is read."""
    model = hostile_package(tmp_path, "never_runs", """
        raise RuntimeError("PAYLOAD RAN")
    """)
    script = ("import sys; from pathlib import Path; from fxport.spec import parse_spec; "
              "from fxport.workers.sandbox import run_engine_job\n"
              "from fxport.workers.engine.request import EngineRequest\n"
              "try:\n"
              "    run_engine_job(EngineRequest(model_path=Path(sys.argv[1]), spec=parse_spec({'inputs': [{'name': "
              "'x', 'shape': [2, 4]}], 'targets': ['onnx']}), out_dir=Path(sys.argv[2]), job_id='t-require'))\n"
              "except Exception as exc:\n"
              "    print(f'{exc.code}: {exc}')\n")
    res = subprocess.run(["setpriv", "--bounding-set", "-sys_admin", "--", sys.executable, "-c", script, str(model),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "FXPORT_SANDBOX_MODE": "cold",
                              "FXPORT_SANDBOX_REQUIRE": "seccomp,landlock,network_namespace"},
                         cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("sandbox_unavailable: the sandbox refused to run the model: the network_namespace "
                                 "layer(s) the worker requires could not be applied"), res.stdout
    assert "PAYLOAD RAN" not in res.stdout


INHERITS = r"""
import json, mmap, os, sys
from pathlib import Path
from fxport.spec import parse_spec
from fxport.workers.sandbox.child import run_request
work = Path(sys.argv[1])
os.mkfifo(work / "events")
reader = os.open(work / "events", os.O_RDWR | os.O_NONBLOCK)  # the worker's end
(work / "request.json").write_text(json.dumps({
    "engine": {"model_path": sys.argv[2], "spec": parse_spec({"targets": ["onnx"]}).normalized(),
               "out_dir": str(work / "out"), "job_id": "t-inherit"},
    "limits": {"memory_bytes": 8 << 30, "cpu_seconds": 60, "isolate_network": False},
    "events_path": str(work / "events"), "readable": [], "require": []}))
(work / "out").mkdir()
held = os.open(work / "lock", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(held, 4096)
lock = mmap.mmap(held, 4096, mmap.MAP_SHARED)  # as a semaphore a warm parent's library made
child = os.fork()  # as the zygote forks a job's child
if child == 0:
    os._exit(run_request(str(work / "request.json")))
os.waitpid(child, 0)
print((work / "result.json").read_text())
"""


def test_a_child_holding_a_writable_shared_mapping_refuses_to_run_the_model(tmp_path: Path, tiny_pt2: Path) -> None:
    """The warm parent must leave its children nothing to share: should it ever hold a writable
    shared mapping again (tqdm's lock once was one), the child refuses before the model is read."""
    res = subprocess.run([sys.executable, "-c", INHERITS, str(tmp_path), str(tiny_pt2)], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert not result["ok"] and result["error"]["code"] == "sandbox_unavailable", result
    message = result["error"]["message"]
    assert "writable shared mapping" in message and str(tmp_path / "lock") in message
    assert not (tmp_path / "out" / "model.onnx").exists()


def test_killing_a_jobs_sandbox_kills_that_job_only(tmp_path: Path) -> None:
    """A cancel or a lost lease kills the children this worker started for that job (kept by
    job id while they run), found without asking any child: a child that wrote another job's
    id into its request.json changes nothing."""
    from fxport.workers.jobs import kill_sandboxes_of
    from fxport.workers.sandbox import launch

    model = hostile_package(tmp_path, "hang_for_kill", """
        import json, time
        with open("request.json") as f:
            request = json.load(f)
        request["engine"]["job_id"] = "t-kill-b"  # claims to be the other job
        with open("request.json", "w") as f:
            json.dump(request, f)
        time.sleep(3600)
    """)
    outcome: dict[str, BaseException] = {}

    def run(job: str) -> None:
        try:
            run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / job, job_id=job,
                                         timeout_s=300))
        except BaseException as exc:  # noqa: BLE001 - what ended it is the finding
            outcome[job] = exc

    threads = {job: threading.Thread(target=run, args=(job,), daemon=True) for job in ("t-kill-a", "t-kill-b")}
    for t in threads.values():
        t.start()
    wait_until(lambda: {"t-kill-a", "t-kill-b"} <= set(launch._running), 120, "both sandboxes to start")
    children = {job: [child.pid for child in launch._running[job]] for job in ("t-kill-a", "t-kill-b")}
    # Both models have loaded once both request.json files name job b.
    wait_until(lambda: len(sandbox_pids(os.getpid(), "t-kill-b")) == 2, 120, "both models to load")
    assert kill_sandboxes_of("t-kill-a") == 1
    threads["t-kill-a"].join(30)
    assert not threads["t-kill-a"].is_alive() and "t-kill-a" in outcome
    assert not any(_running(pid) for pid in children["t-kill-a"])
    assert threads["t-kill-b"].is_alive() and all(_running(pid) for pid in children["t-kill-b"])
    assert kill_sandboxes_of("t-kill-c") == 0
    assert kill_sandboxes_of("t-kill-b") == 1
    threads["t-kill-b"].join(30)
    assert not threads["t-kill-b"].is_alive()
