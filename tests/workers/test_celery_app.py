"""Celery configuration: routing and the at-least-once settings (fxport/task_queue.py says why each one)."""

from __future__ import annotations

from fxport.config import Settings
from fxport.task_queue import BUILD_TENSORRT, RUN_JOB, create_celery_app, route_for


def test_routing_tensorrt_to_gpu_everything_else_to_cpu():
    app = create_celery_app(Settings(broker_url="redis://127.0.0.1:1/0"))
    router = app.amqp.router
    assert router.route({}, BUILD_TENSORRT)["queue"].name == "gpu"
    assert router.route({}, RUN_JOB)["queue"].name == "cpu"
    assert route_for(BUILD_TENSORRT) == "gpu" and route_for(RUN_JOB) == "cpu"
    assert {q.name for q in app.conf.task_queues} == {"cpu", "gpu"}


def test_reliability_settings():
    s = Settings(broker_url="redis://127.0.0.1:1/0", job_soft_time_limit_s=600, job_hard_time_limit_s=660,
                 visibility_timeout_s=90, unacked_restore_interval_s=5, worker_soft_shutdown_s=500)
    conf = create_celery_app(s).conf
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.task_soft_time_limit == 600 and conf.task_time_limit == 660
    # Redelivery after a whole-worker loss within visibility_timeout + restore interval; a
    # running job keeps its message fresh, so the timeout may be shorter than the hard limit.
    opts = conf.broker_transport_options
    assert opts["visibility_timeout"] == 90 and opts["unacked_restore_interval"] == 5
    assert opts["unacked_restore_throttle"] == 1  # else kombu sweeps only every 10th interval
    assert s.redelivery_bound_s == 95
    assert conf.worker_soft_shutdown_timeout == 500
    assert conf.broker_connection_max_retries is None
    assert conf.broker_url == "redis://127.0.0.1:1/0"


def test_a_lease_must_expire_before_redelivery():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="job_lease_s .* must be shorter than visibility_timeout_s"):
        Settings(visibility_timeout_s=30, job_lease_s=30)


def test_tasks_are_registered_under_their_names():
    import fxport.workers.tasks  # noqa: F401
    from fxport.workers.celery_app import app

    assert {RUN_JOB, BUILD_TENSORRT} <= set(app.tasks)


def test_hard_time_limit_marks_the_job_failed(tmp_path, monkeypatch):
    """A pool child killed at the hard limit never records its job; the task_failure hook does."""
    from celery.exceptions import TimeLimitExceeded

    import fxport.workers.tasks as tasks
    from fxport.jobs import InputRef, JobRecord, JobState, SqliteJobStore, new_job_id
    from fxport.storage import FileStore
    from fxport.workers.jobs import WorkerContext

    jobs = SqliteJobStore(tmp_path / "jobs.db")
    ctx = WorkerContext(jobs=jobs, artifacts=FileStore(tmp_path / "store"),
                        settings=Settings(job_hard_time_limit_s=60))
    monkeypatch.setattr(tasks, "_ctx", ctx)
    rec, _ = jobs.create(JobRecord(id=new_job_id(), tenant="default",
                                   model=InputRef(sha256="0" * 64, bytes=1, key="k")))
    jobs.transition(rec.id, state=JobState.RUNNING, stage="export")
    tasks._record_task_failure(sender=tasks.run_job, exception=TimeLimitExceeded(60), args=[rec.id])
    done = jobs.get(rec.id)
    assert done.state is JobState.FAILED and done.error.code == "timeout" and done.error.stage == "export"
    # Fired again (or for a job that already finished): nothing changes.
    tasks._record_task_failure(sender=tasks.run_job, exception=TimeLimitExceeded(60), args=[rec.id])
    assert jobs.get(rec.id) == done
    jobs.close()
