"""Hand-written corpus models: small nn.Modules that each exercise one thing the engine must handle.

Every forward takes tensors positionally and returns a tensor or a tuple of tensors, so the
same module goes through symbolic_trace, torch.export, TorchScript and ONNX unchanged.
Shapes that depend on the batch use `flatten`/`unflatten` rather than `b, s, d = x.shape`:
unpacking a shape iterates a Proxy, which symbolic_trace cannot do.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class MlpDropout(nn.Module):
    """Linear/ReLU/Dropout stack: remove_dropout should leave only Linear and ReLU."""

    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(in_features, hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(0.2),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class CnnBn(nn.Module):
    """Conv→BN→ReLU twice, pool, then Linear→BatchNorm1d: three sites for fuse_conv_bn."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)  # with bias: the fold must keep it
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Linear(16, 32)
        self.bn3 = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.flatten(self.pool(x), 1)
        x = torch.relu(self.bn3(self.fc1(x)))
        return self.fc2(x)


class BasicBlock(nn.Module):
    """ResNet v1 basic block: two 3x3 convs with BN, identity or 1x1-conv shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_planes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet-18 topology (stem 7x7/2 + maxpool, BasicBlocks [2,2,2,2]), written out
    because torchvision does not import next to torch 2.13. Module names match torchvision's."""

    def __init__(
        self,
        widths: tuple[int, int, int, int] = (64, 128, 256, 512),
        blocks: tuple[int, int, int, int] = (2, 2, 2, 2),
        num_classes: int = 1000,
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_planes = widths[0]
        for i, (planes, count) in enumerate(zip(widths, blocks)):
            stride = 1 if i == 0 else 2
            layer = []
            for j in range(count):
                layer.append(BasicBlock(in_planes, planes, stride if j == 0 else 1))
                in_planes = planes
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class TransformerBlock(nn.Module):
    """Pre-LN encoder block with attention written out (Linear, matmul, softmax) rather than
    nn.MultiheadAttention, which symbolic_trace keeps as one opaque leaf module."""

    def __init__(self, d_model: int = 64, heads: int = 4, mlp_ratio: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (d_model // heads) ** -0.5
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, mlp_ratio * d_model), nn.GELU(), nn.Linear(mlp_ratio * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (batch, seq, 3*d) → three (batch, heads, seq, head_dim) without reading the batch size
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        attn = torch.softmax((q @ k.transpose(-2, -1)) * self.scale, dim=-1)
        x = x + self.proj((attn @ v).transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class MultiIO(nn.Module):
    """Two inputs (image, vector) and two outputs (class logits, an embedding)."""

    def __init__(self, num_classes: int = 5, embed: int = 16) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.vector = nn.Sequential(nn.Linear(12, 8), nn.Tanh())
        self.classifier = nn.Linear(16, num_classes)
        self.embedding = nn.Linear(16, embed)

    def forward(self, image: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.cat([torch.flatten(self.image(image), 1), self.vector(features)], dim=1)
        return self.classifier(h), nn.functional.normalize(self.embedding(h), dim=-1)


class ControlFlow(nn.Module):
    """Picks a branch on the data: a positive-sum input goes through `pos`, others through `neg`.

    Measured on torch 2.13 (tests/test_model_corpus.py keeps these honest):
    - A Python `if x.sum() > 0:` fails everywhere that captures a graph: symbolic_trace
      ("symbolically traced variables cannot be used as inputs to control flow"), strict
      export (dynamo "Data-dependent branching"), and non-strict export
      (GuardOnDataDependentSymNode on the `.item()` the `if` forces). Non-strict export
      does not specialize on the example's branch, so "export one branch" is not an option.
    - `torch.cond` exports (strict and non-strict) with both branches in the graph, and the
      exported module takes the right branch at run time. symbolic_trace still fails on it
      (RuntimeError "Expected pred to be bool or tensor, but got Proxy"), so fx_traceable=False.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Linear(16, 8)
        self.neg = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Branch functions take the tensors they use as operands; they may read self's modules.
        return torch.cond(x.sum() > 0, self._positive, self._negative, (x,))

    def _positive(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.pos(x))

    def _negative(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.neg(x)) - 1.0
