"""fuse_conv_bn: every BatchNorm after a Conv/Linear disappears, at every IR level, outputs unchanged."""

from __future__ import annotations

import pytest
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
    # decomposed, the 3-D linear is view → mm → view: BN looks through the view, and sees the
    # Linear's features on dim 2, not on the dim it normalizes
    assert "output is not 2-D" in result.notes or "output channels land on dim 2" in result.notes
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
    """Conv → F.batch_norm over root buffers; `training=True` makes it normalize with batch statistics."""

    def __init__(self, training: bool = False) -> None:
        super().__init__()
        self.training_flag = training
        self.conv = nn.Conv2d(3, 3, 1)
        self.register_buffer("mean", torch.rand(3) - 0.5)
        self.register_buffer("var", torch.rand(3) + 0.5)

    def forward(self, x):
        return torch.nn.functional.batch_norm(self.conv(x), self.mean, self.var, training=self.training_flag)


def test_functional_batchnorm_is_folded_at_every_level(level):
    model = FunctionalBn().eval()
    args = (torch.randn(2, 3, 4, 4),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, args)


def test_functional_batchnorm_with_batch_statistics_is_left_and_noted():
    model = FunctionalBn(training=True).eval()
    args = (torch.randn(2, 3, 4, 4),)
    result = apply("fuse_conv_bn", capture(model, args, "torch"), "torch", args)
    assert not result.changed
    assert "left 1 F.batch_norm: it normalizes with batch statistics (training=True)" in result.notes
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


# -- issue 21 item 2: a BatchNorm behind shape ops ------------------------------------------


class FlattenedTokens(nn.Module):
    """Linear over (N, L, C) tokens → flatten(0, 1) → BatchNorm1d over N·L rows → back to (N, L, C)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        y = self.fc(x)
        return self.bn(torch.flatten(y, 0, 1)).reshape(y.shape)  # y.shape reads only the shape


def test_linear_flatten_batchnorm_reshape_folds_through_the_flatten(level):
    model = randomize_batchnorm(FlattenedTokens()).eval()
    args = (torch.randn(2, 5, 4),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    # the decomposed graph spells the linear view → addmm → view and the flatten as a view
    through = "view" if level == "aten_decomposed" else "flatten"
    assert result.notes == f"folded 1 BatchNorm1d into Linear through {through} (bn into fc)"
    assert_close(result.graph_module, model, args)
    if level != "torch":  # the dynamic batch dim survives the rewrite
        assert_close(result.graph_module, model, (torch.randn(7, 5, 4),))


class TransposedTokens(nn.Module):
    """FlattenedTokens over a transposed (not contiguous) input: decomposed, the Linear becomes
    bmm(x, expand(wᵀ)) → view → add(bias), so the fold has to find the bmm behind the bias add."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)

    def forward(self, x):  # x: (N, 4, L)
        y = self.fc(x.transpose(1, 2))
        return self.bn(y.flatten(0, 1)).reshape_as(y)


def test_linear_over_a_transposed_input_folds_at_every_level(level):
    model = randomize_batchnorm(TransposedTokens()).eval()
    args = (torch.randn(2, 4, 5),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert result.notes.endswith("(bn into fc)")
    assert_close(result.graph_module, model, args)
    if level != "torch":
        assert_close(result.graph_module, model, (torch.randn(6, 4, 5),))


class ChannelsMoved(nn.Module):
    """The conv output permuted so BatchNorm2d normalizes its height (as tall as it has channels)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(4, 6, 1), nn.BatchNorm2d(6)

    def forward(self, x):  # x: (N, 4, 6, 5)
        return self.bn(self.conv(x).permute(0, 2, 1, 3))


def test_permute_that_moves_the_channels_is_not_folded(level):
    """Sizes match (6 channels, height 6), so only the axis mapping tells this fold would be wrong."""
    model = randomize_batchnorm(ChannelsMoved()).eval()
    args = (torch.randn(2, 4, 6, 5),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert not result.changed
    assert result.notes == ("left 1 BatchNorm2d: through permute the Conv2d's output channels land on dim 2, "
                            "but BatchNorm normalizes dim 1 (bn)")
    assert_close(result.graph_module, model, args)


class ChannelsMovedBack(nn.Module):
    """Shape ops that keep channels where BatchNorm normalizes: token features transposed onto dim 1,
    and a conv's channels permuted last and its pixels flattened into rows."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn_tokens = nn.Linear(4, 6), nn.BatchNorm1d(6)
        self.conv, self.bn_pixels = nn.Conv2d(3, 5, 1), nn.BatchNorm1d(5)

    def forward(self, tokens, image):  # tokens: (N, L, 4), image: (N, 3, H, W)
        a = self.bn_tokens(self.fc(tokens).transpose(1, 2))
        b = self.bn_pixels(self.conv(image).permute(0, 2, 3, 1).reshape(-1, 5))
        return a, b


def test_transpose_and_permute_reshape_that_keep_the_channels_fold(level):
    model = randomize_batchnorm(ChannelsMovedBack()).eval()
    args = (torch.randn(2, 7, 4), torch.randn(2, 3, 4, 4))
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    assert "(bn_tokens into fc)" in result.notes and "(bn_pixels into conv)" in result.notes
    if level == "torch":
        assert "1 BatchNorm1d into Conv2d through permute+reshape" in result.notes
    assert_close(result.graph_module, model, args)
    if level != "torch":
        assert_close(result.graph_module, model, (torch.randn(3, 7, 4), torch.randn(3, 3, 4, 4)))


class ReshapedByShape(nn.Module):
    """view(-1, 8, 4) keeps a (N, 8, 2, 2) conv output's channels on dim 1 only because H·W = 4."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 1), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.conv(x).view(-1, 8, 4))


def test_reshape_proven_only_by_export_shapes(level):
    """A torch-level graph has only the example's sizes: at 4×4 pixels this view would still run but
    mix channels, so it is left. Export fixes H and W, which proves the fold for every input it takes."""
    model = randomize_batchnorm(ReshapedByShape()).eval()
    args = (torch.randn(2, 3, 2, 2),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    if level == "torch":
        assert not result.changed
        assert "the view after the Conv2d moves the channels by shape" in result.notes
        assert "capture with export" in result.notes
    else:
        assert result.changed and batchnorm_left(result.graph_module) == []
    assert_close(result.graph_module, model, args)


class FlattenAlsoReturned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 6), nn.BatchNorm1d(6)

    def forward(self, x):
        rows = self.fc(x).flatten(0, 1)
        return self.bn(rows), rows


def test_shape_op_read_elsewhere_is_not_folded_through(level):
    model = randomize_batchnorm(FlattenAlsoReturned()).eval()
    args = (torch.randn(2, 5, 4),)
    result = apply("fuse_conv_bn", capture(model, args, level), level, args)
    assert not result.changed
    through = "view" if level == "aten_decomposed" else "flatten"
    assert f"the {through} output has 2 users" in result.notes
    assert_close(result.graph_module, model, args)


class LinearNorm(nn.Module):
    """timm LeViT's LinearNorm: a Linear over (N, L, C) tokens, BatchNorm1d over the N·L rows."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=False)
        self.bn = nn.BatchNorm1d(out_features)

    def forward(self, x):
        x = self.linear(x)
        return self.bn(x.flatten(0, 1)).reshape_as(x)


class ConvNorm(nn.Module):
    """timm LeViT's ConvNorm (Conv2d_BN): a stride-2 stem conv and its BatchNorm2d."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.linear = nn.Conv2d(in_channels, out_channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, x):
        return self.bn(self.linear(x))


class LeViTAttention(nn.Module):
    """LeViT attention with fx-friendly shapes (unflatten for timm's view(B, N, heads, -1))."""

    def __init__(self, dim: int, key_dim: int, heads: int, tokens: int, attn_ratio: int = 2) -> None:
        super().__init__()
        self.heads, self.key_dim, self.val_dim = heads, key_dim, attn_ratio * key_dim
        self.scale = key_dim ** -0.5
        self.qkv = LinearNorm(dim, heads * (2 * key_dim + self.val_dim))
        self.proj = nn.Sequential(nn.Hardswish(), LinearNorm(heads * self.val_dim, dim))
        self.attention_biases = nn.Parameter(torch.randn(heads, tokens, tokens) * 0.1)

    def forward(self, x):
        qkv = self.qkv(x).unflatten(-1, (self.heads, -1))
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        attn = (q.transpose(1, 2) @ k.permute(0, 2, 3, 1)) * self.scale + self.attention_biases
        x = (attn.softmax(dim=-1) @ v.transpose(1, 2)).transpose(1, 2).flatten(2)
        return self.proj(x)


class LeViTMlp(nn.Module):
    def __init__(self, dim: int, ratio: int = 2) -> None:
        super().__init__()
        self.ln1, self.act, self.ln2 = LinearNorm(dim, dim * ratio), nn.Hardswish(), LinearNorm(dim * ratio, dim)

    def forward(self, x):
        return self.ln2(self.act(self.ln1(x)))


class LeViTBlock(nn.Module):
    def __init__(self, dim: int, key_dim: int, heads: int, tokens: int) -> None:
        super().__init__()
        self.attn, self.mlp = LeViTAttention(dim, key_dim, heads, tokens), LeViTMlp(dim)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.mlp(x)


class LeViTStyle(nn.Module):
    """A LeViT (timm levit_128s-like): ConvNorm stem to tokens, then attention + MLP blocks whose every
    Linear is a LinearNorm — 3 BatchNorm2d after convs and 4 BatchNorm1d behind a flatten per block."""

    def __init__(self, img: int = 32, dim: int = 32, depth: int = 2, heads: int = 2, key_dim: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(ConvNorm(3, dim // 4), nn.Hardswish(), ConvNorm(dim // 4, dim // 2),
                                  nn.Hardswish(), ConvNorm(dim // 2, dim))
        tokens = (img // 8) ** 2
        self.blocks = nn.Sequential(*(LeViTBlock(dim, key_dim, heads, tokens) for _ in range(depth)))
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        return self.head(self.blocks(x).mean(1))


def test_levit_style_model_has_no_batchnorm_left(level):
    model = randomize_batchnorm(LeViTStyle()).eval()
    args = (torch.randn(2, 3, 32, 32),)
    gm = capture(model, args, level)
    assert len(batchnorm_left(gm)) == 11
    result = apply("fuse_conv_bn", gm, level, args)
    assert batchnorm_left(result.graph_module) == []
    through = "view" if level == "aten_decomposed" else "flatten"
    assert result.notes == (
        f"folded 3 BatchNorm2d into Conv2d; 8 BatchNorm1d into Linear through {through} "
        "(blocks.0.attn.qkv.bn into blocks.0.attn.qkv.linear, "
        "blocks.0.attn.proj.1.bn into blocks.0.attn.proj.1.linear, "
        "blocks.0.mlp.ln1.bn into blocks.0.mlp.ln1.linear, +5 more)")
    assert_close(result.graph_module, model, args)
    if level != "torch":
        assert_close(result.graph_module, model, (torch.randn(5, 3, 32, 32),))


def test_look_through_off_leaves_the_batchnorms_behind_a_flatten():
    """The switch bench/bench_fold_bn.py measures "before" with: only plain Conv → BN folds."""
    from fxport.pass_catalog import FuseConvBnOptions
    from fxport.workers.engine.passes.fuse_conv_bn import fuse_conv_bn
    from tests.workers.passes.conftest import context

    model = randomize_batchnorm(LeViTStyle()).eval()
    args = (torch.randn(2, 3, 32, 32),)
    with torch.no_grad():
        result = fuse_conv_bn(capture(model, args, "torch"), FuseConvBnOptions(), context("torch", args),
                              look_through=False)
    assert len(batchnorm_left(result.graph_module)) == 8
    assert "Left 8 BatchNorm1d: its input is not a Conv/Linear (call_method flatten)" in result.notes
    assert_close(result.graph_module, model, args)


@pytest.mark.parametrize(
    "kind, params, axis, ranks, expected",
    [
        ("flatten", (0, 1), 2, (3, 2), 1),  # LeViT: (N, L, C) → (N·L, C)
        ("flatten", (2, -1), 1, (4, 3), 1),  # (N, C, H, W) → (N, C, H·W)
        ("flatten", (1, 2), 2, (3, 2), "merges the channel dim"),
        ("transpose", (1, 2), 2, (3, 3), 1),
        ("permute", ((0, 2, 1, 3),), 1, (4, 4), 2),
        ("permute", ((0, 1),), 1, (3, 3), "not a permutation"),
        ("unsqueeze", (-1,), 1, (2, 3), 1),
        ("unsqueeze", (0,), 1, (2, 3), 2),
        ("squeeze", (2,), 1, (3, 2), 1),
        ("squeeze", (0,), 1, (3, 2), "may drop a dim"),
        ("squeeze", (None,), 1, (3, 2), "may drop a dim"),
        ("unflatten", (0, (2, -1)), 1, (2, 3), 2),
        ("unflatten", (1, (2, 3)), 1, (2, 3), "splits the channel dim"),
        ("reshape", ((-1, 6),), 2, (3, 2), 1),  # channels last before and after, literal size
        ("reshape", ((-1, 6, 4),), 1, (4, 3), "capture with export"),
        ("reshape", (None,), 1, (2, 2), "capture with export"),  # view_as: size from another tensor
    ],
)
def test_torch_level_channel_axis_rules(kind, params, axis, ranks, expected):
    """Where each torch-level shape op puts 6 channels at `axis`, for every input shape, or why unknown."""
    from fxport.workers.engine.passes.fuse_conv_bn.shapes import _torch_channel_axis, _Unproven

    if isinstance(expected, int):
        assert _torch_channel_axis(kind, params, axis, *ranks, channels=6) == expected
    else:
        with pytest.raises(_Unproven, match=expected):
            _torch_channel_axis(kind, params, axis, *ranks, channels=6)


# -- issue 23 item 3: timm's BatchNormAct2d, functional batch norm at torch level -----------


class BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d as written there: F.batch_norm with its own tensors, then an activation.
    Not a torch.nn class, so symbolic_trace goes inside and records call_function F.batch_norm."""

    def __init__(self, num_features: int, act: bool = True) -> None:
        super().__init__(num_features)
        self.drop = nn.Identity()
        self.act = nn.ReLU6() if act else nn.Identity()

    def forward(self, x):
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")  # reads only the shape
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        bn_training = True if self.training else (self.running_mean is None) and (self.running_var is None)
        x = torch.nn.functional.batch_norm(
            x,
            self.running_mean if not self.training or self.track_running_stats else None,
            self.running_var if not self.training or self.track_running_stats else None,
            self.weight, self.bias, bn_training, exponential_average_factor, self.eps,
        )
        return self.act(self.drop(x))


class InvertedResidual(nn.Module):
    """efficientnet-lite's block: 1x1 expand, 3x3 depthwise, 1x1 project, each conv with a BatchNormAct2d."""

    def __init__(self, channels: int, expand: int = 4) -> None:
        super().__init__()
        mid = channels * expand
        self.conv_pw, self.bn1 = nn.Conv2d(channels, mid, 1, bias=False), BatchNormAct2d(mid)
        self.conv_dw = nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False)
        self.bn2 = BatchNormAct2d(mid)
        self.conv_pwl, self.bn3 = nn.Conv2d(mid, channels, 1, bias=False), BatchNormAct2d(channels, act=False)

    def forward(self, x):
        return x + self.bn3(self.conv_pwl(self.bn2(self.conv_dw(self.bn1(self.conv_pw(x))))))


class EfficientNetLiteLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv_stem, self.bn1 = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), BatchNormAct2d(8)
        self.blocks = nn.Sequential(InvertedResidual(8), InvertedResidual(8))
        self.conv_head, self.bn2 = nn.Conv2d(8, 16, 1, bias=False), BatchNormAct2d(16)
        self.classifier = nn.Linear(16, 5)

    def forward(self, x):
        x = self.bn2(self.conv_head(self.blocks(self.bn1(self.conv_stem(x)))))
        return self.classifier(x.mean((2, 3)))


def test_timm_batchnormact2d_folds_at_torch_level(level):
    model = randomize_batchnorm(EfficientNetLiteLike()).eval()
    args = (torch.randn(2, 3, 16, 16),)
    gm = capture(model, args, level)
    if level == "torch":
        assert call_targets(gm).count("batch_norm") == 8  # F.batch_norm, not BatchNorm modules
    result = apply("fuse_conv_bn", gm, level, args)
    assert result.changed
    assert batchnorm_left(result.graph_module) == []
    if level == "torch":
        assert result.notes == "folded 8 BatchNormAct2d (F.batch_norm) into Conv2d"
        # the batch norms' tensors went with them; the user's model keeps its own
        assert not any(".running_mean" in name for name, _ in result.graph_module.named_buffers())
        assert model.bn1.running_mean is not None
    assert_close(result.graph_module, model, args)
