"""Detection outputs (a data-dependent number of boxes with scores) compared as sets, not tensors.

A detector's boxes, scores and labels have one row per detection, and how many rows there are
depends on the input; two correct runtimes may also list the same detections in another order (a
sort on tied scores). Element-wise comparison cannot work there, so the rows are paired instead:

1. both sides sorted by score, highest first;
2. each of the model's detections, in that order, takes the artifact's unpaired detection of the
   same label that overlaps it most, if that overlap (IoU) is at least MIN_PAIR_IOU;
3. paired rows are compared element-wise (boxes, scores and any other per-detection output, e.g.
   masks) under the usual tolerances; detections left without a partner are reported, with their
   scores, and at most `verify.max_unmatched_detections` of them per sample pass.

Which outputs form a group is read from the original model's output:
- a dict with "boxes" and "scores" keys (torchvision's List[Dict[str, Tensor]]): boxes [N, k],
  scores [N], and every other entry with N rows (labels, masks, keypoints);
- a tuple/list holding exactly one float [N, 4] and one float [N] tensor, where N changes between the
  verification inputs (a fixed N is compared element-wise as usual); an integer [N] tensor beside
  them is the labels.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIN_PAIR_IOU = 0.5  # below this two boxes are different detections, not one detection computed twice
HOW = "detections: sorted by score, paired by label and box overlap, pairs compared element-wise"


@dataclass
class DetectionGroup:
    """Leaves (indices into the flat output list) that describe one set of detections."""

    name: str  # the container's path, e.g. "[0]" (first image) or "" (the model's tuple itself)
    boxes: int
    scores: int
    labels: int | None = None
    members: list[int] = field(default_factory=list)  # every per-detection leaf, boxes and scores included

    def role(self, index: int) -> str:
        if index == self.boxes:
            return "boxes"
        if index == self.scores:
            return "scores"
        return "labels" if index == self.labels else "per-detection values"

    def describe(self) -> str:
        return f"detections{' ' + self.name if self.name else ''}"


class DetectionMismatch(Exception):
    """The artifact's detections cannot be compared at all (wrong rank, rows that disagree)."""


def find_detection_groups(samples: list[list[np.ndarray]], paths: list[str] | None) -> list[DetectionGroup]:
    """The detection groups in the reference outputs of every sample (`paths`: the leaves' pytree
    paths, as runners.output_paths gives them; None when the reference has no structure to read)."""
    if not samples or not samples[0]:
        return []
    count = len(samples[0])
    paths = paths if paths is not None and len(paths) == count else [f"[{i}]" for i in range(count)]
    by_container: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for index, path in enumerate(paths):
        container, key = _split_path(path)
        by_container[container].append((key, index))
    groups = []
    for container, leaves in by_container.items():
        group = _named_group(container, dict(leaves), samples) or _positional_group(container, leaves, samples)
        if group is not None:
            groups.append(group)
    return groups


def _split_path(path: str) -> tuple[str, str]:
    """`[0]['boxes']` → (`[0]`, `boxes`); `[2]` → (``, `2`)."""
    match = re.match(r"^(.*)\[(?:'([^']*)'|\"([^\"]*)\"|(-?\d+))\]$", path)
    if not match:
        return path, ""
    return match.group(1), next(g for g in match.groups()[1:] if g is not None)


def _rows(samples: list[list[np.ndarray]], index: int) -> list[int] | None:
    """Leading dim of leaf `index` in every sample, None when it is a scalar somewhere."""
    rows = []
    for outputs in samples:
        if outputs[index].ndim == 0:
            return None
        rows.append(int(outputs[index].shape[0]))
    return rows


def _members(leaves: list[int], rows: list[int], samples: list[list[np.ndarray]]) -> list[int]:
    return [i for i in leaves if _rows(samples, i) == rows]


def _named_group(container: str, keys: dict[str, int], samples: list[list[np.ndarray]]) -> DetectionGroup | None:
    if "boxes" not in keys or "scores" not in keys:
        return None
    boxes, scores = keys["boxes"], keys["scores"]
    rows = _rows(samples, boxes)
    if rows is None or _rows(samples, scores) != rows:
        return None
    if any(s[boxes].ndim != 2 or s[scores].ndim != 1 for s in samples):
        return None
    members = _members(list(keys.values()), rows, samples)
    labels = keys.get("labels") if keys.get("labels") in members else None
    return DetectionGroup(container, boxes, scores, labels, members)


def _positional_group(container: str, leaves: list[tuple[str, int]], samples: list[list[np.ndarray]]
                      ) -> DetectionGroup | None:
    indices = [i for _, i in leaves]
    first = samples[0]
    boxes = [i for i in indices if first[i].ndim == 2 and first[i].shape[1] == 4 and first[i].dtype.kind == "f"]
    if len(boxes) != 1:
        return None
    rows = _rows(samples, boxes[0])
    if rows is None or len(set(rows)) < 2:  # a fixed row count compares element-wise
        return None
    members = _members(indices, rows, samples)
    scores = [i for i in members if first[i].ndim == 1 and first[i].dtype.kind == "f"]
    if len(scores) != 1:
        return None
    labels = [i for i in members if first[i].ndim == 1 and first[i].dtype.kind in "iub"]
    return DetectionGroup(container, boxes[0], scores[0], labels[0] if len(labels) == 1 else None, members)


def pair_detections(ref_boxes: np.ndarray, ref_scores: np.ndarray, got_boxes: np.ndarray, got_scores: np.ndarray,
                    ref_labels: np.ndarray | None = None, got_labels: np.ndarray | None = None
                    ) -> list[tuple[int, int]]:
    """(model row, artifact row) pairs: the model's detections by descending score, each taking the
    artifact's free detection of its label that overlaps it most (IoU >= MIN_PAIR_IOU)."""
    if not len(ref_boxes) or not len(got_boxes):
        return []
    overlap = box_iou(ref_boxes, got_boxes)
    if ref_labels is not None and got_labels is not None:
        overlap[ref_labels.reshape(-1, 1) != got_labels.reshape(1, -1)] = -1.0
    # ties in score keep the artifact's order out of it: the model's rows go by score, then by position
    order = np.lexsort((np.arange(len(ref_scores)), -ref_scores.astype(np.float64)))
    taken = np.zeros(len(got_boxes), dtype=bool)
    pairs = []
    for i in order:
        candidates = np.where(taken, -1.0, overlap[i])
        j = int(candidates.argmax())
        if candidates[j] >= MIN_PAIR_IOU:
            pairs.append((int(i), j))
            taken[j] = True
    return pairs


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in `a` [N, 4] with every box in `b` [M, 4], corners in either order; two
    identical boxes overlap fully even when they have no area."""
    a, b = _corners(a.astype(np.float64)), _corners(b.astype(np.float64))
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(bottom_right - top_left, 0, None).prod(-1)
    area_a, area_b = (a[:, 2:] - a[:, :2]).prod(-1), (b[:, 2:] - b[:, :2]).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
    same = np.all(a[:, None, :] == b[None, :, :], axis=-1)
    return np.where(same, 1.0, iou)


def _corners(boxes: np.ndarray) -> np.ndarray:
    boxes = boxes.reshape(len(boxes), -1)[:, :4]
    return np.concatenate([np.minimum(boxes[:, :2], boxes[:, 2:]), np.maximum(boxes[:, :2], boxes[:, 2:])], 1)


def check_shapes(group: DetectionGroup, ref: list[np.ndarray], got: list[np.ndarray], names: list[str]) -> int:
    """The artifact's detection count; raises DetectionMismatch when its rows cannot be paired."""
    count = int(got[group.boxes].shape[0]) if got[group.boxes].ndim else -1
    for i in group.members:
        want, have = ref[i].shape, got[i].shape
        if len(have) != len(want) or have[1:] != want[1:] or (have[0] if have else -1) != count:
            raise DetectionMismatch(
                f"{names[i]} ({group.role(i)} of {group.describe()}) has shape {list(have)}, which does not "
                f"line up with the artifact's {count} boxes (the model's: {list(want)})")
    return count


def unmatched_text(group: DetectionGroup, ref_scores: np.ndarray, got_scores: np.ndarray,
                   pairs: list[tuple[int, int]]) -> str:
    """'the artifact finds 7 detections where the model finds 6: 1 of the artifact's (score 0.612) has no partner'"""
    lost = sorted(set(range(len(ref_scores))) - {i for i, _ in pairs})
    extra = sorted(set(range(len(got_scores))) - {j for _, j in pairs})
    parts = []
    if lost:
        parts.append(f"{len(lost)} of the model's (score {_scores(ref_scores[lost])}) found no partner")
    if extra:
        parts.append(f"{len(extra)} of the artifact's (score {_scores(got_scores[extra])}) match none of the model's")
    return (f"{group.describe()}: the artifact finds {len(got_scores)} where the model finds {len(ref_scores)}; "
            + ", ".join(parts))


def _scores(values: Any) -> str:
    shown = ", ".join(f"{float(v):.4g}" for v in list(values)[:5])
    return shown + (", ..." if len(values) > 5 else "")
