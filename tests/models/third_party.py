"""Third-party corpus models: tiny `transformers` architectures built from a config, random weights.

Nothing is downloaded: HF_HUB_OFFLINE is set before transformers is imported, and every model
comes from a config object, never `from_pretrained`. transformers is imported inside the
builders so that importing the corpus stays cheap for tests that never touch these models.

Each HF model is wrapped so forward takes tensors positionally and returns a tensor (HF
models take keyword arguments and return ModelOutput dicts). Measured on transformers 5.24
with torch 2.13: the default attention implementation (sdpa for BERT, GPT-2, ViT) exports
with a dynamic batch as is (BERT with `attn_implementation="eager"` exports too; it is not
needed). All fail plain symbolic_trace (HF's own control flow on shapes and configs), and
`symbolic_trace(ep.module())` works. TorchScript: `jit.trace` of the eager wrapper keeps the
batch dynamic, but `jit.trace(ep.module())` of BERT, GPT-2 and ViT bakes in the example's batch
size (a later batch fails in a cat/expand); ResNet and MobileNetV2 trace either way.
"""

from __future__ import annotations

import os

import torch
from torch import nn

os.environ["HF_HUB_OFFLINE"] = "1"

VOCAB = 128
SEQ = 16


class BertEncoder(nn.Module):
    """BertModel without the pooler; returns last_hidden_state (batch, seq, hidden)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
        )
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


class Gpt2LM(nn.Module):
    """GPT2LMHeadModel without the KV cache; returns logits (batch, seq, vocab)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        # bos/eos default to 50256, outside a 128-token vocab: transformers warns about it.
        config = GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=2,
            n_positions=64,
            bos_token_id=VOCAB - 1,
            eos_token_id=VOCAB - 1,
            use_cache=False,
        )
        self.gpt2 = GPT2LMHeadModel(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # use_cache=False keeps a DynamicCache object out of the outputs (export can't return it).
        return self.gpt2(input_ids=input_ids, use_cache=False).logits


class VitClassifier(nn.Module):
    """ViTForImageClassification on 32x32 images, 8x8 patches; returns logits (batch, 10)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=32,
            patch_size=8,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=10,
        )
        self.vit = ViTForImageClassification(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.vit(pixel_values=pixel_values).logits


class HfResNetClassifier(nn.Module):
    """transformers' own ResNet (basic layers, two stages); returns logits (batch, 10)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(
            num_channels=3,
            embedding_size=16,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            layer_type="basic",
            num_labels=10,
        )
        self.resnet = ResNetForImageClassification(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.resnet(pixel_values=pixel_values).logits


class MobileNetV2Classifier(nn.Module):
    """MobileNetV2 (depthwise convs, ReLU6, Conv→BN) at width 0.35; returns logits (batch, 10)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

        config = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.35, num_labels=10)
        self.mobilenet = MobileNetV2ForImageClassification(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.mobilenet(pixel_values=pixel_values).logits
