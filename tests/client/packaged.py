"""Models written as source files on no sys.path and packaged with torch.package (their code
interned): what a user uploads when the model's code is their own. Its module is then
`<torch_package_N>.NAME`, which no other process can import by name."""

from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path


def _function_source(path: Path, name: str) -> str:
    """The source of the top-level function `name` in `path`, read as text: nothing is imported."""
    text = path.read_text()
    found = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
    segment = ast.get_source_segment(text, found)
    assert segment is not None
    return segment


TRACEABLE = textwrap.dedent('''
    """Conv, BatchNorm, Linear: every capture method follows it."""
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3)))
''')

UNTRACEABLE = textwrap.dedent('''
    """A Python branch on a tensor's value: no capture method can follow it."""
    import torch
    from torch import nn


    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # decided by the values, in Python
                return y * 2
            return y - 1
''')


_NMS_HEAD_FILE = Path(__file__).parents[1] / "models" / "coverage3_nms_llama.py"

# torchvision's detection models in miniature: per image, scores → threshold → top-k → greedy NMS
# (a Python loop) → a data-dependent number of boxes, as List[Dict[str, Tensor]]. symbolic_trace
# fails on the loop over the batch, torch.export on the branch on the number of detections. Its
# box_iou is the NMS head's (tests/models/coverage3_nms_llama.py), written into the model's own file.
DETECTOR = textwrap.dedent('''
    """A detector in the image of torchvision's."""
    from typing import Dict, List

    import torch
    from torch import nn


''') + _function_source(_NMS_HEAD_FILE, "box_iou") + textwrap.dedent('''


    class Model(nn.Module):
        def __init__(self, anchors: int = 48, classes: int = 3):
            super().__init__()
            self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 8, 3, 2, 1), nn.ReLU(),
                                          nn.AdaptiveAvgPool2d(2), nn.Flatten())
            self.cls = nn.Linear(32, anchors * classes)
            self.reg = nn.Linear(32, anchors * 4)
            self.anchors, self.classes = anchors, classes
            self.score_thresh, self.iou_thresh, self.top_k = 0.55, 0.3, 16

        def forward(self, images: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
            feats = self.backbone(images)
            results: List[Dict[str, torch.Tensor]] = []
            for i in range(feats.shape[0]):  # symbolic_trace: a Proxy is no int
                results.append(self.detect(feats[i]))
            return results

        def detect(self, feat: torch.Tensor) -> Dict[str, torch.Tensor]:
            scores = torch.sigmoid(self.cls(feat)).reshape(self.anchors, self.classes).flatten()
            raw = self.reg(feat).reshape(self.anchors, 4) * 20.0 + 40.0
            boxes = torch.cat([torch.min(raw[:, :2], raw[:, 2:]), torch.max(raw[:, :2], raw[:, 2:]) + 4.0], 1)
            scores = torch.where(scores > self.score_thresh, scores, torch.zeros_like(scores))
            top_scores, top = scores.topk(self.top_k)
            cand_boxes, cand_labels = boxes[top // self.classes], top % self.classes
            keep = top_scores > 0
            iou = box_iou(cand_boxes, cand_boxes)
            same = cand_labels[:, None] == cand_labels[None, :]
            later = torch.arange(self.top_k)
            for i in range(self.top_k):  # greedy NMS: each kept box suppresses the later ones it overlaps
                keep = keep & ~((iou[i] > self.iou_thresh) & same[i] & keep[i] & (later > i))
            idx = torch.nonzero(keep).flatten()  # a data-dependent number of detections
            if idx.numel() == 0:  # torch.export cannot guard on a data-dependent count
                idx = torch.zeros(0, dtype=torch.long)
            return {"boxes": cand_boxes[idx], "scores": top_scores[idx], "labels": cand_labels[idx]}
''')


def package_model(source: str, name: str, folder: Path) -> Path:
    """folder/NAME.pkg: an eval() instance of `Model` from `source`, its code interned as module NAME."""
    import torch

    from tests.models.packaging import save_package  # imports torch: here, not when this module is

    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(source)
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # for the exporter to find the class it pickles; gone again below
    try:
        spec.loader.exec_module(module)
        torch.manual_seed(0)
        return save_package(folder / f"{name}.pkg", module.Model().eval(), intern=name)
    finally:
        sys.modules.pop(name, None)
