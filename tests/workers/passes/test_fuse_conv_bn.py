"""fuse_conv_bn: every BatchNorm after a Conv/Linear disappears, at every IR level, outputs unchanged."""

from __future__ import annotations

import torch
from torch import nn

from tests.workers.passes.conftest import apply, assert_close, call_targets, capture, randomize_batchnorm


class BasicBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + x)


class ResNetLike(nn.Module):
    """Stem conv-bn-relu, two residual blocks, a Linear→BatchNorm1d head (one Linear without bias)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8), BasicBlock(8))
        self.fc = nn.Linear(8, 16)
        self.bn_fc = nn.BatchNorm1d(16)
        self.head = nn.Linear(16, 4, bias=False)
        self.bn_head = nn.BatchNorm1d(4)

    def forward(self, x):
        x = self.layer1(self.stem(x)).mean((2, 3))
        return self.bn_head(self.head(torch.relu(self.bn_fc(self.fc(x)))))


class ConvNd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv1d(3, 4, 3), nn.BatchNorm1d(4)
        self.c3, self.b3 = nn.Conv3d(3, 4, 2, groups=1), nn.BatchNorm3d(4, affine=False)

    def forward(self, x1, x3):
        return self.b1(self.c1(x1)).sum((1, 2)) + self.b3(self.c3(x3)).sum((1, 2, 3, 4))


class TwoUsers(nn.Module):
    """The conv output also feeds the residual add: folding would change what the add sees."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


class BnAfterRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(torch.relu(self.conv(x)))


class LinearOnSequence(nn.Module):
    """Linear over (N, L, C) then BatchNorm1d(L): BN's channels are L, not the Linear's features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        return self.bn(self.fc(x))


class SharedConv(nn.Module):
    """One conv module applied twice, each time followed by its own BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn2(self.conv(self.bn1(self.conv(x))))


def batchnorm_left(gm) -> list[str]:
    return [t for t in call_targets(gm) if "BatchNorm" in t or "batch_norm" in t]


def test_resnet_like_has_no_batchnorm_left(level):
    model = randomize_batchnorm(ResNetLike()).eval()
    args = (torch.randn(2, 3, 12, 12),)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gm = capture(model, args, level)
    assert batchnorm_left(gm)

    result = apply("fuse_conv_bn", gm, level, args)

    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert "folded 5 BatchNorm2d into Conv2d; 2 BatchNorm1d into Linear" in result.notes
    assert_close(result.graph_module, model, args)
    # the user's model (which the graph shares tensors and leaf modules with) is untouched
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert not any("bn" in name for name, _ in result.graph_module.named_parameters())
    if level != "torch":  # the dynamic batch dim survives the rewrite
        assert_close(result.graph_module, model, (torch.randn(5, 3, 12, 12),))


def test_conv1d_and_conv3d_and_non_affine_bn(level):
    model = randomize_batchnorm(ConvNd()).eval()
    args = (torch.randn(2, 3, 7), torch.randn(2, 3, 4, 4, 4))
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, args)


def test_conv_output_with_two_users_is_not_fused(level):
    model = randomize_batchnorm(TwoUsers()).eval()
    args = (torch.randn(2, 4, 5, 5),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert not result.changed
    assert len(batchnorm_left(result.graph_module)) == 1
    assert "output has 2 users" in result.notes
    assert_close(result.graph_module, model, args)


def test_batchnorm_not_after_conv_is_left_and_noted(level):
    model = randomize_batchnorm(BnAfterRelu()).eval()
    args = (torch.randn(2, 4, 5, 5),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert not result.changed
    assert "input is not a Conv/Linear (relu" in result.notes
    assert_close(result.graph_module, model, args)


def test_linear_whose_output_is_not_2d_is_not_fused(level):
    model = randomize_batchnorm(LinearOnSequence()).eval()
    args = (torch.randn(2, 6, 6),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert not result.changed
    # decomposed, the 3-D linear is view → mm → view, so BN's input is not a Linear at all
    assert "output is not 2-D" in result.notes or "input is not a Conv/Linear (view)" in result.notes
    assert_close(result.graph_module, model, args)


def test_shared_conv_is_fused_only_where_weights_are_arguments(level):
    model = randomize_batchnorm(SharedConv()).eval()
    args = (torch.randn(2, 4, 5, 5),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    if level == "torch":  # one module object cannot hold two different fused weights
        assert not result.changed
        assert "called more than once" in result.notes
    else:  # each aten conv gets its own fused weight; the second rebinds the now-unshared name
        assert result.changed
        assert batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, args)


def test_linear_option_off_keeps_linear_batchnorm():
    model = randomize_batchnorm(ResNetLike()).eval()
    args = (torch.randn(2, 3, 12, 12),)
    result = apply("fuse_conv_bn", capture(model, args, "aten"), "aten", args, linear=False)
    assert result.changed
    assert len(batchnorm_left(result.graph_module)) == 2
    assert "options.linear is false" in result.notes
    assert_close(result.graph_module, model, args)


def test_no_batchnorm_is_unchanged(level):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    args = (torch.randn(2, 3, 6, 6),)
    gm = capture(model, args, level)
    code = gm.code
    result = apply("fuse_conv_bn", gm, level, args)
    assert not result.changed
    assert result.notes == "no BatchNorm nodes"
    assert result.graph_module.code == code


class FunctionalBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("mean", torch.zeros(3))
        self.register_buffer("var", torch.ones(3))

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.conv(x), self.mean, self.var)


def test_functional_batchnorm_at_torch_level_is_reported_not_silently_skipped():
    model = FunctionalBn().eval()
    args = (torch.randn(2, 3, 4, 4),)
    result = apply("fuse_conv_bn", capture(model, args, "torch"), "torch", args)
    assert not result.changed
    assert "F.batch_norm" in result.notes
    result = apply("fuse_conv_bn", capture(model, args, "aten"), "aten", args)  # export makes it aten
    assert result.changed
    assert_close(result.graph_module, model, args)


class ScaledConv(nn.Conv2d):
    """A Conv2d subclass with its own forward: folding BN into `weight` would be wrong."""

    def forward(self, x):
        return super().forward(x) * 2


class CustomConvLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = ScaledConv(3, 3, 1), nn.BatchNorm2d(3)

    def forward(self, x):
        return self.bn(self.conv(x))


def test_conv_subclass_with_own_forward_is_not_fused():
    class LeafScaledConv(torch.fx.Tracer):
        def is_leaf_module(self, m, qualname):
            return isinstance(m, ScaledConv) or super().is_leaf_module(m, qualname)

    model = randomize_batchnorm(CustomConvLeaf()).eval()
    args = (torch.randn(2, 3, 4, 4),)
    gm = torch.fx.GraphModule(model, LeafScaledConv().trace(model))
    result = apply("fuse_conv_bn", gm, "torch", args)
    assert not result.changed
    assert "ScaledConv overrides forward" in result.notes
    assert_close(result.graph_module, model, args)


class Decoder(nn.Module):
    """ConvTranspose{1,2,3}d → BatchNorm, grouped and not: decoders, segmentation heads, GAN generators."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose1d(4, 6, 3, stride=2)
        self.bn1 = nn.BatchNorm1d(6)
        self.up2 = nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, bias=False)
        self.bn2 = nn.BatchNorm2d(6)
        self.up3 = nn.ConvTranspose3d(6, 9, 2, stride=2, groups=3)
        self.bn3 = nn.BatchNorm3d(9)

    def forward(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor):
        return self.bn1(self.up1(a)), torch.relu(self.bn2(self.up2(b))), self.bn3(self.up3(c))


def test_transposed_convs_fold_their_batchnorm_grouped_or_not(level):
    """Issue 21, item 1: the fold scales a transposed conv's output channels, which sit on weight dim 1
    within each group (weight: in, out / groups, *kernel)."""
    model = randomize_batchnorm(Decoder()).eval()
    args = (torch.randn(2, 4, 5), torch.randn(2, 4, 5, 5), torch.randn(2, 6, 3, 3, 3))
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, args)
    if level == "torch":
        assert "BatchNorm2d into ConvTranspose2d" in result.notes
    if level != "torch":  # the dynamic batch dim survives the rewrite
        assert_close(result.graph_module, model, tuple(torch.randn(3, *a.shape[1:]) for a in args))
