"""The benchmark's pure parts (fxport/benchmark.py): the recommendation, merging a GPU stage's
rows, the machine description, and the spec's `benchmark` key and flag."""

from __future__ import annotations

import pytest

from fxport.benchmark import machine_info, merge, rate, recommend, table
from fxport.errors import SpecError
from fxport.spec import parse_spec, spec_from_flags


def row(artifact: str, batch: int, p50: float, *, verified: bool = True) -> dict:
    return {"artifact": artifact, "runtime": artifact, "batch": batch, "p50_ms": p50, "p95_ms": p50 * 1.1,
            "mean_ms": p50, "throughput_per_s": batch * 1000 / p50, "peak_rss_mib": 500.0, "threads": 2,
            "runs": 50, "verified": verified}


RESULTS = [row("eager", 1, 10.0), row("eager", 8, 60.0), row("eager", 32, 200.0),
           row("onnx", 1, 4.0), row("onnx", 8, 20.0), row("onnx", 32, 60.0),
           row("torchscript", 1, 5.0), row("torchscript", 8, 18.0), row("torchscript", 32, 70.0)]


def test_the_fastest_verified_artifact_at_each_batch_and_one_overall_pick():
    pick = recommend(RESULTS)
    assert [(p["batch"], p["artifact"]) for p in pick["per_batch"]] == [(1, "onnx"), (8, "torchscript"), (32, "onnx")]
    assert pick["artifact"] == "onnx"  # fastest at 2 of 3 batch sizes
    assert pick["batch"] == 32  # of the batches it is fastest at, the one with the most throughput
    assert pick["reason"].startswith("onnx: 2.5× eager at batch 1, 3.0× at 8, 3.3× at 32; fastest at 2 of 3")
    assert pick["per_batch"][0]["speedup_vs_eager"] == 2.5


def test_an_unverified_artifact_is_never_recommended_and_ties_go_to_the_less_slow():
    rows = [*RESULTS, row("fx_source", 1, 1.0, verified=False), row("fx_source", 8, 1.0, verified=False)]
    assert recommend(rows)["artifact"] == "onnx"
    tie = [row("eager", 1, 10), row("a", 1, 5), row("b", 1, 5.5), row("a", 2, 10), row("b", 2, 8)]
    assert recommend(tie)["artifact"] == "b"  # one win each; b is 1.1× the best at 1, a 1.25× at 2: b lags less
    assert recommend([row("eager", 1, 10), row("onnx", 1, 5, verified=False)]) is None


def test_merging_the_tensorrt_stage_recommends_over_both():
    cpu = {"results": RESULTS, "skipped": [], "recommendation": recommend(RESULTS), "seconds": 10.0,
           "machine": {"cpu": "Xeon", "gpu": None}}
    gpu = {"results": [row("tensorrt", 1, 0.5), row("tensorrt", 8, 1.5), row("tensorrt", 32, 5.0)],
           "skipped": [{"artifact": "tensorrt", "batch": 64, "reason": "outside"}], "seconds": 3.0,
           "machine": {"cpu": "EPYC", "gpu": "NVIDIA H200"}}
    merged = merge(cpu, gpu)
    assert merged["recommendation"]["artifact"] == "tensorrt" and "20.0× eager at batch 1" in merged["recommendation"][
        "reason"]
    assert merged["machine"] == {"cpu": "Xeon", "gpu": "NVIDIA H200"} and merged["seconds"] == 13.0
    assert len(merged["results"]) == 12 and merged["skipped"] == gpu["skipped"]
    assert merge(None, gpu) is gpu and merge(cpu, None) is cpu


def test_table_rows_carry_the_speedup_over_eager():
    rows = {(r["artifact"], r["batch"]): r for r in table({"results": RESULTS})}
    assert rows[("eager", 8)]["speedup_vs_eager"] == 1.0
    assert rows[("torchscript", 8)]["speedup_vs_eager"] == pytest.approx(60 / 18)
    assert [r["artifact"] for r in table({"results": RESULTS})][:3] == ["eager"] * 3
    assert (rate(812.4), rate(12_400), rate(2_930_000)) == ("812/s", "12.4k/s", "2.93M/s")


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse4_2 avx avx2 fma avx512f avx512_vnni amx_tile amx_int8
"""


def test_machine_info_names_the_cpu_and_the_features_that_decide_speed():
    info = machine_info(CPUINFO)
    assert info["cpu"] == "Intel(R) Xeon(R) Platinum 8480C"
    assert info["isa"] == ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]
    assert info["usable_cpus"] >= 1 and info["gpu"] is None
    arm = machine_info("processor\t: 0\nFeatures\t: fp asimd asimddp sve\nCPU part\t: 0xd40\n")
    assert arm["isa"] == ["asimd", "asimddp", "sve"]


def test_the_spec_turns_the_benchmark_on_and_checks_its_options():
    assert parse_spec({}).benchmark is None
    assert "benchmark" not in parse_spec({}).normalized()  # specs without one keep their digests
    on = parse_spec({"benchmark": True}).benchmark
    assert (on.warmup, on.runs, on.batches, on.max_seconds) == (10, 50, None, 120.0)
    assert parse_spec({"benchmark": False}).benchmark is None
    assert parse_spec({"benchmark": {"batches": [8, 1, 8]}}).benchmark.batches == [1, 8]
    assert parse_spec(spec_from_flags({}, benchmark=True)).benchmark is not None
    assert parse_spec(spec_from_flags({"benchmark": {"runs": 5}}, benchmark=True)).benchmark.runs == 5
    with pytest.raises(SpecError) as info:
        parse_spec({"benchmark": {"batches": [0], "runz": 3, "max_seconds": 0}})
    fields = {path for path, _ in info.value.violations}
    assert fields == {"benchmark.batches", "benchmark.runz", "benchmark.max_seconds"}


def ranged(artifact: str, batch: int, rounds: list[float]) -> dict:
    """A row measured in rounds: p50 over them all (here their median), the rounds' range."""
    return {**row(artifact, batch, sorted(rounds)[len(rounds) // 2]), "p50_range_ms": [min(rounds), max(rounds)],
            "round_p50_ms": rounds, "rounds": len(rounds)}


def test_an_artifact_is_recommended_only_where_its_interval_clears_the_others():
    from fxport.benchmark import no_clear_winner

    eager = ranged("eager", 1, [1.0, 1.1, 0.9])
    overlapping = [eager, ranged("onnx", 1, [0.30, 0.28, 0.33]), ranged("torchscript", 1, [0.32, 0.31, 0.40])]
    assert recommend(overlapping) is None  # onnx's p50 is lower, but not by more than the rounds disagree
    (unclear,) = no_clear_winner(overlapping)
    assert unclear["artifacts"] == ["onnx", "torchscript"] and "overlap across rounds" in unclear["reason"]
    assert "onnx (0.28–0.33 ms) and torchscript (0.31–0.4 ms)" in unclear["reason"]

    separated = [eager, ranged("onnx", 1, [0.30, 0.28, 0.33]), ranged("torchscript", 1, [0.50, 0.45, 0.55])]
    assert recommend(separated)["artifact"] == "onnx" and no_clear_winner(separated) == []
    # rows from before rounds (no range) keep today's rule: the lowest p50 wins
    assert recommend(RESULTS)["artifact"] == "onnx"


def test_noise_names_the_row_whose_rounds_disagreed_most():
    from fxport.benchmark import noise

    quiet = [ranged("eager", 1, [1.0, 1.1, 0.95]), ranged("onnx", 1, [0.30, 0.31, 0.29])]
    assert noise(quiet)["noisy"] is False
    busy = [ranged("eager", 1, [0.211, 6.06, 0.25]), ranged("onnx", 1, [0.036, 0.04, 0.035])]
    found = noise(busy)
    assert found["noisy"] and found["worst"]["artifact"] == "eager" and found["worst"]["spread"] > 25
