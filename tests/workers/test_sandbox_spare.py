"""The zygote's spare child (sandbox/spare.py): forked ahead of the next job, with a conversion's
copy-on-write faults already taken. What it relies on from the kernel, and that jobs really run
in it, convert, and keep running when it is gone."""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
from pathlib import Path

import pytest

from fxport.spec import parse_spec
from fxport.workers.engine.request import EngineRequest
from fxport.workers.sandbox import launch, run_engine_job
from fxport.workers.sandbox.spare import PAGE, Pages, exclusive_runs, in_forked_child, take_faults
from tests.fixtures.servers import descendants, process_state, wait_until
from tests.workers.test_sandbox import SPEC, hostile_package


def _in_child(fn) -> object:  # noqa: ANN001 - run fn in a forked child, return what it returns (JSON)
    status, result = in_forked_child(fn)
    assert status == 0, "the forked child failed"
    return result


@pytest.fixture
def shared_pages():  # noqa: ANN201 - (mapping, its address): 8 private pages, all present in this process
    region = mmap.mmap(-1, 8 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for i in range(8):
        region[i * PAGE] = i + 1
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    yield region, address


def test_a_forked_child_holds_alone_exactly_the_pages_it_wrote(shared_pages) -> None:  # noqa: ANN001
    """`learn_pages` relies on this: after a fork every page is shared; the ones the child then
    writes are its own (pagemap's exclusive flag), in runs."""
    region, address = shared_pages

    def write_three() -> list:
        before = exclusive_runs([(address, address + 8 * PAGE)])
        region[2 * PAGE] = 99
        region[5 * PAGE + 7] = 99
        region[6 * PAGE] = 99
        return [before, exclusive_runs([(address, address + 8 * PAGE)])]

    before, after = _in_child(write_three)
    assert before == []
    assert after == [[address + 2 * PAGE, PAGE], [address + 5 * PAGE, 2 * PAGE]]
    assert region[2 * PAGE] == 3  # the parent's copy is untouched


def test_a_spare_takes_the_faults_ahead_and_changes_no_byte(shared_pages, tmp_path: Path) -> None:  # noqa: ANN001
    """`take_faults` copies the pages into the child as a write would, without writing
    (MADV_POPULATE_WRITE): the child then holds them alone, with the parent's contents. And it
    maps file pages (code) the child has not touched yet (MADV_POPULATE_READ)."""
    region, address = shared_pages
    code = tmp_path / "code.bin"
    code.write_bytes(bytes(range(256)) * (4 * PAGE // 256))
    with code.open("rb") as f:
        text = mmap.mmap(f.fileno(), 4 * PAGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    text_address = next(int(line.split("-", 1)[0], 16) for line in Path("/proc/self/maps").read_text().splitlines()
                        if line.endswith(str(code)))

    def populate() -> list:
        file_before = exclusive_runs([(text_address, text_address + 4 * PAGE)], alone=False)
        refused = take_faults(Pages(write=[(address + PAGE, 3 * PAGE)], read=[(text_address + PAGE, 2 * PAGE)]))
        return [refused, exclusive_runs([(address, address + 8 * PAGE)]), [region[i * PAGE] for i in range(8)],
                file_before, exclusive_runs([(text_address, text_address + 4 * PAGE)], alone=False), text[PAGE]]

    refused, held, contents, file_before, file_after, byte = _in_child(populate)
    assert refused == 0, "this kernel refused MADV_POPULATE_WRITE or _READ (Linux 5.14+)"
    assert held == [[address + PAGE, 3 * PAGE]]
    assert contents == [1, 2, 3, 4, 5, 6, 7, 8]
    assert file_before == []  # a fork maps none of the parent's file pages
    # pages 1 and 2 mapped (the kernel may map their neighbours with them: fault-around)
    assert any(start <= text_address + PAGE and start + n >= text_address + 3 * PAGE for start, n in file_after), \
        file_after
    assert byte == 0


def _zygote_children(zygote_pid: int) -> list[int]:
    return [pid for pid in descendants(zygote_pid) if process_state(pid) not in ("Z", "X", None)]


def _spare_waiting(zygote_pid: int) -> int | None:
    """The zygote's spare once it has written its pages and blocks reading its request."""
    for pid in _zygote_children(zygote_pid):
        try:
            if "pipe_read" in Path(f"/proc/{pid}/wchan").read_text():
                return pid
        except OSError:
            continue
    return None


@pytest.fixture
def zygote(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a warm sandbox of this test's own, spares on
    monkeypatch.setattr(launch, "SANDBOX_SPARE", True)
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
    box = launch.WarmSandbox()
    with box._lock:
        box._ensure()
    monkeypatch.setattr(launch, "_warm", box)
    started: list[launch._WarmLaunch] = []
    real_register = launch.register

    def register(job_id: str, child: launch.Launch) -> None:
        if isinstance(child, launch._WarmLaunch):
            started.append(child)
        real_register(job_id, child)

    monkeypatch.setattr(launch, "register", register)
    box.started = started  # type: ignore[attr-defined]
    try:
        yield box
    finally:
        box.close()


def test_jobs_run_in_spare_children_that_the_zygote_learned_to_warm(zygote, tmp_path: Path) -> None:  # noqa: ANN001
    """The zygote learns which of its pages a conversion writes (thousands: the smallest job
    copies ~34 MiB), and each job starts in a spare forked ahead that wrote them; each job gets
    a fresh one, with every required layer applied, and converts."""
    learned = zygote.ready["spare"]
    assert learned["pages"] > 1000, learned
    model = hostile_package(tmp_path, "benign_spare", "pass")
    pids = []
    for i in range(3):
        wait_until(lambda: _spare_waiting(zygote._proc.pid), 60, "the spare to be ready")
        manifest = run_engine_job(EngineRequest(model_path=model, spec=SPEC, out_dir=tmp_path / f"out{i}",
                                                job_id=f"t-spare-{i}")).to_dict()
        assert manifest["verification"][0]["passed"]
        box = manifest["sandbox"]
        assert all(box[key] for key in ("no_new_processes", "sockets_blocked", "filesystem_reads_confined",
                                        "filesystem_writes_confined", "inherited_state_clean")), box
        assert "no_new_privs" in box["sources"]["measured_by_worker"], box  # the worker looked at the spare itself
        pids.append(zygote.started[-1].pid)
    assert [child.forked_ahead for child in zygote.started] == [True, True, True]
    assert len(set(pids)) == 3
    # Between jobs the zygote holds exactly one child: the next job's spare, ready.
    (waiting,) = _zygote_children(zygote._proc.pid)
    assert waiting not in pids


def test_a_spare_that_died_is_replaced_and_no_job_is_lost(zygote, tmp_path: Path) -> None:  # noqa: ANN001
    """A spare killed while it waits: the next job waits for a new one, converts, and its
    artifacts are byte for byte those of a job that found its spare ready (TorchScript keeps the
    Python stack of the trace in the file: every spare is forked from the same place)."""
    model = hostile_package(tmp_path, "benign_spare_killed", "pass")
    spec = parse_spec({**SPEC.model_dump(mode="json", exclude_unset=True), "targets": ["torchscript", "onnx"]})
    digests = []

    def convert(name: str) -> None:
        manifest = run_engine_job(EngineRequest(model_path=model, spec=spec, out_dir=tmp_path / name,
                                                job_id=f"t-{name}")).to_dict()
        assert all(check["passed"] for check in manifest["verification"]), manifest["verification"]
        digests.append({art["path"]: art["sha256"] for art in manifest["artifacts"]})

    convert("first")
    spare = wait_until(lambda: _spare_waiting(zygote._proc.pid), 60, "the next spare to be ready")
    os.kill(spare, signal.SIGKILL)
    wait_until(lambda: process_state(spare) in ("Z", "X", None), 30, "the spare to die")
    convert("after-kill")
    assert zygote.started[-1].forked_ahead is False  # a spare forked after the job came
    assert process_state(spare) is None  # reaped by the zygote, not left a zombie
    wait_until(lambda: _spare_waiting(zygote._proc.pid), 60, "the next spare to be ready")
    convert("next")
    assert zygote.started[-1].forked_ahead is True
    assert digests[0] == digests[1] == digests[2]
    assert {"model.ts", "model.onnx"} <= set(digests[0])


def test_spares_off_jobs_fork_as_before(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(launch, "SANDBOX_SPARE", False)
    monkeypatch.setenv("FXPORT_SANDBOX_MODE", "warm")
    box = launch.WarmSandbox()
    try:
        with box._lock:
            box._ensure()
        assert box.ready["spare"] == {}
        assert _zygote_children(box._proc.pid) == []
        monkeypatch.setattr(launch, "_warm", box)
        manifest = run_engine_job(EngineRequest(model_path=hostile_package(tmp_path, "benign_no_spare", "pass"),
                                                spec=SPEC, out_dir=tmp_path / "out", job_id="t-no-spare")).to_dict()
        assert manifest["verification"][0]["passed"]
    finally:
        box.close()
