"""Build the example model — a small CNN with BatchNorm — and save it as a torch.export archive.

    python examples/make_example_model.py [OUT.pt2]      (default: examples/cnn_bn.pt2)

The archive carries its example inputs and a dynamic batch dimension (1..64), so
`fxport submit examples/cnn_bn.pt2 --target onnx` needs no input spec.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn


class SmallCnn(nn.Module):
    """conv-bn-relu ×2 → pool → linear: fuse_conv_bn has two BatchNorms to fold."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def build() -> nn.Module:
    torch.manual_seed(0)
    model = SmallCnn()
    # Real BatchNorm statistics (a fresh BatchNorm is nearly the identity in eval mode).
    model.train()
    with torch.no_grad():
        model(torch.randn(16, 3, 32, 32))
    return model.eval()


def main(out: Path) -> None:
    model = build()
    example = (torch.randn(2, 3, 32, 32),)  # batch >= 2: a batch-1 example can't be made dynamic
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, example, dynamic_shapes=({0: batch},))
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.export.save(program, out)
    print(f"wrote {out} ({out.stat().st_size} bytes): SmallCnn, input x [batch, 3, 32, 32], batch 1..64")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("cnn_bn.pt2"))
