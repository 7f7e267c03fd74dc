"""A tiny BERT-style model built from DeepSpeedTransformerLayer trains like the same model built
from the plain-torch reference layer: same initial weights, same data, same optimizer."""

from __future__ import annotations

import torch
from torch import nn

from deepspeed_ext.ops.transformer import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

from .reference import NAMES, bert_layer

VOCAB, H, HEADS, LAYERS, S = 24, 32, 4, 2, 10


class RefLayer(nn.Module):
    """The reference layer as a module, with the fused layer's parameters copied in."""

    def __init__(self, fused: DeepSpeedTransformerLayer) -> None:
        super().__init__()
        self.c = fused.config
        for n in NAMES:
            setattr(self, n, nn.Parameter(getattr(fused, n).detach().clone()))

    def forward(self, x, mask):
        p = {n: getattr(self, n) for n in NAMES}
        return bert_layer(p, x, mask, self.c.heads, self.c.pre_layer_norm, self.c.layer_norm_eps)


class TinyBert(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(layers)
        self.head = nn.Linear(H, VOCAB)

    def forward(self, ids, mask):
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def make_pair(pre_ln: bool) -> tuple[TinyBert, TinyBert]:
    torch.manual_seed(0)
    fused = [
        DeepSpeedTransformerLayer(
            DeepSpeedTransformerConfig(
                batch_size=8,
                hidden_size=H,
                heads=HEADS,
                attn_dropout_ratio=0.0,
                hidden_dropout_ratio=0.0,
                num_hidden_layers=LAYERS,
                initializer_range=0.05,
                pre_layer_norm=pre_ln,
            )
        )
        for _ in range(LAYERS)
    ]
    ours = TinyBert(fused)
    ref = TinyBert([RefLayer(f) for f in fused])
    ref.emb.load_state_dict(ours.emb.state_dict())
    ref.head.load_state_dict(ours.head.state_dict())
    return ours, ref


def batch(gen: torch.Generator):
    """Predict each token from its neighbours: the sequence is a shifted copy of itself."""
    start = torch.randint(0, VOCAB, (8, 1), generator=gen)
    ids = (start + torch.arange(S)) % VOCAB
    mask = torch.zeros(8, 1, 1, S)
    mask[:2, ..., -2:] = -10000.0  # two padded sequences
    return ids, mask


def train(model: TinyBert, steps: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        ids, mask = batch(gen)
        logits = model(ids, mask)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, 1).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def test_tiny_bert_trains_like_the_reference():
    for pre_ln in (True, False):
        ours, ref = make_pair(pre_ln)
        a, b = train(ours, 40), train(ref, 40)
        assert a[-1] < 0.5 * a[0], (pre_ln, a[0], a[-1])  # it learns
        # the same trajectory, up to fp32 rounding carried through 40 Adam steps
        for i, (x, y) in enumerate(zip(a, b)):
            assert abs(x - y) <= 1e-3 * max(1.0, abs(y)), (pre_ln, i, x, y)
