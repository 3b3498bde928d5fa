"""The whole TensorRT GPU check in one go; its figures go to one JSON file.

On a machine with an NVIDIA GPU (driver with CUDA 12+), from the repository root:

    pip install -e '.[worker,gpu]' && python bench/gpu_check.py [OUT.json] [--docs]

(default output: $OUT/gpu_check.json when OUT is set, else ./gpu_check.json; --docs also
writes the "tensorrt" section of docs/benchmarks.md). What it does, ResNet-18 (tests/models,
random weights, 224x224), dynamic batch 1..16 (opt 8):
0. first, with or without TensorRT: the GPU, torch and CUDA; whether CUDA works behind the
   layers a GPU job's sandbox child applies (a fresh interpreter confined as sandbox/child.py
   confines a TensorRT job, beside a control run without the layers); without TensorRT the
   check stops after eager torch's latency and says why TensorRT would not import;
1. the CPU stage per precision — fp32, fp16 (fxport's half graph) and int8 (Q/DQ from
   fxport's quantizer, random calibration data): model.onnx, preflighted;
2. per precision, a TensorRT build with a cold timing cache, then a rebuild with the warm
   cache it left (build time cold vs warm, as a ratio), each verified as a job verifies it
   (against onnxruntime on the ONNX model, at the profile's min and max shapes);
3. latency of the engine vs eager torch on the same GPU at batch 1 and 8 (median of CUDA-event
   timings on device-resident buffers; eager fp32 and fp16, the engine per precision);
4. the fp32 build once more inside the sandbox, as a GPU worker runs it (`sandboxed_build`):
   whether CUDA and TensorRT work behind its seccomp filter and Landlock rules, and the layers
   it recorded.
Each step's failure is recorded in the JSON and the rest still runs. The JSON is rewritten
after every step, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._report import machine  # noqa: E402

BATCH = (1, 8, 16)
LATENCY_BATCHES = (1, 8)
PRECISIONS = ("fp32", "fp16", "int8")


def out_path(argv: list[str]) -> Path:
    given = [a for a in argv[1:] if not a.startswith("--")]
    if given:
        return Path(given[0])
    return Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else Path("gpu_check.json")


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"check": "fxport TensorRT GPU check (bench/gpu_check.py)",
                                     "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                                     "machine": machine(), "status": "running", "errors": {}}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def step(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        try:
            return fn()
        except BaseException as exc:  # noqa: BLE001 - every failure is a finding of the check
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}\n" + traceback.format_exc()[-3000:]
            if isinstance(exc, KeyboardInterrupt):
                raise
            return None
        finally:
            self.data.setdefault("step_s", {})[name] = round(time.perf_counter() - start, 2)
            self.save()


def gpu_ms(fn: Callable[[], Any], stream: Any = None, runs: int = 50, warmup: int = 10) -> float:
    """Median device time of `fn` in ms (CUDA events on `stream`, default: the current stream)."""
    import torch

    stream = stream or torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        stream.synchronize()
        times = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return round(statistics.median(times), 4)


def environment() -> dict[str, Any]:
    """The GPU, torch and CUDA; TensorRT's version, or why it cannot be imported (the checks
    that need no TensorRT still run without it)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch sees no CUDA device (a CPU-only torch wheel, or no driver)")
    env: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0),
                           "compute_capability": "{}.{}".format(*torch.cuda.get_device_capability(0)),
                           "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                           "kernel": platform.release()}
    try:
        import tensorrt as trt
    except ImportError as exc:
        env["tensorrt"] = None
        env["tensorrt_import_error"] = f"{type(exc).__name__}: {exc}"
        return env
    from fxport.workers.engine.tensorrt.builder import cuda_driver_version
    from fxport.workers.engine.tensorrt.timing_cache import cache_key, probe_device_identity

    identity = probe_device_identity()
    env.update(tensorrt=trt.__version__, cuda_driver=cuda_driver_version(),
               timing_cache_key=cache_key(identity, None) if identity else None)
    return env


# Run in a fresh interpreter: the layers a GPU job's sandbox child applies (sandbox/child.py with
# a TensorRT request: no address-space limit, GPU devices readable and writable), then CUDA's
# first use and one matrix product. argv: repo root, work folder, mode: "none" (control), "layers"
# (all of them, as a job has them) or one layer alone ("seccomp", "landlock", "netns", "caps").
CUDA_PROBE = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import fxport.workers.sandbox.confine as c
work, mode = Path(sys.argv[2]), sys.argv[3]
result = {}
if mode == "layers":
    result["network_isolated"] = c.apply_limits(16 << 30, 300, True, limit_address_space=False)
    result["layers"] = c.confine([work], [], gpu=True)
elif mode == "netns":
    result["network_isolated"] = c.apply_limits(16 << 30, 300, True, limit_address_space=False)
elif mode == "landlock":
    c._no_new_privs()
    abi = c.landlock_abi()
    result["layers"] = c.restrict_filesystem_and_network(c.landlock_rules([work], [], abi, gpu=True), abi)
elif mode == "seccomp":
    c._no_new_privs()
    c.install_seccomp(c.seccomp_program(unix_sockets=True))
elif mode == "caps":
    result["capabilities_dropped"] = c.drop_capabilities()
t0 = time.perf_counter()
try:
    import torch
    x = torch.randn(2048, 2048, device="cuda")
    result["checksum"] = round(float((x @ x).float().abs().mean()), 3)
    torch.cuda.synchronize()
    result.update(cuda_ok=True, device=torch.cuda.get_device_name(0))
except BaseException as exc:
    result.update(cuda_ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
result["first_use_s"] = round(time.perf_counter() - t0, 2)
print(json.dumps(result, default=str))
"""


def cuda_behind_sandbox(tmp: Path) -> dict[str, Any]:
    """Whether CUDA works behind the GPU job's sandbox layers, beside a control run without them;
    where it does not, each layer alone, so the report names the one that stops it."""
    import subprocess

    repo = str(Path(__file__).resolve().parent.parent)
    out: dict[str, Any] = {}

    def probe(mode: str) -> dict[str, Any]:
        proc = subprocess.run([sys.executable, "-c", CUDA_PROBE, repo, str(tmp), mode],
                              capture_output=True, text=True, timeout=300)
        lines = proc.stdout.strip().splitlines()
        try:
            found = json.loads(lines[-1]) if lines else {}
        except json.JSONDecodeError:
            found = {"stdout": proc.stdout[-2000:]}
        return {**found, "returncode": proc.returncode, "stderr": proc.stderr[-2000:]}

    for mode in ("none", "layers"):
        out[mode] = probe(mode)
    if out["none"].get("cuda_ok") and not out["layers"].get("cuda_ok"):
        out["each_layer_alone"] = {mode: bool(probe(mode).get("cuda_ok"))
                                   for mode in ("seccomp", "landlock", "netns", "caps")}
    return out


def eager_latency() -> dict[str, Any]:
    """Eager torch on the GPU, ResNet-18 fp32 and fp16, at each latency batch (median ms)."""
    import torch

    from tests.models import get

    case = get("resnet18")
    eager, eager_half = case.build().cuda().eval(), case.build().cuda().eval().half()
    out: dict[str, Any] = {}
    with torch.no_grad():
        for b in LATENCY_BATCHES:
            x = torch.randn(b, 3, 224, 224, device="cuda")
            out[f"batch{b}"] = {"fp32": gpu_ms(lambda: eager(x)), "fp16": gpu_ms(lambda: eager_half(x.half()))}
    return out


def warm_up_process(tmp: Path) -> None:
    """Build one tiny engine first, so the cold build below times the model, not CUDA/TensorRT start-up."""
    import onnx
    from onnx import TensorProto, helper

    from fxport.workers.engine.tensorrt.builder import EngineBytesFromNetwork, NetworkFromOnnxPath, plan_precision

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "warm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp / "warm.onnx"))
    import tensorrt as trt

    plan = plan_precision("fp32", onnx_has_fp16=False, onnx_has_qdq=False,
                          builder_flags={n for n in dir(trt.BuilderFlag) if n.isupper()})
    EngineBytesFromNetwork(NetworkFromOnnxPath(tmp / "warm.onnx"), plan=plan, workspace_mb=256)()


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    report = Report(out_path(argv))
    report.save()
    env = report.step("environment", environment)
    if env is None:
        report.data["status"] = "no GPU: nothing measured (see errors.environment)"
        report.save()
        print(f"gpu check: {report.data['status']} -> {report.path}", file=sys.stderr)
        return 2
    report.data["environment"] = env
    with tempfile.TemporaryDirectory(prefix="fxport-gpu-probe-") as probe_tmp:
        report.data["cuda_behind_sandbox"] = report.step("cuda_behind_sandbox",
                                                         lambda: cuda_behind_sandbox(Path(probe_tmp)))
    # eager torch on the GPU, the baseline for every precision
    eager_ms: dict[str, Any] = report.step("eager_latency", eager_latency) or {}
    report.data["eager_torch_ms"] = eager_ms
    if env.get("tensorrt") is None:
        report.data["status"] = f"no TensorRT: {env['tensorrt_import_error']}; engine steps not run"
        report.data["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        report.save()
        print(json.dumps({"status": report.data["status"], "out": str(report.path)}))
        return 2

    import torch

    from fxport.spec import parse_spec
    from fxport.workers.engine.pipeline import convert
    from fxport.workers.engine.tensorrt.runner import TrtRunner
    from tests.models import get
    from tests.workers.engine.conftest import save_pt2, spec_dict

    case = get("resnet18")
    report.data["model"] = {"name": "resnet18 (tests/models, random weights)", "input": [None, 3, 224, 224],
                            "batch": dict(zip(("min", "opt", "max"), BATCH))}
    results: dict[str, Any] = {}
    report.data["precisions"] = results
    with tempfile.TemporaryDirectory(prefix="fxport-gpu-check-") as tmp_str:
        tmp = Path(tmp_str)
        report.step("warm_up", lambda: warm_up_process(tmp))
        pt2 = save_pt2(case, tmp / "resnet18.pt2")


        for precision in PRECISIONS:
            row: dict[str, Any] = {}
            results[precision] = row
            cpu_out = tmp / f"cpu-{precision}"

            def cpu_stage(precision: str = precision, cpu_out: Path = cpu_out) -> Path:
                spec = parse_spec(spec_dict(case, targets=("onnx",), batch=BATCH, precision=precision,
                                            verify={"samples": 2, "fail_on_mismatch": False}))
                t0 = time.perf_counter()
                manifest = convert(pt2, spec, cpu_out, deferred_targets=("tensorrt",))
                row["cpu_stage_s"] = round(time.perf_counter() - t0, 2)
                row["preflight"] = {k: manifest["tensorrt"]["preflight"][k] for k in ("ok", "errors", "warnings")}
                # int8 made the engine its own symmetric ONNX beside the onnxruntime one
                return next(p for p in (cpu_out / "model.tensorrt.onnx", cpu_out / "model.onnx") if p.is_file())

            onnx_path = report.step(f"{precision}.cpu_stage", cpu_stage)
            if onnx_path is None:
                continue
            cache = tmp / f"{precision}-timing.cache"
            trt_spec = spec_dict(case, targets=("tensorrt",), batch=BATCH, precision=precision, verify={"samples": 2})
            trt_spec.pop("passes", None)

            def build(which: str, precision: str = precision, onnx_path: Path = onnx_path, cache: Path = cache,
                      trt_spec: dict = trt_spec) -> dict[str, Any]:
                manifest = convert(onnx_path, parse_spec(trt_spec), tmp / f"trt-{precision}-{which}",
                                   timing_cache_path=cache)
                section = manifest["tensorrt"]
                [record] = [v for v in manifest["verification"] if v["format"] == "tensorrt"]
                row[which] = {"build_s": section["build"]["build_s"], "timing_cache": section["build"]["timing_cache"],
                              "engine_bytes": section["engine"]["engine_bytes"],
                              "network": section["engine"].get("network"),
                              "builder_flags": section["engine"].get("builder_flags"),
                              "verification": {k: record.get(k) for k in ("passed", "cosine", "max_abs_diff",
                                                                          "top1_agreement", "shapes_checked",
                                                                          "tolerances", "error")}}
                return manifest

            cold = report.step(f"{precision}.build_cold", lambda: build("cold"))
            warm = report.step(f"{precision}.build_warm", lambda: build("warm"))
            if cold and warm:
                row["build_warm_over_cold"] = round(row["warm"]["build_s"] / row["cold"]["build_s"], 3)

            engine = tmp / f"trt-{precision}-cold" / "model.engine"

            def latency(precision: str = precision, engine: Path = engine) -> None:
                lat: dict[str, Any] = {}
                with TrtRunner(engine, ["x"]) as runner:
                    for b in LATENCY_BATCHES:
                        run = runner.bind((torch.randn(b, 3, 224, 224),))
                        ms = gpu_ms(run, stream=runner.stream)
                        base = eager_ms.get(f"batch{b}", {})
                        lat[f"batch{b}"] = {
                            "engine_ms": ms, "eager_fp32_ms": base.get("fp32"), "eager_fp16_ms": base.get("fp16"),
                            "speedup_vs_eager_fp32": round(base["fp32"] / ms, 2) if base.get("fp32") else None,
                            "speedup_vs_eager_fp16": round(base["fp16"] / ms, 2) if base.get("fp16") else None,
                        }
                row["latency"] = lat

            if engine.is_file():
                report.step(f"{precision}.latency", latency)

        def sandboxed_build() -> dict[str, Any]:
            """The fp32 build again, as a worker runs it: in the sandbox (seccomp: no sockets, no
            new processes; Landlock: its own files plus the GPU's devices). The builds above run
            in this process; this says whether CUDA and TensorRT work behind those layers, and
            if not, the error names what was refused."""
            from fxport.workers.engine.request import EngineRequest
            from fxport.workers.sandbox import run_engine_job

            onnx_path = tmp / "cpu-fp32" / "model.onnx"
            trt_spec = spec_dict(case, targets=("tensorrt",), batch=BATCH, precision="fp32", verify={"samples": 2})
            trt_spec.pop("passes", None)
            t0 = time.perf_counter()
            manifest = run_engine_job(EngineRequest(model_path=onnx_path, spec=parse_spec(trt_spec),
                                                    out_dir=tmp / "trt-fp32-sandboxed", job_id="gpu-check"), warm=False)
            [record] = [v for v in manifest["verification"] if v["format"] == "tensorrt"]
            return {"wall_s": round(time.perf_counter() - t0, 2), "passed": record.get("passed"),
                    "build_s": manifest["tensorrt"]["build"]["build_s"], "sandbox": manifest["sandbox"]}

        if (tmp / "cpu-fp32" / "model.onnx").is_file():
            report.data["sandboxed_build"] = report.step("sandboxed_build", sandboxed_build)

    report.data["status"] = "ok" if not report.data["errors"] else f"{len(report.data['errors'])} step(s) failed"
    report.data["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    report.save()
    if "--docs" in argv:
        write_docs(report.data)
    print(json.dumps({"status": report.data["status"], "out": str(report.path)}))
    return 0 if not report.data["errors"] else 1


def write_docs(data: dict[str, Any], extra: str = "") -> None:
    """The "tensorrt" section of docs/benchmarks.md, from a gpu_check.json's data (`extra`: a
    paragraph appended as is)."""
    from bench._report import write_section

    env = data.get("environment", {})
    lines = ["## TensorRT (bench/gpu_check.py)\n",
             f"{env.get('gpu')} (compute capability {env.get('compute_capability')}), "
             f"TensorRT {env.get('tensorrt') or 'not installed'}, "
             f"torch {env.get('torch')} (CUDA {env.get('torch_cuda')}), kernel {env.get('kernel')}; "
             f"{data.get('machine')}; {data.get('started', '')[:10]}.\n"]
    probe = data.get("cuda_behind_sandbox") or {}
    if probe:
        def said(run: dict[str, Any]) -> str:
            return "CUDA works" if run.get("cuda_ok") else f"CUDA fails: {run.get('error')}"
        layers = probe.get("layers", {})
        applied = [k for k, v in (layers.get("layers") or {}).items() if v is True]
        lines.append(f"CUDA behind a GPU job's sandbox layers ({', '.join(applied)}): **{said(layers)}**; "
                     f"without the layers: {said(probe.get('none', {}))}.\n")
    if env.get("tensorrt") is None:
        eager = data.get("eager_torch_ms", {})
        lines.append(f"**TensorRT could not be imported** ({env.get('tensorrt_import_error')}): no engine was built, "
                     "so there are no build or engine-latency figures yet. Eager torch, ResNet-18 fp32 on this GPU: "
                     + ", ".join(f"{b} {v.get('fp32')} ms" for b, v in eager.items()) + ".")
    else:
        lines += [f"ResNet-18, 224x224, dynamic batch {BATCH[0]}..{BATCH[2]}.\n",
                  "| precision | build cold s | build warm s | warm/cold | engine ms b1 | eager fp32 ms b1 | "
                  "engine ms b8 | eager fp32 ms b8 | verified |", "|---|---|---|---|---|---|---|---|---|"]
        for precision, row in data.get("precisions", {}).items():
            lat = row.get("latency", {})
            b1, b8 = lat.get("batch1", {}), lat.get("batch8", {})
            verified = row.get("cold", {}).get("verification", {}).get("passed")
            cold, warm = row.get("cold", {}), row.get("warm", {})
            lines.append(f"| {precision} | {cold.get('build_s')} | {warm.get('build_s')} | "
                         f"{row.get('build_warm_over_cold')} | {b1.get('engine_ms')} | {b1.get('eager_fp32_ms')} | "
                         f"{b8.get('engine_ms')} | {b8.get('eager_fp32_ms')} | {verified} |")
    if data.get("errors"):
        lines.append("\nFailed steps: " + ", ".join(sorted(data["errors"])))
    if extra:
        lines.append("\n" + extra)
    write_section("tensorrt", "\n".join(lines))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
