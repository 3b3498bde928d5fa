"""A hostile model reaches nothing but its own job (docs/architecture.md, "Trust boundaries"), tried
as an attacker would.

Each way out a tenant's model once had is tried again from inside a real job, through the
real stack: an authenticated API, Redis, a Celery worker and its warm sandbox, SeaweedFS with
its unix sockets. Every test runs in two worker modes: with all capabilities, and with
CAP_SYS_ADMIN dropped from the worker's bounding set (`setpriv`), as in a Kubernetes pod,
where the sandbox gets no network namespace. Each asserts that the probe was refused and that
the next job of another tenant (bob) then converts in normal time.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fxport.client import Client
from fxport.service.auth import new_token, token_entry
from tests.fixtures.servers import (
    ManagedProcess,
    descendants,
    distributed_env,
    pool_children,
    scaled,
    start_api,
    start_worker,
    wait_until,
)
from tests.security.hostile import PACKAGE_SPEC, hostile_package, payload, thread_hog

pytestmark = pytest.mark.slow

MODES = {"full capabilities": [], "no CAP_SYS_ADMIN": ["setpriv", "--bounding-set", "-sys_admin", "--"]}
SECRET = f"worker-only-{uuid.uuid4().hex}"
OUTPUT_BUDGET = 256 << 20  # FXPORT_MAX_JOB_OUTPUT_BYTES of these stacks: far above a tiny job's files
WAIT_S = 240


@dataclass
class IsolationStack:
    mode: str
    api_address: str
    worker: ManagedProcess
    env: dict[str, str]
    base: Path
    tokens: dict[str, str]
    redis_url: str
    s3: object
    processes: list[ManagedProcess] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)
    bob_model: Path | None = None
    normal_s: float = 0.0  # bob's tiny job, measured once the worker is warm

    def client(self, tenant: str) -> Client:
        return Client(self.api_address, token=self.tokens[tenant])

    def submit(self, tenant: str, model: Path, spec: dict | None = None):  # noqa: ANN201 - a client Job
        """Submit and return the job at once; its client stays open until the stack stops."""
        client = self.client(tenant)
        self.clients.append(client)
        return client.submit(model, spec or PACKAGE_SPEC, idempotency_key=uuid.uuid4().hex)

    def run(self, tenant: str, model: Path, spec: dict | None = None):  # noqa: ANN201
        with self.client(tenant) as c:
            job = c.submit(model, spec or PACKAGE_SPEC, idempotency_key=uuid.uuid4().hex)
            return job.wait(timeout=WAIT_S)

    def bob_converts(self) -> float:
        """Bob's ordinary job succeeds, in normal time: the probe before it left nothing behind
        (a held lock, a wedged worker) that slows or stops another tenant's work."""
        limit = max(60.0, 10 * self.normal_s)
        started = time.monotonic()
        with self.client("bob") as c:
            job = c.submit(self.bob_model, {**PACKAGE_SPEC, "limits": {"timeout_s": 120}},
                           idempotency_key=uuid.uuid4().hex).wait(timeout=limit)
        took = time.monotonic() - started
        assert job.state == "SUCCEEDED", (job.state, job.error, self.logs())
        assert took < limit, f"bob's job took {took:.1f} s, normally {self.normal_s:.1f} s"
        return took

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object under `prefix` (of this stack's store), with its bytes."""
        client = self.s3.client()
        root = self.env["FXPORT_STORE"].split("/", 3)[3]
        out = {}
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.s3.bucket, Prefix=f"{root}/{prefix}"):
            for obj in page.get("Contents", []):
                try:
                    out[obj["Key"]] = client.get_object(Bucket=self.s3.bucket, Key=obj["Key"])["Body"].read()
                except client.exceptions.NoSuchKey:
                    continue
        return out

    def logs(self) -> str:
        from tests.fixtures.servers import tail

        return "\n".join(f"== {p.name} ==\n{tail(p.log)}" for p in [self.worker, *self.processes])


@pytest.fixture(scope="module", params=list(MODES))
def iso(request, tmp_path_factory, redis_server, s3_server) -> IsolationStack:
    """The stack with a warm sandbox (the default): a zygote forks each job's child."""
    yield from _isolation_stack(request.param, 1 + list(MODES).index(request.param), tmp_path_factory, redis_server,
                                s3_server)


@pytest.fixture(scope="module", params=list(MODES))
def cold_iso(request, tmp_path_factory, redis_server, s3_server) -> IsolationStack:
    """The stack with FXPORT_SANDBOX_MODE=cold: each job's child is a fresh interpreter."""
    yield from _isolation_stack(request.param, 3 + list(MODES).index(request.param), tmp_path_factory, redis_server,
                                s3_server, {"FXPORT_SANDBOX_MODE": "cold"})


def _isolation_stack(mode: str, db: int, tmp_path_factory, redis_server, s3_server,  # noqa: ANN001
                     extra_env: dict[str, str] | None = None) -> Iterator[IsolationStack]:
    """API, worker (under `mode`'s capabilities) and a warmed-up job of bob's, on Redis db `db`:
    each stack's own queue and job store."""
    if MODES[mode] and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    base = tmp_path_factory.mktemp("isolation")
    tokens = {t: new_token() for t in ("alice", "bob")}
    tokens_file = base / "tokens"
    tokens_file.write_text("".join(token_entry(t, tok) + "\n" for t, tok in tokens.items()))
    redis_url = f"redis://127.0.0.1:{redis_server.port}/{db}"
    env = {**distributed_env(redis_server, s3_server, base, prefix=f"iso{db}"), "FXPORT_BROKER_URL": redis_url,
           "FXPORT_TOKENS_FILE": str(tokens_file), "FXPORT_EARLY_UPLOAD": "true",
           "FXPORT_MAX_JOB_OUTPUT_BYTES": str(OUTPUT_BUDGET), **(extra_env or {})}
    api = start_api(base, env, name=f"iso-api-{db}")
    worker = start_worker(base, env, "cpu", concurrency=1, name=f"iso-worker-{db}", prefix=MODES[mode])
    stack = IsolationStack(mode, api.address, worker, env, base, tokens, redis_url, s3_server, [api.process])
    try:
        stack.bob_model = hostile_package(base, f"bob_model_{db}", "pass")  # an ordinary model
        stack.run("bob", stack.bob_model)  # the first job after the zygote starts: not a measure
        started = time.monotonic()
        assert stack.run("bob", stack.bob_model).state == "SUCCEEDED", stack.logs()
        stack.normal_s = time.monotonic() - started
        yield stack
    finally:
        for client in stack.clients:
            client.close()
        worker.stop()
        for p in stack.processes:
            p.stop()


def error_text(job) -> str:  # noqa: ANN001
    return f"{job.error['message']}\n{job.error.get('detail') or ''}"


def run_probe(iso: IsolationStack, name: str, body: str, spec: dict | None = None):  # noqa: ANN201
    model = hostile_package(iso.base, f"{name}_{uuid.uuid4().hex[:6]}", body)
    job = iso.run("alice", model, spec)
    assert job.terminal, job.state
    return job


# ------------------------------------------------------------------ 1. pathname unix sockets


def test_no_unix_socket_reaches_the_object_store(iso: IsolationStack):
    """SeaweedFS keeps unix sockets for its filer and S3 gateway; any socket file on the host
    was reachable. Now no socket of any family can be made at all."""
    sockets = [str(p) for p in (Path(iso.s3.base) / "tmp").glob("*.sock")] + [str(p) for p in Path("/tmp").glob(
        "seaweedfs-*.sock")]
    assert sockets, "SeaweedFS made no unix socket to try"
    root = iso.env["FXPORT_STORE"].split("/", 3)[3]
    target = f"/{iso.s3.bucket}/{root}/bob/inputs/planted-by-alice"
    job = run_probe(iso, "unix_sockets", payload(textwrap.dedent(f"""
        for path in {sockets!r}:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                s.sendall(b"PUT {target} HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 6\\r\\n\\r\\npwned!")
                report.append("CONNECTED " + path + " " + s.recv(200).decode("latin-1"))
            except OSError as exc:
                report.append(f"refused {{path}}: {{exc.strerror}}")
    """)))
    text = error_text(job)
    assert "PAYLOAD RAN" in text and "CONNECTED" not in text, text
    assert text.count("refused") == len(sockets) and "Operation not permitted" in text
    assert not iso.objects("bob/inputs/planted-by-alice")
    iso.bob_converts()


def test_asking_for_a_tensorrt_engine_gives_the_model_no_socket(iso: IsolationStack):
    """A GPU job's child may make AF_UNIX sockets of its own (CUDA needs them; still no connect
    or send). A tenant who asks for a TensorRT engine must not get that for its model's code:
    the model runs only in the job's CPU stage, whose child has the CPU job's filter (the GPU
    stage builds the engine from the ONNX file the CPU stage made, and runs no model code)."""
    sockets = [str(p) for p in (Path(iso.s3.base) / "tmp").glob("*.sock")]
    assert sockets, "SeaweedFS made no unix socket to try"
    spec = {**PACKAGE_SPEC, "targets": ["onnx", "tensorrt"]}
    job = run_probe(iso, "tensorrt_sockets", payload(textwrap.dedent(f"""
        for name, make in (("unix", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)),
                           ("pair", socket.socketpair),
                           ("abstract", lambda: socket.socket(socket.AF_UNIX).bind(b"\\0fxport-probe"))):
            try:
                make()
                report.append("MADE " + name)
            except OSError as exc:
                report.append(f"refused {{name}}: {{exc.strerror}}")
        for path in {sockets!r}:
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(path)
                report.append("CONNECTED " + path)
            except OSError as exc:
                report.append(f"refused {{path}}: {{exc.strerror}}")
    """)), spec)
    text = error_text(job)
    assert "PAYLOAD RAN" in text and "MADE" not in text and "CONNECTED" not in text, text
    assert text.count("refused") == 3 + len(sockets) and "Operation not permitted" in text, text
    iso.bob_converts()


# ------------------------------------------------------------------ 2. reads


def test_reads_stop_at_the_job_of_its_own(iso: IsolationStack, tmp_path: Path):
    """/etc/shadow, the tokens file, the store's raw files, the worker's /proc, the work folder,
    and the input model of another tenant's job running at that moment: all refused."""
    second = start_worker(iso.base, iso.env, "cpu", concurrency=1, name=f"iso-second-{uuid.uuid4().hex[:4]}",
                          prefix=MODES[iso.mode])  # bob's job runs there while alice's runs here
    iso.processes.append(second)
    work = Path(iso.env["FXPORT_WORK_DIR"])
    try:
        # Bob's job waits until the test lets it go (a file in its own folder): for as long as
        # alice's probe job may take on this machine now, and no longer.
        waiting = hostile_package(iso.base, f"bob_waits_{uuid.uuid4().hex[:6]}", f"""
            import time
            for _ in range({int(scaled(60) * 10)}):
                if os.path.exists("release"):
                    break
                time.sleep(0.1)
        """)
        bob = iso.submit("bob", waiting)
        bob_dir = wait_until(lambda: next(work.glob(f"fxport-job-{bob.id}-*/fxport-sandbox-*"), None), scaled(120),
                             "bob's job to start")
        bob_input = next(bob_dir.parent.glob("input/*"))
        shadow = Path("/etc/shadow")
        targets = [str(bob_input), str(bob_input.parent), str(work), iso.env["FXPORT_TOKENS_FILE"],
                   str(Path(iso.s3.base) / "data"), f"/proc/{iso.worker.pid}/environ", f"/proc/{iso.worker.pid}/status",
                   "/proc/1/cmdline", *([str(shadow)] if shadow.exists() else [])]
        job = run_probe(iso, "reads", payload(textwrap.dedent(f"""
            for path in {targets!r}:
                try:
                    if os.path.isdir(path):
                        report.append(f"LISTED {{path}}: {{os.listdir(path)[:3]}}")
                    else:
                        with open(path, "rb") as f:
                            report.append(f"READ {{path}}: {{f.read(40)!r}}")
                except OSError as exc:
                    report.append(f"refused {{path}}: {{exc.strerror}}")
        """)))
        (bob_dir / "release").write_text("")
        assert bob.wait(timeout=WAIT_S).state == "SUCCEEDED", (bob.error, iso.logs())
    finally:
        second.stop()
        iso.processes.remove(second)
    text = error_text(job)
    assert "PAYLOAD RAN" in text and "READ " not in text and "LISTED " not in text, text
    assert text.count("refused") == len(targets) and "Permission denied" in text, text
    iso.bob_converts()


# ------------------------------------------------------------------ 3. UDP without a namespace


def test_no_udp_leaves_with_or_without_a_network_namespace(iso: IsolationStack):
    """Without CAP_SYS_ADMIN there is no network namespace, and Landlock's TCP rule says nothing
    of UDP (DNS through kube-dns). The socket filter refuses the socket itself."""
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a resolver that would log the query
    dns.bind(("127.0.0.1", 0))
    dns.settimeout(0.5)
    port = dns.getsockname()[1]
    try:
        job = run_probe(iso, "udp", payload(textwrap.dedent(f"""
            for family, addr in ((socket.AF_INET, ("127.0.0.1", {port})), (socket.AF_INET6, ("::1", {port}))):
                try:
                    s = socket.socket(family, socket.SOCK_DGRAM)
                    s.sendto(b"exfiltrated.example.com", addr)
                    report.append(f"SENT {{addr}}")
                except OSError as exc:
                    report.append(f"refused {{addr}}: {{exc.strerror}}")
            try:
                socket.getaddrinfo("exfiltrated.example.com", 53)
                report.append("RESOLVED")
            except OSError as exc:
                report.append(f"no lookup: {{exc}}")
        """)))
        with pytest.raises(socket.timeout):
            dns.recvfrom(100)
    finally:
        dns.close()
    text = error_text(job)
    assert "PAYLOAD RAN" in text and "SENT" not in text and "RESOLVED" not in text, text
    assert text.count("refused") == 2
    iso.bob_converts()


# ------------------------------------------------------------------ 4. links the worker would follow


def test_the_worker_never_follows_a_link_the_child_swaps_in(iso: IsolationStack, tmp_path_factory):
    """The child flips folders of its output between real ones and symlinks (to a folder only
    the worker can read, and to the worker's own /proc/self) while the worker uploads early and
    the tenant downloads what appears: nothing it gets holds the worker's file or environment."""
    secret_dir = tmp_path_factory.mktemp("worker-only")
    (secret_dir / "secret.txt").write_text(SECRET)
    body = textwrap.dedent(f"""
        import json, random, threading, time
        out = json.load(open("request.json"))["engine"]["out_dir"]
        targets = {{"evil_secret": ({str(secret_dir)!r}, "secret.txt"), "evil_proc": ("/proc/self", "environ")}}
        for name, (_, leaf) in targets.items():
            os.makedirs(os.path.join(out, name), exist_ok=True)
            with open(os.path.join(out, name, leaf), "w") as f:
                f.write("decoy")
        def flip():
            while True:
                for name, (target, _) in targets.items():
                    real, side = os.path.join(out, name), os.path.join(out, name + ".real")
                    try:
                        os.rename(real, side)
                        os.symlink(target, real)
                        time.sleep(random.random() * 0.001)
                        os.unlink(real)
                        os.rename(side, real)
                    except OSError:
                        pass
                time.sleep(random.random() * 0.001)
        threading.Thread(target=flip, daemon=True).start()
    """)
    model = hostile_package(iso.base, f"flip_{uuid.uuid4().hex[:6]}", body)
    job = iso.submit("alice", model, {**PACKAGE_SPEC, "targets": ["onnx", "torchscript", "exported_program"]})
    seen: dict[str, bytes] = {}
    prefix = f"alice/jobs/{job.id}/"
    while not job.refresh().terminal:  # what alice downloads while her job runs
        seen.update(iso.objects(prefix))
        time.sleep(0.05)
    seen.update(iso.objects(prefix))
    secrets = [SECRET.encode(), iso.s3.secret_key.encode(), b"AWS_SECRET_ACCESS_KEY"]
    for key, data in seen.items():
        assert not any(s in data for s in secrets), f"{key} holds what only the worker could read"
    assert job.state in ("SUCCEEDED", "FAILED"), job.state
    if job.state == "FAILED":  # it stopped with a link in place: named, and nothing published
        assert job.error["code"] == "sandbox_violation" and "symlink" in job.error["message"], job.error
    iso.bob_converts()


# ------------------------------------------------------------------ 5. state shared with the zygote


def test_nothing_the_zygote_holds_is_shared_with_the_next_job(iso: IsolationStack):
    """A child holding tqdm's lock (a semaphore in /dev/shm, once) and exiting hung the next
    jobs' ONNX export until their wall clock. Now a child inherits no writable shared mapping
    and no descriptor it did not open: it reports what it holds, takes every lock it can find,
    and exits without letting go; bob's next job converts in normal time."""
    job = run_probe(iso, "shared_state", textwrap.dedent("""
        import builtins, json
        names = ["tqdm"]  # the sandbox's real import, by name: torch.package allows only what it was saved with
        tqdm = builtins.__import__(names[0])
        shared = [l.strip() for l in open("/proc/self/maps") if l.split()[1][1] == "w" and l.split()[1][3] == "s"]
        fds = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")}
        tqdm.tqdm.get_lock().acquire()
        print("FOUND " + json.dumps({"shared": shared, "fds": fds}), flush=True)
        os._exit(0)
    """))
    assert job.state == "FAILED"
    found = json.loads(error_text(job).split("FOUND ", 1)[1].splitlines()[0])
    assert found["shared"] == [], found
    # Beside stdin (/dev/null) and its log: the events FIFO and the model file, both its job's own.
    fds = {int(k): v for k, v in found["fds"].items()}
    assert fds[0] == "/dev/null" and all(f"fxport-job-{job.id}-" in fds[fd] for fd in fds if fd > 0), fds
    assert any(target.endswith("/events") for target in fds.values()), fds
    iso.bob_converts()


def test_the_spare_that_will_run_the_next_job_is_out_of_reach(iso: IsolationStack):
    """The zygote forks the next job's child while this one runs (sandbox/spare.py): during
    alice's job, the spare that bob's job will run in waits beside it, not yet confined. Her
    model looks for it among the pids after its own and asks to signal each process it finds
    (signal 0: only the permission is tested) and to open its memory. Every process outside
    her own is refused; the spare was among them; bob's job, run in that spare, converts."""
    job = run_probe(iso, "spare_reach", textwrap.dedent("""
        import json
        me = os.getpid()
        mine = {int(tid) for tid in os.listdir("/proc/self/task")}
        refused, reached = [], []
        for pid in range(max(2, me - 2000), me + 2000):
            if pid in mine:
                continue
            try:
                os.kill(pid, 0)
                reached.append(f"{pid} signal")
            except ProcessLookupError:
                continue
            except PermissionError:
                if pid > me and len(refused) < 100:
                    refused.append(pid)
            try:
                open(f"/proc/{pid}/mem", "rb").close()
                reached.append(f"{pid} memory")
            except OSError:
                pass
        print("FOUND " + json.dumps({"refused": refused, "reached": reached}), flush=True)
        os._exit(0)
    """))
    assert job.state == "FAILED"
    found = json.loads(error_text(job).split("FOUND ", 1)[1].splitlines()[0])
    zygote = next(pid for pid in descendants(iso.worker.pid)
                  if b"fxport.workers.sandbox.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes())
    (spare,) = descendants(zygote)  # alice's child has exited: what waits is bob's spare
    assert found["reached"] == [], found
    assert spare in found["refused"], (spare, found)
    iso.bob_converts()


# ------------------------------------------------------------------ 5b. other processes of the same uid


# A probe's way to try calls: `attempt(name, call)` reports "NAME DONE" or "NAME refused errno N";
# `syscall(nr, *args)` raises OSError with the errno.
ATTEMPTS = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def attempt(name, call):
        try:
            call()
            report.append(f"{name} DONE")
        except OSError as exc:
            report.append(f"{name} refused errno {exc.errno}")
    def syscall(*args):
        if libc.syscall(*args) < 0:
            raise OSError(ctypes.get_errno(), "syscall")
""")


def _zygote_of(iso: IsolationStack) -> int:
    return next(pid for pid in descendants(iso.worker.pid)
                if b"fxport.workers.sandbox.zygote" in Path(f"/proc/{pid}/cmdline").read_bytes())


def _what_a_neighbour_cannot_lose(pid: int) -> dict[str, object]:
    """What a same-uid call could change on `pid`: its limits, nice value, CPUs and I/O class."""
    import os

    limits = Path(f"/proc/{pid}/limits").read_text()
    nice = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])
    return {"limits": limits, "nice": nice, "cpus": sorted(os.sched_getaffinity(pid))}


def test_a_job_cannot_change_another_process_of_its_uid(iso: IsolationStack):
    """Every job's child, the zygote and the worker share one uid, and the kernel lets a process
    change the limits, priority, CPUs and I/O class of another of its uid: a model set
    RLIMIT_NOFILE 512 on the zygote (every later job failed) and RLIMIT_CPU 1 s on the Celery
    master (the worker died). Now each call acts on the caller only; the zygote the model
    attacks keeps what it had, and bob's next job converts."""
    zygote = _zygote_of(iso)
    before = _what_a_neighbour_cannot_lose(zygote)
    job = run_probe(iso, "same_uid", payload(ATTEMPTS, textwrap.dedent("""
        import resource
        target = os.getppid()  # the zygote, which forks every later job's child
        report.append(f"TARGET {target}")
        attempt("prlimit", lambda: resource.prlimit(target, resource.RLIMIT_NOFILE, (512, 512)))
        attempt("prlimit_cpu", lambda: resource.prlimit(target, resource.RLIMIT_CPU, (1, 1)))
        attempt("renice", lambda: os.setpriority(os.PRIO_PROCESS, target, 19))
        attempt("renice_uid", lambda: os.setpriority(os.PRIO_USER, os.getuid(), 19))
        attempt("affinity", lambda: os.sched_setaffinity(target, {0}))
        attempt("scheduler", lambda: os.sched_setscheduler(target, os.SCHED_IDLE, os.sched_param(0)))
        attempt("ioprio", lambda: syscall(251, 1, target, 3 << 13))
        attempt("inotify", lambda: syscall(294, 0))
        attempt("cgroup_tree", lambda: os.listdir("/sys/fs/cgroup"))
    """)))
    text = error_text(job)
    assert job.state == "FAILED" and f"TARGET {zygote}" in text, text
    for name in ("prlimit", "prlimit_cpu", "renice", "renice_uid", "affinity", "scheduler", "ioprio", "inotify"):
        assert f"{name} refused errno 1" in text, (name, text)  # EPERM
    assert "cgroup_tree refused errno 13" in text and " DONE" not in text, text
    assert _what_a_neighbour_cannot_lose(zygote) == before
    iso.bob_converts()


def test_a_job_holds_at_most_its_share_of_threads(iso: IsolationStack, tmp_path: Path):
    """Threads (and processes) were one pool per uid: one job held 2,484 and the next tenant's
    jobs failed with "can't start new thread". A job now gets at most 1024 of its own (a pids
    cgroup of its own where the worker can make one, RLIMIT_NPROC from the uid's count
    otherwise), the worker records which, and bob's next job converts."""
    from fxport.workers.sandbox.confine import MAX_JOB_TASKS

    job = run_probe(iso, "threads", payload(
        "def threads(held, refused):\n    report.append(f'stopped by: {refused}')\n    report.append(f'HELD {held}')\n"
        + thread_hog("threads")))
    text = error_text(job)
    held = int(text.split("HELD ", 1)[1].split()[0])
    assert 500 < held < MAX_JOB_TASKS and "can't start new thread" in text, text
    with iso.client("bob") as c:
        ok = c.submit(iso.bob_model, PACKAGE_SPEC, idempotency_key=uuid.uuid4().hex).wait(timeout=WAIT_S)
        assert ok.state == "SUCCEEDED", ok.error
        c.job(ok.id).download(tmp_path, names=["manifest.json"])
    assert json.loads((tmp_path / "manifest.json").read_text())["sandbox"]["tasks_bounded"] == "pids_cgroup"
    iso.bob_converts()


def _metadata(path: Path) -> tuple[int, int, int, int, list[str]]:
    st = path.lstat()
    return st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, sorted(os.listxattr(path, follow_symlinks=False))


def test_a_job_cannot_change_the_metadata_of_a_file_outside_it(iso: IsolationStack, tmp_path: Path):
    """Landlock bounds what a child reads and writes, not a file's metadata: a model chmodded a file
    of its uid outside its job 0644 → 0777, set its mtime to 0 and tagged it with an xattr (another
    job's folder, or the worker's own files, are such files). Each call by path is refused now,
    inside the job's own folder too; the file outside keeps its mode, owner, mtime and xattrs."""
    outside = tmp_path / "worker_owned.txt"
    outside.write_text("the worker's\n")
    outside.chmod(0o644)
    before = _metadata(outside)
    job = run_probe(iso, "metadata", payload(ATTEMPTS, textwrap.dedent(f"""
        target = {str(outside)!r}
        attempt("chmod", lambda: os.chmod(target, 0o777))
        attempt("chmod_nofollow", lambda: os.chmod(target, 0o777, follow_symlinks=False))
        attempt("fchmodat2", lambda: syscall(452, -100, target.encode(), 0o777, 0))
        attempt("chown", lambda: os.chown(target, 65534, 65534))
        attempt("lchown", lambda: os.lchown(target, 65534, 65534))
        attempt("utime", lambda: os.utime(target, (0, 0)))
        attempt("setxattr", lambda: os.setxattr(target, "user.fxport", b"x"))
        attempt("removexattr", lambda: os.removexattr(target, "user.fxport"))
        own = "own_file"
        open(own, "w").close()
        attempt("chmod_own", lambda: os.chmod(own, 0o600))
        fd = os.open(own, os.O_RDONLY)
        attempt("fchmod_own", lambda: os.fchmod(fd, 0o600))  # by descriptor: what Landlock let it open
    """)))
    text = error_text(job)
    assert job.state == "FAILED" and "PAYLOAD RAN" in text, text
    for name in ("chmod", "chmod_nofollow", "fchmodat2", "chown", "lchown", "utime", "setxattr", "removexattr",
                 "chmod_own"):
        assert f"{name} refused errno 1" in text, (name, text)  # EPERM, from seccomp
    assert "fchmod_own DONE" in text, text
    assert _metadata(outside) == before
    iso.bob_converts()


# ------------------------------------------------------------------ 6. unbounded writes into shared services


def _redis(iso: IsolationStack):  # noqa: ANN202
    import redis

    return redis.Redis.from_url(iso.redis_url)


FIND_EVENTS = """
events_fd = next(int(fd) for fd in os.listdir("/proc/self/fd")
                 if os.path.exists(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").endswith("/events"))
"""


@pytest.mark.parametrize("flood", ["many events", "one huge event"])
def test_a_model_cannot_grow_redis(iso: IsolationStack, flood: str):
    """One job grew Redis by 375 MiB in 24 s through its progress events. Now each event is
    checked and bounded, their number per job too, the job store is written a few times a
    second whatever the child sends, and the stream is capped and expires."""
    r = _redis(iso)
    before = r.info("memory")["used_memory"]
    if flood == "many events":
        send = """
            stages = ["load", "capture", "passes", "quantize", "export", "verify"]
            for i in range(30000):
                line = json.dumps({"stage": stages[i % 6], "progress": 0.5, "message": "m" * 400}) + "\\n"
                os.write(events_fd, line.encode())
        """
        why = "more than 10000 progress events"
    else:
        send = """
            os.write(events_fd, b'{"stage": "load", "progress": 0.5, "message": "' + b"m" * (64 << 20))
        """
        why = "an event line over 4096 bytes"
    job = run_probe(iso, "flood", "import json\n" + FIND_EVENTS + textwrap.dedent(send) + "time = __import__('time')\n"
                    "time.sleep(60)\n")
    assert job.state == "FAILED" and job.error["code"] == "sandbox_violation", (job.error, iso.logs())
    assert why in job.error["message"], job.error
    stream = f"fxport:job:{job.id}:events"
    assert r.xlen(stream) < 100, r.xlen(stream)
    assert 0 < r.ttl(stream) <= 7 * 24 * 3600
    grown = r.info("memory")["used_memory"] - before
    assert grown < 8 << 20, f"Redis grew by {grown >> 20} MiB"
    r.close()
    iso.bob_converts()


# ------------------------------------------------------------------ 7. unbounded reads by the worker


def test_a_huge_result_fails_the_job_without_the_worker_reading_it(iso: IsolationStack):
    """A 1 GiB result.json grew the worker to 5 GB for 12 minutes. Now the worker reads at most
    MAX_RESULT_BYTES of it and fails the job at once, naming the file and the limit."""
    (pool,) = pool_children(iso.worker)
    rss_before = _rss_mib(pool)
    job = run_probe(iso, "huge_result", textwrap.dedent("""
        import builtins
        names = ["fxport.workers.sandbox.child"]  # the running sandbox's own module, by name (see above)
        child = builtins.__import__(names[0], fromlist=["child"])
        write = child._write_result
        def sparse_gigabyte(work, result):
            write(work, result)
            os.truncate(work / "result.json", 1 << 30)
        child._write_result = sparse_gigabyte
    """))
    assert job.state == "FAILED" and job.error["code"] == "sandbox_violation", job.error
    assert "1024 MiB result.json, over the 17 MiB limit" in job.error["message"], job.error
    assert _rss_mib(pool) - rss_before < 200
    iso.bob_converts()


LINGERING_THREAD = """
    import json, threading, time
    def linger():
        # Once the engine has written its result, rewrite every artifact the worker is about to
        # check and store, for as long as this process lives.
        with open("request.json") as f:
            out = json.load(f)["engine"]["out_dir"]
        while not os.path.exists("result.json"):
            time.sleep(0.001)
        while True:
            for name in os.listdir(out):
                try:
                    with open(os.path.join(out, name), "wb") as f:
                        f.write(b"TAMPERED AFTER THE RESULT")
                except OSError:
                    pass
            time.sleep(0.001)
    threading.Thread(target=linger, daemon=False).start()
"""


def test_a_thread_left_behind_neither_holds_the_job_nor_changes_its_artifacts(iso: IsolationStack):
    _thread_left_behind(iso)


def test_a_thread_left_behind_in_a_cold_child_neither_holds_the_job_nor_changes_its_artifacts(
        cold_iso: IsolationStack):
    _thread_left_behind(cold_iso)


def _thread_left_behind(stack: IsolationStack) -> None:
    """The child ends as soon as its result is written, whatever threads the model left. One that
    waits for the result to rewrite the artifacts either misses the child's end (the job
    succeeds with the engine's bytes) or is caught by the worker's check of each file against its
    digest; it never holds the child until the wall-clock limit, and nothing it wrote is stored."""
    model = hostile_package(stack.base, f"linger_{uuid.uuid4().hex[:6]}", LINGERING_THREAD)
    with stack.client("alice") as c:
        job = c.submit(model, {**PACKAGE_SPEC, "limits": {"timeout_s": 120}},
                       idempotency_key=uuid.uuid4().hex).wait(timeout=WAIT_S)
        if job.state == "SUCCEEDED":
            files = job.download(stack.base / f"linger-{job.id}")  # each file's sha256 checked against the record
            assert files and all(b"TAMPERED" not in Path(f).read_bytes() for f in files), files
        else:
            assert job.state == "FAILED", job.state
            assert "does not match its recorded digest" in error_text(job), (job.error, stack.logs())
    stored = stack.objects(f"alice/jobs/{job.id}/")
    assert all(b"TAMPERED" not in data for data in stored.values()), sorted(stored)
    stack.bob_converts()


def test_a_failed_job_publishes_the_workers_manifest_and_report_not_the_childs(iso: IsolationStack):
    """A failed job still publishes manifest.json and report.html. A child that rewrites its
    out folder once its result is written (a script in report.html, junk in the manifest and the
    artifacts) fails the job on the worker's digest check, and what is stored for it is what the
    worker wrote: neither file as the child left it."""
    job = run_probe(iso, "rewrite_after_result", textwrap.dedent("""
        import builtins, json
        child = builtins.__import__("fxport.workers.sandbox.child", fromlist=["child"])
        write = child._write_result
        def rewrite_after(work, result):
            write(work, result)
            with open("request.json") as f:
                out = json.load(f)["engine"]["out_dir"]
            for name in os.listdir(out):
                with open(os.path.join(out, name), "wb") as f:
                    f.write(b"TAMPERED AFTER THE RESULT")
            with open(os.path.join(out, "report.html"), "w") as f:
                f.write("<script>TAMPERED</script>")
        child._write_result = rewrite_after
    """))
    assert job.state == "FAILED", job.state
    assert "does not match its recorded digest" in error_text(job), job.error
    stored = iso.objects(f"alice/jobs/{job.id}/")
    assert all(b"TAMPERED" not in data for data in stored.values()), {k: v[:60] for k, v in stored.items()}
    iso.bob_converts()


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) >> 10
    return 0


# ------------------------------------------------------------------ the record of the layers


def test_the_worker_records_the_layers_not_the_child(iso: IsolationStack, tmp_path: Path):
    """The child once wrote the manifest's `sandbox` section itself: a model could claim layers
    it did not have. Now the worker replaces it with what it measured (and with the child's
    report sent before the model was opened)."""
    job = run_probe(iso, "claims", textwrap.dedent("""
        import builtins
        names = ["fxport.workers.sandbox.child"]
        child = builtins.__import__(names[0], fromlist=["child"])
        write = child._write_result
        def claim(work, result):
            claimed = {"network_isolated": True, "claimed_by_model": True, "seccomp_filters": 9, "sources": {}}
            result["sandbox"] = claimed  # where the child once reported its layers
            if "manifest" in result:
                result["manifest"]["sandbox"] = claimed
            write(work, result)
        child._write_result = claim
    """))
    assert job.state == "SUCCEEDED", (job.error, iso.logs())
    with iso.client("alice") as c:
        c.job(job.id).download(tmp_path, names=["manifest.json"])
    box = json.loads((tmp_path / "manifest.json").read_text())["sandbox"]
    assert "claimed_by_model" not in box
    assert box["network_isolated"] is (not MODES[iso.mode])  # measured: no namespace without CAP_SYS_ADMIN
    assert box["seccomp_filters"] == 1 and box["no_new_processes"] and box["sockets_blocked"]
    assert box["filesystem_reads_confined"] and box["inherited_state_clean"] and box["capabilities_dropped"]
    assert "network_isolated" in box["sources"]["measured_by_worker"]
    log = iso.worker.log.read_text()
    assert f"job {job.id}: sandbox layers: no processes, no sockets, reads confined" in log
    iso.bob_converts()


def test_a_forged_manifest_fails_the_job_naming_the_field(iso: IsolationStack, tmp_path: Path):
    """The child's manifest is read as the type every reader expects: a model that rewrites it
    (a size that is not a number, a digest that is not a string) fails its own job, naming the
    field, and nothing it forged reaches the tenant as an artifact."""
    job = run_probe(iso, "forged_manifest", textwrap.dedent("""
        import builtins
        names = ["fxport.workers.sandbox.child"]
        child = builtins.__import__(names[0], fromlist=["child"])
        write = child._write_result
        def forge(work, result):
            if "manifest" in result:
                result["manifest"]["artifacts"][0].update(bytes="all of them", sha256=7)
            write(work, result)
        child._write_result = forge
    """))
    assert job.state == "FAILED" and job.error["code"] == "sandbox_violation", (job.error, iso.logs())
    assert "the sandbox's manifest is malformed at 'artifacts.0.bytes'" in job.error["message"], job.error
    assert not any(a["name"].endswith(".onnx") for a in job.artifacts), job.artifacts
    iso.bob_converts()



# ------------------------------------------------------------------ 9. work a model makes the worker do


FORGE = """
import builtins
names = ["fxport.workers.sandbox.child"]
child = builtins.__import__(names[0], fromlist=["child"])
write = child._write_result
def forge(work, result):
    if "manifest" in result:
        m = result["manifest"]
        m["quantization"] = {{"layers": [{{"node": "n" * 60, "sqnr_db": i, "cosine": 0.5}} for i in range({layers})]}}
        nodes = [{{"node": str(i), "op": "x" * 200, "ms": i, "share": 0.1}} for i in range({layers})]
        m["profile"] = {{"top_nodes": nodes}}
        m["warnings"] = ["w" * 60000] * 20
    write(work, result)
child._write_result = forge
"""


def test_a_forged_manifest_within_bounds_costs_the_worker_a_bounded_report(iso: IsolationStack, tmp_path: Path):
    """The worker draws report.html from the manifest the model could rewrite: a 1.8 MiB forged
    one cost 96 s of a worker's CPU and a 181 MiB report. The report now draws at most 500 items
    of a list and 2,000 characters of a string, and says what it cut; the job converts."""
    job = run_probe(iso, "forged_big", FORGE.format(layers=9000))
    assert job.state == "SUCCEEDED", (job.error, iso.logs())
    with iso.client("alice") as c:
        c.job(job.id).download(tmp_path, names=["report.html", "manifest.json"])
    report = (tmp_path / "report.html").read_text()
    assert len(report) < 4 << 20, len(report)
    assert "This report draws at most 500 items" in report and "profile.top_nodes: 9000 items" in report
    assert len(json.loads((tmp_path / "manifest.json").read_text())["quantization"]["layers"]) == 9000
    iso.bob_converts()


def test_a_manifest_past_its_bounds_fails_the_job_naming_the_bound(iso: IsolationStack):
    job = run_probe(iso, "forged_huge", FORGE.format(layers=12_000))
    assert job.state == "FAILED" and job.error["code"] == "sandbox_violation", (job.error, iso.logs())
    assert "has 12000 items at manifest." in job.error["message"] and "the bound is 10000" in job.error["message"]
    assert not any(a["name"].endswith(".onnx") for a in job.artifacts), job.artifacts
    iso.bob_converts()


def test_sparse_files_fail_the_job_while_it_runs_naming_the_bound(iso: IsolationStack):
    """Two sparse 1 GiB files (no disk used) once cost a worker 83 s and the store 1 GiB: every
    file in the output folder was uploaded. Now the worker watches what the child writes while it
    runs (sizes at their full length), stops it past FXPORT_MAX_JOB_OUTPUT_BYTES, and uploads only
    what the manifest lists."""
    job = run_probe(iso, "sparse", payload(textwrap.dedent("""
        import time
        for name in ("big-1", "big-2"):
            with open(name, "wb") as f:
                f.truncate(1 << 30)
        report.append("WROTE")
        time.sleep(60)
        report.append("NOT STOPPED")
    """)), {**PACKAGE_SPEC, "limits": {"timeout_s": 120}})
    assert job.state == "FAILED" and job.error["code"] == "resource_limit", (job.error, iso.logs())
    assert "FXPORT_MAX_JOB_OUTPUT_BYTES" in job.error["message"] and "during load" in job.error["message"], job.error
    assert not any(a["name"].startswith("big") for a in job.artifacts), job.artifacts
    iso.bob_converts()


# ------------------------------------------------------------------ 10. links left for the withdrawal

# Once the job's other targets are written, the model's code (loaded in the child) replaces the
# torchscript exporter with one that plants links where the withdrawal of a failed job will look
# (every name a conversion writes) and fails. Its findings leave in the error, as probes' do.
PLANT_LINKS = """
    import builtins, json
    registry = builtins.__import__("fxport.workers.engine.exporters.registry", fromlist=["REGISTRY"])
    dataclasses = builtins.__import__("dataclasses")
    out = json.load(open("request.json"))["engine"]["out_dir"]
    OUTSIDE = {outside!r}

    def plant(job, path):
        report = []

        def attempt(what, make, *args):
            try:
                make(*args)
                report.append(what + " ok")
            except OSError as exc:
                report.append(f"{{what}} refused: {{exc.strerror}}")

        at = lambda name: os.path.join(out, name)
        # the artifacts already published, each swapped for a link to a file outside the job
        for name, target in (("model.onnx", OUTSIDE["file"]), ("model.pt2", OUTSIDE["tokens"])):
            os.unlink(at(name))
            attempt("symlink " + name, os.symlink, target, at(name))
        attempt("symlink model.onnx.data", os.symlink, OUTSIDE["log"], at("model.onnx.data"))
        # the failing target's own name: a hard link to the next job's model, else a symlink to it
        attempt("hardlink model.ts", os.link, OUTSIDE["bob_model"], at("model.ts"))
        if not os.path.lexists(at("model.ts")):
            attempt("symlink model.ts", os.symlink, OUTSIDE["bob_model"], at("model.ts"))
        # the package stage's names: a link to a folder outside, and a folder of links
        attempt("symlink triton", os.symlink, OUTSIDE["dir"], at("triton"))
        os.mkdir(at("samples.npz"))
        attempt("symlink samples.npz/file", os.symlink, OUTSIDE["file"], at("samples.npz/file"))
        attempt("symlink samples.npz/dir", os.symlink, OUTSIDE["dir"], at("samples.npz/dir"))
        attempt("hardlink samples.npz/hard", os.link, OUTSIDE["file"], at("samples.npz/hard"))
        # the exporter's staging folder, which it removes after a failed export
        staging = os.path.dirname(path)
        os.rename(staging, at(".writing-moved"))
        attempt("symlink .writing", os.symlink, OUTSIDE["dir"], staging)
        # a folder no withdrawal names, made unwritable, a link in it: left for the worker's cleanup
        os.mkdir(at("leftover"))
        attempt("symlink leftover/file", os.symlink, OUTSIDE["file"], at("leftover/file"))
        # chmod by path is refused in the sandbox; through a descriptor it is not
        attempt("fchmod leftover", lambda: os.fchmod(os.open(at("leftover"), os.O_RDONLY | os.O_DIRECTORY), 0o500))
        raise RuntimeError("PLANTED | " + " | ".join(report))

    registry.REGISTRY["torchscript"] = dataclasses.replace(registry.REGISTRY["torchscript"], from_graph=plant)
"""


def test_a_failed_jobs_withdrawal_follows_no_link_the_model_planted(iso: IsolationStack, tmp_path_factory,
                                                                   tmp_path: Path):
    """A job that fails keeps no model file: the withdrawal removes every name a conversion writes
    from its output folder (publish.withdraw), the worker deletes what it stored early
    (jobs._drop_unkept) and then its job folder. The model swaps the published artifacts for
    symlinks and plants links (to a file and a folder of the test's, the tokens file, the worker's
    log, bob's model) under every name the withdrawal removes, then fails its last target. Every
    file outside keeps its bytes and its mode; the job fails naming the target, having removed the
    links; the store holds only the worker's manifest and report for it; bob's next job converts."""
    outside = tmp_path_factory.mktemp("outside-withdrawal")
    (outside / "dir").mkdir()
    (outside / "dir" / "inner.txt").write_text(f"inside a folder outside the job {uuid.uuid4().hex}")
    marker = f"outside-the-job-{uuid.uuid4().hex}"
    (outside / "file.txt").write_text(marker)
    paths = {"file": outside / "file.txt", "dir": outside / "dir", "tokens": Path(iso.env["FXPORT_TOKENS_FILE"]),
             "log": iso.worker.log, "bob_model": iso.bob_model}
    watched = [paths["file"], outside / "dir" / "inner.txt", paths["tokens"], paths["bob_model"]]
    before = {p: (p.read_bytes(), p.stat().st_mode) for p in watched}
    log_head = iso.worker.log.read_bytes()  # the log grows: what it held stays as it was
    model = hostile_package(iso.base, f"plant_links_{uuid.uuid4().hex[:6]}",
                            PLANT_LINKS.format(outside={k: str(v) for k, v in paths.items()}))
    job = iso.submit("alice", model, {**PACKAGE_SPEC, "targets": ["onnx", "exported_program", "torchscript"]})
    prefix = f"alice/jobs/{job.id}/"
    seen: dict[str, bytes] = {}
    while not job.refresh().terminal:  # what alice could download while her job runs
        seen.update(iso.objects(prefix))
        time.sleep(0.05)
    seen.update(iso.objects(prefix))

    assert job.state == "FAILED", (job.state, iso.logs())
    text = error_text(job)
    assert job.error["stage"] == "export" and "torchscript export failed: RuntimeError: PLANTED" in text, job.error
    for planted in ("symlink model.onnx ok", "symlink model.pt2 ok", "symlink model.onnx.data ok",
                    "symlink triton ok", "symlink samples.npz/file ok", "symlink .writing ok",
                    "symlink leftover/file ok", "fchmod leftover ok"):
        assert planted in text, text  # the links were there for the withdrawal to meet
    assert "model.ts ok" in text, text  # a hard link or, where refused, a symlink
    with iso.client("alice") as c:
        c.job(job.id).download(tmp_path, names=["manifest.json"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["artifacts"] == [], manifest["artifacts"]
    removed = next(w for w in manifest["warnings"] if "keeps no model file" in w)
    for name in ("model.onnx", "model.onnx.data", "model.pt2", "model.ts", "samples.npz", "triton"):
        assert name in removed, removed  # withdrawn: the links themselves, never their targets

    for path, (data, mode) in before.items():
        assert path.is_file() and path.read_bytes() == data, f"{path} changed"
        assert path.stat().st_mode == mode, f"{path}: mode {oct(mode)} became {oct(path.stat().st_mode)}"
    assert paths["dir"].is_dir() and sorted(p.name for p in paths["dir"].iterdir()) == ["inner.txt"]
    assert iso.worker.log.read_bytes().startswith(log_head)
    stored = iso.objects(prefix)
    assert sorted(key.rsplit("/", 1)[1] for key in stored) == ["manifest.json", "report.html"], sorted(stored)
    outside_bytes = [marker.encode(), *(data for data, _ in before.values())]
    for key, data in seen.items():
        assert not any(b in data for b in outside_bytes), f"{key} held a file from outside the job"
    iso.bob_converts()
    # the worker removed the job's folder, the unwritable one the model left in it too
    assert not list(Path(iso.env["FXPORT_WORK_DIR"]).glob(f"fxport-job-{job.id}-*"))


# A worker that is not root (the image's): what the child left unwritable makes a removal fail there.
CLEANUP_AS_NOT_ROOT = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]
CLEANUP = """
import os, sys
from fxport.workers.jobs import _job_folder
work, outside = sys.argv[1], sys.argv[2]
with _job_folder("fxport-job-cleanup-", work) as tmp:
    out = os.path.join(tmp, "out")
    for name, mode in (("unwritable", 0o500), ("unlistable", 0o000)):
        os.makedirs(os.path.join(out, name))
        os.symlink(outside, os.path.join(out, name, "file"))
        os.symlink(os.path.dirname(outside), os.path.join(out, name, "dir"))
        os.chmod(os.path.join(out, name), mode)
    os.chmod(out, 0o500)
"""


def test_the_workers_cleanup_of_a_job_folder_changes_nothing_through_a_link(tmp_path: Path):
    """The worker removes a job's folder when the job ends (jobs._job_folder). Where the child left a
    folder unwritable, tempfile.TemporaryDirectory's cleanup (Python < 3.11.8) chmods each path it
    cannot remove, and so a symlink's target outside the job. Run as a worker that is not root: the
    folder goes, links and all, and the file and folder outside keep their modes."""
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    outside = tmp_path / "outside" / "file.txt"
    outside.parent.mkdir()
    outside.write_text("outside the job")
    outside.chmod(0o644)
    modes = {p: p.stat().st_mode for p in (outside, outside.parent)}
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.run([*(CLEANUP_AS_NOT_ROOT if os.geteuid() == 0 else []), sys.executable, "-c", CLEANUP,
                           str(work), str(outside)], capture_output=True, text=True, timeout=scaled(120))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mode for p in modes} == modes
    assert outside.read_text() == "outside the job"
    assert list(work.iterdir()) == [], proc.stderr[-3000:]  # removed, the unwritable folders too
