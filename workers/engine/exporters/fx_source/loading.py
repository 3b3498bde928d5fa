"""The written module.py imported once, as a module of its own, before the exporter returns."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from pathlib import Path

from fxport.errors import ConversionFailed
from fxport.workers.engine.exporters.fx_source.common import _HINT, _first_line


def check_imports(path: Path) -> None:
    """Import the written module.py once, as a module of its own (nothing else sees it): a source that
    cannot even be imported fails the fx_source target here, naming the line, rather than later in
    verification or on the user's machine. Its class is not built: verification does that."""
    name = f"_fxport_fx_source_check_{os.getpid()}_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # no __pycache__ inside the artifact folder: it would ship as stray files
    writes_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        lineno = exc.lineno if isinstance(exc, SyntaxError) else _line_in(exc, path)
        lines = path.read_text().splitlines()
        where = f"line {lineno} `{lines[lineno - 1].strip()}`" if lineno and 0 < lineno <= len(lines) else "it"
        raise ConversionFailed(
            f"fx_source: the written {path.name} does not import: {where} raised {type(exc).__name__}: "
            f"{_first_line(exc)}", stage="export",
            hint="a missing module on that line must be installed where the source is made and loaded; or "
                 f"capture the model at aten level (spec `capture: export`); or {_HINT}",
        ) from exc
    finally:
        sys.modules.pop(name, None)
        sys.dont_write_bytecode = writes_bytecode


def _line_in(exc: BaseException, path: Path) -> int | None:
    """The line of `path` the exception passed through last (the failing statement of module.py)."""
    lines = [f.lineno for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    return lines[-1] if lines else None
