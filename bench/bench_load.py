"""Issue 5's load benchmark: 32 concurrent clients submitting tiny-model jobs for 60 s
against the full stack (gRPC API + Redis/Celery CPU workers + SeaweedFS S3, all on loopback).

Each client is what a CI pipeline does: submit a tiny model (CORPUS["tiny_linear"], ONNX
target) with its own idempotency key, follow the job to its end over WatchJob, and submit
again, until the time is up (a closed loop: at most 32 jobs in flight, as many pipelines
waiting on their jobs). Measured:

- jobs/s: jobs submitted and finished SUCCEEDED per second of the run;
- submit latency p50/p99: `Client.submit` (CheckUpload + SubmitJob; the model is already
  stored after the first, so no bytes move), under that concurrency;
- end-to-end p50/p99: submit to the terminal event;
- errors: any call that raised or any job that did not SUCCEED. Must be 0.

    python bench/bench_load.py [--clients 32] [--seconds 60] [--workers 2]

Every loop has a deadline and a count limit; every server started is stopped by PID.
Writes the "load" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import machine, write_section  # noqa: E402

SPEC = {"targets": ["onnx"], "verify": {"samples": 1}}
MAX_JOBS_PER_CLIENT = 1000  # a bound on each loop besides its deadline


@dataclass
class ClientStats:
    submit_s: list[float] = field(default_factory=list)
    end_to_end_s: list[float] = field(default_factory=list)
    succeeded: int = 0
    errors: list[str] = field(default_factory=list)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_client(address: str, model: Path, stop_at: float, finish_by: float, stats: ClientStats) -> None:
    from fxport.client import Client

    with Client(address) as client:
        for _ in range(MAX_JOBS_PER_CLIENT):
            if time.monotonic() >= stop_at:
                return
            t0 = time.monotonic()
            try:
                job = client.submit(model, SPEC, idempotency_key=f"load-{uuid.uuid4().hex}")
                t1 = time.monotonic()
                job.wait(timeout=max(1.0, finish_by - t1))
            except Exception as exc:  # counted, reported; the loop goes on
                stats.errors.append(f"{type(exc).__name__}: {exc}")
                continue
            stats.submit_s.append(t1 - t0)
            if job.state == "SUCCEEDED":
                stats.succeeded += 1
                stats.end_to_end_s.append(time.monotonic() - t0)
            else:
                stats.errors.append(f"job {job.id} ended {job.state}: {job.error}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=2, help="CPU worker processes (concurrency 1 each)")
    ap.add_argument("--no-report", action="store_true", help="print, do not write docs/benchmarks.md")
    args = ap.parse_args()
    os.environ["FXPORT_SANDBOX_THREADS"] = "1"

    from tests.fixtures.models import save_pt2
    from tests.fixtures.servers import distributed_env, start_api, start_redis, start_seaweed, start_worker

    with tempfile.TemporaryDirectory(prefix="fxport-load-") as tmp, contextlib.ExitStack() as running:
        work = Path(tmp)
        model = save_pt2("tiny_linear", work / "tiny.pt2")
        redis = start_redis(work / "redis", appendonly=True)
        running.callback(redis.stop)
        s3 = start_seaweed(work / "seaweed")
        running.callback(s3.stop)
        os.environ.update(s3.env())
        # The load is of jobs that run: the result cache would answer every submit after the first.
        env = {**distributed_env(redis, s3, work / "stack"), "FXPORT_CACHE_ENABLED": "false"}
        api = start_api(work / "stack", env)
        running.callback(api.stop)
        for i in range(args.workers):
            running.callback(start_worker(work / "stack", env, "cpu", name=f"load-w{i}").stop)

        # Warm every worker's sandbox once, outside the measured window.
        from fxport.client import Client

        with Client(api.address) as c:
            warm = [c.submit(model, SPEC) for _ in range(args.workers * 2)]
            for job in warm:
                job.wait(timeout=300)
                assert job.state == "SUCCEEDED", job.error

        print(f"{args.clients} clients for {args.seconds:g} s against {api.address} …", flush=True)
        stats = [ClientStats() for _ in range(args.clients)]
        start = time.monotonic()
        stop_at, finish_by = start + args.seconds, start + args.seconds + 600
        threads = [threading.Thread(target=run_client, args=(api.address, model, stop_at, finish_by, s), daemon=True)
                   for s in stats]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(1.0, finish_by - time.monotonic()))
        elapsed = time.monotonic() - start
        hung = sum(t.is_alive() for t in threads)

    submits = [x for s in stats for x in s.submit_s]
    e2e = [x for s in stats for x in s.end_to_end_s]
    succeeded = sum(s.succeeded for s in stats)
    errors = [e for s in stats for e in s.errors] + [f"{hung} client(s) still waiting"] * bool(hung)
    rows = [
        ("clients / CPU workers", f"{args.clients} / {args.workers}"),
        ("run (submitting for, then draining)", f"{args.seconds:g} s, {elapsed:.1f} s in all"),
        ("jobs SUCCEEDED", str(succeeded)),
        ("**jobs/s** (succeeded / run time)", f"**{succeeded / elapsed:.2f}**"),
        ("**submit latency p50 / p99**", f"**{pct(submits, 0.5) * 1000:.0f} ms / {pct(submits, 0.99) * 1000:.0f} ms**"),
        ("submit latency max", f"{max(submits, default=float('nan')) * 1000:.0f} ms"),
        ("end to end (submit → SUCCEEDED) p50 / p99", f"{pct(e2e, 0.5):.1f} s / {pct(e2e, 0.99):.1f} s"),
        ("**errors**", f"**{len(errors)}**"),
    ]
    table = "\n".join(["| measure | value |", "|---|---|", *[f"| {k} | {v} |" for k, v in rows]])
    md = f"""## Load: 32 concurrent clients (`bench/bench_load.py`)

Machine: {machine()}. Full stack on loopback: `fxport serve` (gRPC) + Redis 7 (AOF) as broker
and job store + {args.workers} Celery CPU worker(s) (prefork, concurrency 1, warm sandbox) +
SeaweedFS S3. Each client submits CORPUS["tiny_linear"] (ONNX target, one verification
sample) with its own idempotency key, follows the job over WatchJob to its end, and submits
again until {args.seconds:g} s are up; the jobs still running then are waited for. The model
is stored once (content-addressed), so a submit moves no model bytes.

{table}

Throughput is bounded by the workers (one job at a time each, on a machine whose 2 cores
also run the API, Redis, SeaweedFS and the clients); the submit latency is the API's under
{args.clients} concurrent clients with up to {args.clients} jobs in flight.
"""
    print(md)
    for e in errors[:10]:
        print("error:", e)
    if not args.no_report:
        write_section("load", md)
    if errors:
        sys.exit(1)


if __name__ == "__main__":
    main()
