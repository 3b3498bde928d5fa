"""The manifest's artifact records: every file of every artifact, with its size and sha256, in order,
whether the files are hashed side by side or, where no thread can start, one after another."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest
import torch

from fxport.workers.engine.publish import records_of


def _artifacts(out: Path) -> list[tuple[str, Path, str | None]]:
    (out / "model.ts").write_bytes(b"ts" * 70_000)
    (out / "model.onnx").write_bytes(b"onnx-graph")
    (out / "model.onnx.data").write_bytes(bytes(range(256)) * 900)  # the ONNX model's weights beside it
    (out / "fx_source").mkdir()
    (out / "fx_source" / "module.py").write_text("class FxModule: ...\n")
    (out / "fx_source" / "weights.safetensors").write_bytes(b"\0" * 4096)
    return [("torchscript", out / "model.ts", None), ("onnx", out / "model.onnx", "onnxruntime"),
            ("fx_source", out / "fx_source", None)]


def _expected(out: Path) -> list[tuple[str, str, int, str]]:
    files = [("torchscript", "model.ts"), ("onnx", "model.onnx"), ("onnx", "model.onnx.data"),
             ("fx_source", "fx_source/module.py"), ("fx_source", "fx_source/weights.safetensors")]
    return [(fmt, name, (out / name).stat().st_size, hashlib.sha256((out / name).read_bytes()).hexdigest())
            for fmt, name in files]


@pytest.mark.parametrize("threads_start", [True, False], ids=["side_by_side", "no_thread_can_start"])
def test_every_file_is_recorded_with_its_own_size_and_digest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               threads_start: bool) -> None:
    artifacts = _artifacts(tmp_path)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    started: list[str] = []
    real_start = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if not threads_start:
            raise RuntimeError("can't start new thread")
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    records = records_of(artifacts, tmp_path)
    assert [(r.format, r.path, r.bytes, r.sha256) for r in records] == _expected(tmp_path)
    assert [r.int8_scheme for r in records] == [None, "onnxruntime", "onnxruntime", None, None]
    assert bool(started) is threads_start  # side by side when threads start, and only then
