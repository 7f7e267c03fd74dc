"""A generated text corpus (no downloads): templated sentences with real structure
(agreement, arithmetic), so a small model's loss falls clearly but not to zero."""

from __future__ import annotations

import random

import torch

SUBJECTS = ["the cat", "the dog", "a bird", "my friend", "the teacher", "a child", "the robot"]
VERBS = ["sees", "likes", "finds", "paints", "follows", "greets", "builds"]
OBJECTS = ["a red box", "the old tree", "two apples", "the river", "a small house", "the moon"]
PLACES = ["in the park", "at home", "near the sea", "on the hill", "after school"]


def generate(n_chars: int = 400_000, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        if rng.random() < 0.35:
            a, b = rng.randint(0, 49), rng.randint(0, 49)
            s = f"{a} plus {b} is {a + b}. "
        else:
            s = (
                f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
                f"{rng.choice(PLACES)}. "
            )
        parts.append(s)
        total += len(s)
    return "".join(parts)


class CharData:
    """Character-level tokens and random training windows."""

    def __init__(self, text: str, seq_len: int, vocab: list[str] | None = None) -> None:
        self.chars = vocab if vocab is not None else sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        self.seq_len = seq_len

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(self, batch_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.data) - self.seq_len - 1, (batch_size,), generator=gen)
        x = torch.stack([self.data[i : i + self.seq_len] for i in ix])
        y = torch.stack([self.data[i + 1 : i + 1 + self.seq_len] for i in ix])
        return x, y
