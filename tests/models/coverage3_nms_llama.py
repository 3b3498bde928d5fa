"""Models for issue 44 (items 2 and 3): a detection head whose greedy NMS loop runs a data-dependent
number of times, and an Optimum-style "with-past" Llama (flat past keys and values in, logits and
flat present keys and values out, a DynamicCache built in between).

Nothing is downloaded: the Llama is built from a LlamaConfig with random weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from tests.models.packaging import save_package

os.environ["HF_HUB_OFFLINE"] = "1"

# -- a detection head with a greedy NMS loop ---------------------------------------------------


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of every box of `a` [N, 4] with every box of `b` [M, 4] (x1, y1, x2, y2)."""
    top_left = torch.max(a[:, None, :2], b[None, :, :2])
    bottom_right = torch.min(a[:, None, 2:], b[None, :, 2:])
    inter = (bottom_right - top_left).clamp(min=0).prod(-1)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    return inter / (area_a[:, None] + area_b[None, :] - inter)


class GreedyNmsHead(nn.Module):
    """boxes [N, 4] and scores [N] → the kept boxes [K, 4] and their scores [K].

    A small learned rescoring (a Linear on the box and its score), a score threshold, then greedy
    NMS written as a `while` loop over the remaining candidates: how many times it runs, and how
    many boxes it keeps, depend on the values. Scriptable as it is (torch.jit.script)."""

    def __init__(self, iou_threshold: float = 0.3, score_threshold: float = 0.2) -> None:
        super().__init__()
        self.rescore = nn.Linear(5, 1)
        self.iou_threshold, self.score_threshold = iou_threshold, score_threshold

    def forward(self, boxes: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        corners = torch.cat([torch.min(boxes[:, :2], boxes[:, 2:]), torch.max(boxes[:, :2], boxes[:, 2:]) + 1.0], 1)
        feats = torch.cat([corners / 10.0, scores[:, None]], 1)
        scores = torch.sigmoid(self.rescore(feats).squeeze(1) + scores)
        order = torch.argsort(scores, descending=True)
        order = order[scores[order] > self.score_threshold]
        keep = torch.zeros(0, dtype=torch.long)
        while order.numel() > 0:  # one pass per kept box: a data-dependent count
            best = order[:1]
            keep = torch.cat([keep, best])
            rest = order[1:]
            overlap = box_iou(corners[best], corners[rest])[0]
            order = rest[overlap <= self.iou_threshold]
        return corners[keep], scores[keep]


def save_nms_package(folder: Path) -> Path:
    """The GreedyNmsHead (seed 0) as a torch.package, `folder`/nms_head.pkg: no capture rung follows
    its loop, so every target comes from the eager model."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = GreedyNmsHead().eval()
    return save_package(folder / "nms_head.pkg", model, intern="tests.**", extern=["torch.**", "transformers.**"])


def nms_inputs(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`count` random boxes in a 40x40 field and their scores."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(count, 4, generator=gen) * 40.0, torch.randn(count, generator=gen)


# -- an Optimum-style with-past Llama ----------------------------------------------------------

LLAMA_LAYERS = 2
LLAMA_KV_HEADS = 2
LLAMA_HEAD_DIM = 8
LLAMA_VOCAB = 64


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=LLAMA_VOCAB, hidden_size=LLAMA_KV_HEADS * 2 * LLAMA_HEAD_DIM,
                         intermediate_size=32, num_hidden_layers=LLAMA_LAYERS, num_attention_heads=LLAMA_KV_HEADS * 2,
                         num_key_value_heads=LLAMA_KV_HEADS, max_position_embeddings=128,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return LlamaForCausalLM(config)


class LlamaWithPast(nn.Module):
    """input_ids [batch, seq] and past keys/values per layer, each [batch, kv_heads, past, head_dim],
    flat (key_0, value_0, key_1, value_1, ...) → logits [batch, seq, vocab] and the present keys/values
    [batch, kv_heads, past + seq, head_dim], flat in the same order."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = tiny_llama()

    def forward(self, input_ids: torch.Tensor, past_key_0: torch.Tensor, past_value_0: torch.Tensor,
                past_key_1: torch.Tensor, past_value_1: torch.Tensor) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        cache = DynamicCache([(past_key_0, past_value_0), (past_key_1, past_value_1)], config=self.llama.config)
        out = self.llama(input_ids=input_ids, cache=cache, use_cache=True)
        present = out.cache
        flat: list[torch.Tensor] = []
        for layer in present.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)


def llama_input_names() -> list[str]:
    return ["input_ids"] + [f"past_{kind}_{i}" for i in range(LLAMA_LAYERS) for kind in ("key", "value")]


def llama_inputs(batch: int, seq: int, past: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, LLAMA_VOCAB, (batch, seq), generator=gen)
    kv = [torch.randn(batch, LLAMA_KV_HEADS, past, LLAMA_HEAD_DIM, generator=gen) for _ in range(2 * LLAMA_LAYERS)]
    return (ids, *kv)


def build_llama_with_past() -> LlamaWithPast:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaWithPast().eval()


# the dims a with-past export is made with: a decode step is seq 1; the example (2, 3, 4) is a prefill
LLAMA_DIMS = {"batch": (1, 2, 4), "seq": (1, 3, 16), "past": (1, 6, 32)}  # (min, opt, max)


def export_llama_with_past(path: str) -> None:
    """torch.export of LlamaWithPast with dynamic batch, seq and past dims, saved at `path` (.pt2)."""
    import warnings

    dims = {name: torch.export.Dim(name, min=lo, max=hi) for name, (lo, _, hi) in LLAMA_DIMS.items()}
    kv = {0: dims["batch"], 2: dims["past"]}
    dynamic = {"input_ids": {0: dims["batch"], 1: dims["seq"]},
               **{name: kv for name in llama_input_names()[1:]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.export.export(build_llama_with_past(), llama_inputs(2, 3, 4), dynamic_shapes=dynamic)
    torch.export.save(program, path)


def llama_spec(targets: list[str]) -> dict:
    """The job spec of the with-past Llama: its inputs by name, the three dims with their ranges."""
    kv_shape = ["batch", LLAMA_KV_HEADS, "past", LLAMA_HEAD_DIM]
    inputs = [{"name": "input_ids", "shape": ["batch", "seq"], "dtype": "int64"}]
    inputs += [{"name": name, "shape": kv_shape} for name in llama_input_names()[1:]]
    return {"inputs": inputs, "targets": targets, "verify": {"samples": 2},
            "dynamic_dims": {n: dict(zip(("min", "opt", "max"), r)) for n, r in LLAMA_DIMS.items()}}
