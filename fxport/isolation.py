"""The sandbox's layers as a manifest records them (its `sandbox` object), named for people.

Shared by the worker's log (workers/sandbox/layers.py), the CLI's result table and the report,
which all say the same thing the same way: which layers a job's child had, which it lacked.
"""

from __future__ import annotations

from typing import Any

# manifest key → what it means, in the order a reader meets them.
LAYER_LABELS = {
    "no_new_processes": "no processes",
    "sockets_blocked": "no sockets",
    "filesystem_reads_confined": "reads confined",
    "filesystem_writes_confined": "writes confined",
    "tcp_blocked": "no TCP",
    "signals_scoped": "signals scoped",
    "network_isolated": "network namespace",
    "capabilities_dropped": "no capabilities",
    "no_new_privs": "no_new_privs",
    "inherited_state_clean": "nothing inherited",
}
# The layers every job should have on Linux; missing ones are warned about. (A network
# namespace needs CAP_SYS_ADMIN, which pods lack: the socket filter stands in for it.)
EXPECTED = ("no_new_processes", "sockets_blocked", "filesystem_reads_confined", "filesystem_writes_confined",
            "capabilities_dropped", "inherited_state_clean")


def describe_layers(box: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(labels of the layers the job had, labels of the expected ones it lacked)."""
    have = [label for key, label in LAYER_LABELS.items() if box.get(key)]
    if box.get("unix_sockets_local") and "no sockets" in have:  # a GPU job (workers/sandbox/confine.py)
        have[have.index("no sockets")] = "no sockets but its own AF_UNIX ones"
    missing = [LAYER_LABELS[key] for key in EXPECTED if not box.get(key)]
    return have, missing
