"""The sandbox: every load and forward of a user's model runs in a child process of the worker
(docs/architecture.md, "Trust boundaries"), inside a boundary made of layers that each hold on their own:

- nothing to connect to: seccomp refuses sockets of every family and io_uring (unprivileged,
  so also in a Kubernetes pod); an empty network namespace where the worker may make one;
- nothing to read or write but its own: Landlock limits reads to the interpreter, the
  installed packages, shared libraries and the job's own inputs and folder, and writes to that
  folder; each job's folder is private to it;
- nothing inherited: a scrubbed environment, no file descriptor or writable shared mapping of
  the warm parent (checked in the child, which fails closed), rlimits and a wall clock;
- nothing trusted from the child: the worker reads what it wrote without following links and
  with every size bounded, and records the layers itself.

Modules: `run` (the worker's side: run_engine_job), `launch` (warm zygote or fresh
interpreter), `zygote`, `child` (the child's side), `confine` (the child's layers), `events`
(the bounded event channel), `layers` (what the worker records), `beneath` (reading what the
child wrote, links never followed).
"""

from fxport.workers.sandbox.launch import (
    SANDBOX_HUGE_PAGES,
    SANDBOX_MALLOC_TUNABLES,
    WarmSandbox,
    available_cpus,
    kill_job,
    prestart,
)
from fxport.workers.sandbox.run import MAX_MANIFEST_BYTES, TIMING_CACHE_OUT, draw_report, run_engine_job

__all__ = [
    "MAX_MANIFEST_BYTES", "SANDBOX_HUGE_PAGES", "SANDBOX_MALLOC_TUNABLES", "TIMING_CACHE_OUT", "WarmSandbox",
    "available_cpus", "draw_report", "kill_job", "prestart", "run_engine_job",
]
