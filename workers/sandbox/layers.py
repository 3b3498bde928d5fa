"""Which layers a sandbox child really had, recorded by the worker, never taken from the child.

What the kernel shows about another process the worker reads itself, from /proc/<pid> while
the child runs: its seccomp filters and no_new_privs, its capabilities, its network namespace
against the worker's own, its rlimits. Landlock leaves no trace there, so for it (and for
the child's check of inherited state) the worker takes the child's layer report: the first
line on the events channel, written by fxport's code before the model file was opened, so no
model code can have written it (sandbox/child.py). Anything the model writes later (a
"sandbox" key in its result, a second report) is ignored.

`record` makes the manifest's `sandbox` object; `log_layers` says it in the worker's log.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fxport.isolation import LAYER_LABELS, describe_layers

log = logging.getLogger("fxport.workers.sandbox")

# From the child's report (sent before the model was read): what /proc cannot show.
REPORTED_KEYS = ("filesystem_reads_confined", "filesystem_writes_confined", "tcp_blocked", "signals_scoped",
                 "landlock_abi", "inherited_state_clean", "setup_ms", "unix_sockets_local")


class ChildGone(Exception):
    """The child exited before it could be looked at."""


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def _limits(pid: int) -> dict[str, int | None]:
    """/proc/<pid>/limits: soft limits by name; None = unlimited."""
    out: dict[str, int | None] = {}
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines()[1:]:
        # "Max address space            8589934592           8589934592           bytes"
        name, soft = line[:26].strip(), line[26:47].strip()
        out[name] = None if soft == "unlimited" else int(soft)
    return out


def measure(pid: int, alive: Callable[[], bool]) -> dict[str, Any]:
    """What /proc says about the child `pid`. `alive()` is asked afterwards: a child that had
    already exited (and whose pid may have been reused) raises ChildGone."""
    status = _status(pid)
    limits = _limits(pid)
    try:
        isolated = os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
    except OSError:
        isolated = False
    if not alive():
        raise ChildGone(pid)
    caps = [int(status.get(k, "0"), 16) for k in ("CapInh", "CapPrm", "CapEff", "CapAmb")]
    address_space = limits.get("Max address space")
    return {
        "seccomp_filters": int(status.get("Seccomp_filters", "0") or 0) if status.get("Seccomp") == "2" else 0,
        "no_new_privs": status.get("NoNewPrivs") == "1",
        "capabilities_dropped": not any(caps),
        "network_isolated": isolated,
        "memory_limit_mb": address_space >> 20 if address_space else None,
        "cpu_limit_s": limits.get("Max cpu time"),
        "file_size_limit_mb": (limits.get("Max file size") or 0) >> 20 or None,
        "open_files_limit": limits.get("Max open files"),
        "tasks_bounded": _tasks_bound(pid, limits, int(status.get("Uid", "0").split()[0] or 0)),
    }


def _tasks_bound(pid: int, limits: dict[str, int | None], uid: int) -> str | None:
    """How the threads the child may hold are bounded (confine.bound_tasks): its own pids cgroup,
    RLIMIT_NPROC (which the kernel enforces on a non-root uid only), or None."""
    from fxport.workers.sandbox.confine import JOB_CGROUP_PREFIX

    try:
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "pids" in controllers.split(",") and path.rstrip("/").endswith(f"/{JOB_CGROUP_PREFIX}{pid}"):
                return "pids_cgroup"
    except (OSError, ValueError):
        pass
    return "rlimit_nproc" if uid != 0 and limits.get("Max processes") is not None else None


def record(measured: dict[str, Any] | None, reported: dict[str, Any] | None, *,
           measure_error: str | None = None) -> dict[str, Any]:
    """The manifest's `sandbox` object: the keys it always had (add, never rename), each from
    the worker's measurement where the kernel shows it, else from the pre-model report.
    `sources` says which came from where."""
    m, r = measured or {}, reported or {}
    errors = [str(e) for e in (r.get("errors") or [])][:20]
    if measured is None:
        errors.append(f"the worker could not look at the child: {measure_error or 'it had exited'}")
    if reported is None:
        errors.append("the child sent no layer report before running the model")
    # The filter is ours when the child installed one filter and says it did: a child cannot
    # remove a filter, and the zygote it is forked from has none.
    seccomp = bool(m.get("seccomp_filters")) and bool(r.get("no_new_processes"))
    out: dict[str, Any] = {
        "network_isolated": bool(m.get("network_isolated")),
        "memory_limit_mb": m.get("memory_limit_mb"),
        "cpu_limit_s": m.get("cpu_limit_s"),
        "no_new_processes": seccomp,
        "sockets_blocked": seccomp and bool(r.get("sockets_blocked")),
        "no_new_privs": bool(m.get("no_new_privs")),
        "capabilities_dropped": bool(m.get("capabilities_dropped")),
        "seccomp_filters": m.get("seccomp_filters", 0),
        "file_size_limit_mb": m.get("file_size_limit_mb"),
        "open_files_limit": m.get("open_files_limit"),
        "tasks_bounded": m.get("tasks_bounded"),  # "pids_cgroup", "rlimit_nproc" or None
        **{key: r.get(key, False if key in LAYER_LABELS else None) for key in REPORTED_KEYS},
        "landlock_abi": r.get("landlock_abi", 0),
        "sources": {"measured_by_worker": sorted(m) if measured is not None else [],
                    "reported_before_model_code": list(REPORTED_KEYS) if reported is not None else []},
    }
    if errors:
        out["errors"] = errors
    return out


def log_layers(job_id: str, box: dict[str, Any]) -> None:
    """One line per job naming the layers it had; a warning naming any it lacked."""
    have, missing = describe_layers(box)
    log.info("job %s: sandbox layers: %s (Landlock ABI %s, recorded by the worker)", job_id, ", ".join(have) or "none",
             box.get("landlock_abi"))
    if missing or box.get("errors"):
        log.warning("job %s: sandbox layers missing: %s%s", job_id, ", ".join(missing) or "none",
                    "; " + "; ".join(box.get("errors", ())) if box.get("errors") else "")
