"""The benchmark stage's measurements (workers/engine/benchmark.py) on a tiny model, in process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxport.spec import BenchmarkOptions, DynamicDim, InputSpec
from fxport.workers.engine.benchmark import default_batches, measure, point_for
from fxport.workers.engine.inputs import InputSignature
from fxport.workers.engine.verify.runners import EagerRunner, Runner, TorchScriptRunner

SIG = InputSignature(inputs=[InputSpec(name="x", shape=["batch", 8])],
                     dynamic_dims={"batch": DynamicDim(min=1, opt=4, max=16)})


@pytest.fixture()
def runners(tmp_path: Path) -> list[Runner]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).eval()
    path = tmp_path / "model.ts"
    torch.jit.save(torch.jit.trace(model, torch.randn(2, 8)), str(path))
    return [EagerRunner(model), TorchScriptRunner(path)]


def test_rows_are_consistent_and_the_verified_fastest_is_recommended(runners):
    bench = measure(runners, SIG, BenchmarkOptions(runs=20, warmup=2), verified={"torchscript"}, seed=0)
    assert bench["skipped"] == []
    assert bench["settings"]["batches"] == [1, 4, 16]  # the batch dim's min, opt and max
    assert {(r["artifact"], r["batch"]) for r in bench["results"]} == {
        (a, b) for a in ("eager", "torchscript") for b in (1, 4, 16)}
    for r in bench["results"]:
        assert 0 < r["p50_ms"] <= r["p95_ms"]
        assert r["throughput_per_s"] == pytest.approx(r["batch"] * 1000 / r["p50_ms"], rel=1e-3)
        assert r["runs"] == 20 and r["threads"] == torch.get_num_threads() and r["verified"]
        assert r["peak_rss_mib"] is None or r["peak_rss_mib"] > 10
    pick = bench["recommendation"]
    assert pick["artifact"] == "torchscript"  # the only artifact: the eager original is the baseline
    assert pick["batch"] in (1, 4, 16) and pick["reason"].startswith("torchscript: ")
    assert bench["machine"]["usable_cpus"] >= 1


class SlowRunner(Runner):
    """Each run advances the fake clock by 1 s."""

    def __init__(self, name: str, clock: list[float]) -> None:
        self.name, self.clock = name, clock

    def infer(self, args: tuple) -> list:
        self.clock[0] += 1.0
        return []


def test_max_seconds_cuts_the_stage_short_and_names_what_it_skipped():
    now = [0.0]
    runners = [SlowRunner("eager", now), SlowRunner("onnx", now), SlowRunner("torchscript", now)]
    opts = BenchmarkOptions(runs=50, warmup=0, max_seconds=10, batches=[1, 4])
    bench = measure(runners, SIG, opts, verified={"onnx", "torchscript"}, seed=0, clock=lambda: now[0])
    # 6 measurements of at least 3 runs of 1 s share 10 s: each takes its share of what is left
    measured = [(r["artifact"], r["batch"], r["runs"]) for r in bench["results"]]
    assert measured == [("eager", 1, 3), ("eager", 4, 3), ("onnx", 1, 3)]
    assert now[0] <= 10 + 1  # the deadline held, to within the one run in flight
    assert [(s["artifact"], s["batch"]) for s in bench["skipped"]] == [("onnx", 4), ("torchscript", 1),
                                                                       ("torchscript", 4)]
    assert bench["skipped"][0]["reason"] == "only 2 run(s) fit in the stage's max_seconds (10 s)"
    assert all(s["reason"] == "the stage's max_seconds (10 s) ran out before it" for s in bench["skipped"][1:])
    assert bench["recommendation"]["artifact"] == "onnx"


def test_batches_outside_the_range_or_against_a_static_batch_are_skipped_with_why(runners):
    assert point_for(SIG, 32) == "batch 32 is outside the model's batch range 1..16"
    static = InputSignature(inputs=[InputSpec(name="x", shape=[2, 8])], dynamic_dims={})
    assert default_batches(static) == [2] and point_for(static, 4) == "the model's batch is static (2)"
    bench = measure(runners[:1], SIG, BenchmarkOptions(runs=3, warmup=0, batches=[1, 32]), verified=set(), seed=0)
    assert [r["batch"] for r in bench["results"]] == [1]
    assert bench["skipped"] == [{"artifact": "eager", "batch": 32,
                                 "reason": "batch 32 is outside the model's batch range 1..16"}]
    assert bench["recommendation"] is None  # only the baseline ran


def test_a_runtime_that_cannot_load_is_skipped_not_fatal(runners, tmp_path: Path):
    broken = TorchScriptRunner(tmp_path / "missing.ts")
    bench = measure([runners[0], broken], SIG, BenchmarkOptions(runs=3, warmup=0, batches=[1]), verified=set(),
                    seed=0)
    assert bench["skipped"][0]["artifact"] == "torchscript"
    assert bench["skipped"][0]["reason"].startswith("could not load: ")


def test_an_onnx_upload_is_benchmarked_in_onnxruntime(tmp_path: Path):
    """No eager original exists for an ONNX upload: its one artifact (the upload itself) is timed alone."""
    import warnings

    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert

    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).eval()
    path = tmp_path / "upload.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 8),), str(path), input_names=["x"], dynamo=False,
                          dynamic_axes={"x": {0: "batch"}})
    spec = parse_spec({"inputs": [{"name": "x", "shape": ["batch", 8]}],
                       "dynamic_dims": {"batch": {"min": 1, "opt": 2, "max": 8}}, "targets": ["onnx"],
                       "benchmark": {"runs": 3, "warmup": 0}})
    bench = convert(path, spec, tmp_path / "out")["benchmark"]
    assert [(r["artifact"], r["batch"]) for r in bench["results"]] == [("onnx", 1), ("onnx", 2), ("onnx", 8)]
    assert bench["recommendation"]["artifact"] == "onnx"


class _HoldsMemory(Runner):
    """A runtime whose loaded artifact takes `mib` of resident memory (touched, so it counts)."""

    def __init__(self, name: str, mib: int) -> None:
        self.name, self.runtime, self.mib = name, "test", mib
        self.held: object = None

    def activate(self) -> None:
        import numpy as np

        self.held = np.ones(self.mib << 18, dtype=np.float32)  # mib MiB, every page written

    def deactivate(self) -> None:
        self.held = None

    def infer(self, args: tuple) -> list:
        return []


def test_an_artifacts_memory_is_what_it_adds_not_the_processes_peak():
    """The peak-RSS column read 503 MiB in all 15 rows of a real job: the sandbox process's own
    high-water mark (torch, every library), not the artifact's. Two artifacts 20× apart in size
    must now read apart by about their difference, in either order."""
    opts = BenchmarkOptions(runs=3, warmup=0, batches=[1])
    for order in (("small", "big"), ("big", "small")):
        runners = [_HoldsMemory(name, 8 if name == "small" else 160) for name in order]
        bench = measure(runners, SIG, opts, verified={"small", "big"}, seed=0)
        memory = {r["artifact"]: r["memory_mib"] for r in bench["results"]}
        if None in memory.values():
            pytest.skip("this kernel cannot reset the peak-RSS mark (/proc/self/clear_refs)")
        assert memory["big"] - memory["small"] > 100, (order, memory)
        assert memory["small"] < 60, (order, memory)


class _Loaded(Runner):
    """A runtime taking `ms` per run on a fake clock, `busy`× longer while the machine is busy."""

    def __init__(self, name: str, ms: float, clock: list[float], busy: dict[str, float]) -> None:
        self.name, self.runtime, self.ms, self.clock, self.busy = name, "test", ms, clock, busy

    def activate(self) -> None:
        self.busy["activations"] = self.busy.get("activations", 0) + (self.name == "eager")

    def infer(self, args: tuple) -> list:
        spell = self.busy["factor"] if self.busy.get("activations") == 2 else 1.0  # round 2 is busy
        self.clock[0] += self.ms * spell / 1000
        return []


def test_rounds_spread_a_busy_spell_over_every_runtime_and_flag_it():
    """A spell of load used to fall on one runtime (eager's batch-1 p50 read 6.06 ms in one run and
    0.211 ms in the next, and the pick rested on "385× eager"). The runtimes now take turns in
    rounds: the spell shows in every row's range, the machine is flagged noisy, and onnx, faster
    in every round, is still the pick."""
    now, busy = [0.0], {"factor": 20.0}
    runners = [_Loaded("eager", 1.0, now, busy), _Loaded("onnx", 0.2, now, busy)]
    bench = measure(runners, SIG, BenchmarkOptions(runs=30, warmup=0, batches=[1]), verified={"onnx"}, seed=0,
                    clock=lambda: now[0])
    rows = {r["artifact"]: r for r in bench["results"]}
    assert all(r["rounds"] == 3 and r["runs"] == 30 for r in rows.values())
    assert rows["eager"]["round_p50_ms"] == pytest.approx([1.0, 20.0, 1.0])
    assert rows["onnx"]["round_p50_ms"] == pytest.approx([0.2, 4.0, 0.2])
    assert bench["noise"]["noisy"] and bench["noise"]["worst"]["spread"] == pytest.approx(20.0)
    assert rows["eager"]["p50_ms"] == pytest.approx(1.0)  # the p50 over all runs rides out one busy round
    assert bench["recommendation"]["artifact"] == "onnx"  # eager is the baseline, not a competitor
