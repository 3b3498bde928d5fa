#!/usr/bin/env bash
# Manual check of FXPORT_OP_LIBRARIES with torchvision (issue 44): a scripted torchvision detector,
# a scripted module calling torchvision.ops.nms and a torch.export program calling
# torchvision.ops.roi_align go through `fxport convert` (sandboxed), with and without
# FXPORT_OP_LIBRARIES=torchvision. Prints PASS or FAIL per case; exits with the number of FAILs.
#
# NOT RUN IN CI, and on purpose: PyPI's torchvision does not import beside the project's torch
# 2.13.0, so this check builds a side venv OUTSIDE the repo with torch 2.14.1 + torchvision 0.29.1
# (a CUDA build that runs on the CPU: about 5.5 GB on disk, x86_64, Python 3.11; on the build
# machines pip takes both wheels from the local disk). The project's .venv is not touched. The
# venv gets fxport from this checkout (`pip install --no-deps -e`, which only refreshes the ignored
# fxport.egg-info here) and fxport's base + engine dependencies from pyproject.toml, less torch.
#
# Usage: scripts/check_torchvision.sh            (reuses the venv when it is already right)
#   TVENV=/tmp/tvenv        where the side venv lives (created if missing)
#   WORK=/tmp/fxport-tv     models and conversion outputs (emptied at each run)
#   PYTHON=python3.11       the interpreter the venv is made from
# On the 2-core build VM: about 2.5 minutes once the venv exists, about 3 more to make it. Every
# case passed on 2026-12-07.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
TVENV="${TVENV:-/tmp/tvenv}"
WORK="${WORK:-/tmp/fxport-tv}"
PYTHON="${PYTHON:-python3.11}"
TORCH=2.14.1
TORCHVISION=0.29.1
unset VIRTUAL_ENV FXPORT_OP_LIBRARIES
case "$TVENV" in "$REPO"|"$REPO"/*) echo "TVENV must be outside the repository" >&2; exit 2 ;; esac

# -- the side venv -------------------------------------------------------------------------------
venv_ok() {
  [ -x "$TVENV/bin/python" ] && "$TVENV/bin/python" - "$REPO" "$TORCH" "$TORCHVISION" <<'EOF' 2>/dev/null
import sys, torch, torchvision, onnx, onnxruntime, onnxscript, safetensors, fxport.cli
repo, want_torch, want_tv = sys.argv[1:]
assert torch.__version__.split("+")[0] == want_torch and torchvision.__version__.split("+")[0] == want_tv
assert fxport.cli.__file__.startswith(repo + "/"), "fxport comes from another checkout"
EOF
}
if venv_ok; then
  echo "== reusing $TVENV"
else
  echo "== making $TVENV (torch $TORCH, torchvision $TORCHVISION; about 5.5 GB); pip's output: $TVENV.install.log"
  made=$(date +%s)
  log="$TVENV.install.log"
  : >"$log"
  pip_() { "$TVENV/bin/pip" "$@" >>"$log" 2>&1 || { tail -40 "$log" >&2; echo "FAIL: pip $*" >&2; exit 2; }; }
  [ -x "$TVENV/bin/python" ] || "$PYTHON" -m venv "$TVENV"
  pip_ install --upgrade pip
  pip_ install "torch==$TORCH" "torchvision==$TORCHVISION"
  pip_ install --no-deps -e "$REPO"
  # fxport's base and engine dependencies, as pyproject.toml lists them, but torch (pinned above)
  mapfile -t deps < <("$TVENV/bin/python" - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["engine"]:
    if re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() != "torch":
        print(req)
EOF
  )
  pip_ install -c <(printf 'torch==%s\ntorchvision==%s\n' "$TORCH" "$TORCHVISION") "${deps[@]}"
  pip_ check
  echo "   made in $(( $(date +%s) - made )) s"
  venv_ok || { echo "FAIL: $TVENV does not import torch $TORCH, torchvision $TORCHVISION and this fxport" >&2; exit 2; }
fi
"$TVENV/bin/python" -c 'import torch, torchvision, onnx, onnxruntime
print(f"   torch {torch.__version__}, torchvision {torchvision.__version__}, onnx {onnx.__version__}, "
      f"onnxruntime {onnxruntime.__version__}")'
echo "   venv size: $(du -sh "$TVENV" | cut -f1)"

# -- the models (random weights) -------------------------------------------------------------------
rm -rf "$WORK" && mkdir -p "$WORK/models"
cat > "$WORK/tv_models.py" <<'EOF'
"""The models of scripts/check_torchvision.sh (random weights): each calls torchvision's custom ops."""
from typing import Dict, List

import torch
import torchvision
from torch import Tensor


class Detector(torch.nn.Module):
    """fxport's inputs are tensors: a batch [B,3,H,W] in, torchvision's List[Dict[str, Tensor]] out."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torchvision.models.detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None).eval()
        # Random weights as torchvision initializes them give every box of a class the same score (about 1/91,
        # under the 0.05 threshold): no detections, or 100 tied ones that two runtimes cut at different boxes.
        # Spread batch norm's statistics and the box head's weights so that scores differ, as a trained model's do.
        with torch.no_grad():
            for mod in self.model.modules():
                if isinstance(mod, torch.nn.BatchNorm2d):
                    mod.running_mean.normal_(0, 0.1)
                    mod.running_var.uniform_(0.5, 2.0)
                    mod.weight.normal_(1.0, 0.2)
                    mod.bias.normal_(0, 0.2)
            for mod in self.model.roi_heads.modules():
                if isinstance(mod, torch.nn.Linear):
                    torch.nn.init.normal_(mod.weight, std=0.05)
                    torch.nn.init.normal_(mod.bias, std=0.05)

    def forward(self, x: Tensor) -> List[Dict[str, Tensor]]:
        images = [img for img in x.unbind(0)]
        if torch.jit.is_scripting():
            return self.model(images)[1]  # scripted, the model returns (losses, detections)
        return self.model(images)


class Nms(torch.nn.Module):
    def forward(self, boxes: Tensor, scores: Tensor) -> Tensor:
        xy = boxes[:, :2] * 10.0
        wh = boxes[:, 2:].abs() * 5.0 + 1.0
        keep = torchvision.ops.nms(torch.cat([xy, xy + wh], dim=1), scores, 0.5)
        return keep.sort().values


class RoiAlign(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: Tensor, boxes: Tensor) -> Tensor:
        # fxport verifies with random inputs: the rois (batch index, x1, y1, x2, y2) are made valid here, as a
        # random batch index column would read outside the batch (garbage in torch, an error in onnxruntime)
        index = (torch.arange(boxes.shape[0], dtype=x.dtype) % x.shape[0]).unsqueeze(1)
        xy = boxes[:, :2].abs() * 4.0
        rois = torch.cat([index, xy, xy + boxes[:, 2:].abs() * 4.0 + 1.0], dim=1)
        return torchvision.ops.roi_align(self.conv(x), rois, output_size=(4, 4), spatial_scale=1.0, sampling_ratio=2)
EOF
cat > "$WORK/build_models.py" <<'EOF'
import sys, time, warnings
from pathlib import Path

import torch
import torchvision
from torch.package import PackageExporter

from tv_models import Detector, Nms, RoiAlign

warnings.filterwarnings("ignore")
out = Path(sys.argv[1])
torch.manual_seed(0)
t0 = time.perf_counter()
det = Detector().eval()
sdet = torch.jit.script(det)
print(f"   torch.jit.script(detector): {time.perf_counter() - t0:.2f} s")
with torch.no_grad():
    x = torch.rand(2, 3, 320, 320)
    ref, got = det(x), sdet(x)
assert all(torch.equal(a["boxes"], b["boxes"]) for a, b in zip(ref, got)), "scripted detector != eager"
assert "torchvision::nms" in str(sdet.inlined_graph)
print("   detector: boxes per image", [d["boxes"].shape[0] for d in got],
      "| distinct scores", [len(set(d["scores"].tolist())) for d in got], "| scripted == eager")
sdet.save(str(out / "detector.ts"))
with PackageExporter(str(out / "detector_eager.pt")) as exporter:  # the eager detector; torchvision extern
    exporter.extern(["torch.**", "torchvision.**", "typing"])
    exporter.intern("tv_models")
    exporter.save_pickle("model", "model.pkl", det)
snms = torch.jit.script(Nms())
assert "torchvision::nms" in str(snms.inlined_graph)
snms.save(str(out / "nms.ts"))
ep = torch.export.export(RoiAlign().eval(), (torch.rand(2, 3, 16, 16), torch.randn(3, 4)))
assert any(str(n.target) == "torchvision.roi_align.default" for n in ep.graph.nodes)
torch.export.save(ep, str(out / "roi_align.pt2"))
for f in sorted(out.iterdir()):
    print(f"   {f.name}: {f.stat().st_size / 1e6:.2f} MB")
EOF
echo "== building the models in $WORK/models"
(cd "$WORK" && "$TVENV/bin/python" build_models.py "$WORK/models")

# -- the conversions -------------------------------------------------------------------------------
cat > "$WORK/judge.py" <<'EOF'
"""Judge one `fxport convert --json` run: argv = case, expectation, rc, out folder, stdout file, stderr file."""
import json, sys
from pathlib import Path

case, expect, rc, out, stdout, stderr = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), *sys.argv[5:]
err = Path(stderr).read_text()
problems: list[str] = []
manifest = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").is_file() else None
try:
    doc = json.loads(Path(stdout).read_text())
except ValueError:
    doc = None
if expect.startswith("refused:"):  # no FXPORT_OP_LIBRARIES: fails at load, naming the op and the setting
    op = expect.split(":", 1)[1]
    if rc == 0:
        problems.append("converted without the op library")
    error = (doc or {}).get("error") or {}
    if error.get("stage") != "load":
        problems.append(f"failed at {error.get('stage')!r}, not at load")
    if op not in err:
        problems.append(f"the error does not name {op}")
    if "FXPORT_OP_LIBRARIES" not in err:
        problems.append("the error does not name FXPORT_OP_LIBRARIES")
    if "FXPORT_OP_LIBRARIES" in err and "FXPORT_OP_LIBRARIES" not in json.dumps(doc):
        print("   note: stderr names FXPORT_OP_LIBRARIES, the --json document (from manifest.json) does not")
    print(f"   exit {rc}; error: {' '.join(err.split())[-300:]}")
else:  # converted: every target verified (or, with 'partial', listed as failed with why)
    wanted = expect.split(":", 1)[1].split(",")
    if rc != 0:
        problems.append(f"exit {rc}: {' '.join(err.split())[-1500:]}")
    if manifest is not None:
        libs = manifest["toolchain"].get("op_libraries")
        if not libs or libs[0].get("module") != "torchvision" or not libs[0].get("version"):
            problems.append(f"manifest toolchain.op_libraries is {libs!r}")
        verdicts = {v["format"]: v["verdict"] for v in manifest["verification"]}
        failed = {f["target"]: f["reason"] for f in manifest.get("failed_targets") or []}
        for i, target in enumerate(wanted):
            if verdicts.get(target) != "passed" and not (expect.startswith("partial") and i > 0 and target in failed):
                problems.append(f"{target}: {verdicts.get(target) or failed.get(target) or 'not built'}")
        print(f"   exit {rc}; toolchain.op_libraries {libs}; capture {manifest['capture']['method']}; "
              f"timings_s {manifest['timings_s']}")
        for a in manifest["artifacts"]:
            print(f"   artifact {a['format']}: {a['path']} {a['bytes'] / 1e6:.2f} MB")
        for v in manifest["verification"]:
            det = [o for o in v["outputs"] if o.get("compared_as") == "detections" and o.get("role") == "boxes"]
            how = (f"{sum(o['paired'] for o in det)} of {sum(o['count_model'] for o in det)} detections paired"
                   if det else "elementwise")
            print(f"   verify {v['format']}: {v['verdict']} ({v['samples']} samples, {how}, "
                  f"max_abs_diff {v['max_abs_diff']:.3g})")
        for target, reason in failed.items():
            print(f"   not built {target}: {reason[:300]}")
print(f"{'PASS' if not problems else 'FAIL'}: {case}" + "".join(f"\n   - {p}" for p in problems))
sys.exit(1 if problems else 0)
EOF

failures=0
# run_case NAME EXPECT OP_LIBRARIES MODEL ARGS...
#   EXPECT: refused:NS::OP (fails at load naming the op and the setting) | verified:T1,T2 (each target
#   verified) | partial:T1,T2 (T1 verified, each other one verified or listed as a failed target)
run_case() {
  local name=$1 expect=$2 libs=$3 model=$4; shift 4
  local out="$WORK/out-$name" rc=0 start end
  echo "== $name: FXPORT_OP_LIBRARIES=${libs:-<unset>} fxport convert $(basename "$model") $*"
  start=$(date +%s%N)
  (cd "$WORK" && if [ -n "$libs" ]; then export FXPORT_OP_LIBRARIES="$libs"; fi
   "$TVENV/bin/fxport" convert "$model" --out "$out" --json "$@" >"$out.json" 2>"$out.err") || rc=$?
  end=$(date +%s%N)
  echo "   wall $(( (end - start) / 1000000 )) ms"
  "$TVENV/bin/python" "$WORK/judge.py" "$name" "$expect" "$rc" "$out" "$out.json" "$out.err" || failures=$((failures + 1))
}
M="$WORK/models"
DET=(--input x:2,3,320,320)
run_case detector-ts-unset           refused:torchvision::nms ""          "$M/detector.ts" "${DET[@]}" -t torchscript
run_case detector-ts                 verified:torchscript     torchvision "$M/detector.ts" "${DET[@]}" -t torchscript
# ONNX of a TorchScript archive of a detector is a torch limitation (the TorchScript-based exporter cannot
# freeze the scripted BoxCoder class): accepted as a failed target, with why
run_case detector-ts-onnx-partial    partial:torchscript,onnx torchvision "$M/detector.ts" "${DET[@]}" -t torchscript -t onnx --allow-partial
run_case detector-package-onnx       verified:torchscript,onnx torchvision "$M/detector_eager.pt" "${DET[@]}" -t torchscript -t onnx
run_case nms-ts-unset                refused:torchvision::nms ""          "$M/nms.ts" --input boxes:50,4 --input scores:50 -t torchscript
run_case nms-ts                      verified:torchscript,onnx torchvision "$M/nms.ts" --input boxes:50,4 --input scores:50 -t torchscript -t onnx
run_case roi-align-pt2               verified:torchscript,onnx,exported_program,fx_source torchvision "$M/roi_align.pt2" \
  --input x:2,3,16,16 --input boxes:3,4 -t torchscript -t onnx -t exported_program -t fx_source
# torch.export.load reports an unregistered op only in a logged warning and raises a generic "error when
# deserializing the saved file"; fxport takes the logged cause (workers/engine/load.py), so the error names
# the op and FXPORT_OP_LIBRARIES as for the .ts cases above.
run_case roi-align-pt2-unset         refused:torchvision::roi_align "" "$M/roi_align.pt2" \
  --input x:2,3,16,16 --input boxes:3,4 -t exported_program

echo "== $failures case(s) failed (machine: $(nproc) cores; outputs in $WORK)"
exit "$failures"
