"""Write one benchmark's section into docs/benchmarks.md between its own markers."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery figure here was written by a script in `bench/`; each section names its machine.\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{cpu}, {os.cpu_count()} cores, {mem_gib:.0f} GiB RAM, Python {platform.python_version()}"


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section `name` in docs/benchmarks.md."""
    DOC.parent.mkdir(exist_ok=True)
    text = DOC.read_text() if DOC.exists() else HEADER
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
