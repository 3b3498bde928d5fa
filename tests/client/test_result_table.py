"""The CLI's artifact table (cli/result_table.py), from a manifest: a pure rendering."""

from __future__ import annotations

import io

from rich.console import Console

from fxport.cli.result_table import render_manifest


def test_a_folder_artifact_shows_its_file_count_not_one_files_digest():
    init, module = "a" * 64, "b" * 64
    manifest = {"artifacts": [
        {"format": "fx_source", "path": "fx_source/__init__.py", "bytes": 10, "sha256": init},
        {"format": "fx_source", "path": "fx_source/module.py", "bytes": 20, "sha256": module},
        {"format": "onnx", "path": "model.onnx", "bytes": 30, "sha256": "c" * 64},
    ], "verification": []}
    out = io.StringIO()
    render_manifest(manifest, Console(file=out, width=120))
    text = out.getvalue()
    assert "fx_source/" in text and "2 files" in text
    assert init[:10] not in text  # the digest of __init__.py does not stand for the folder
    assert "cccccccccc" in text  # a single file keeps its own
