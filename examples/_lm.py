"""A GPT-style language model and a token task it can learn, for the training example.

The model is what a transformer hands a gradient engine: token and position embeddings,
pre-LayerNorm blocks of attention and MLP (torch's ``nn.TransformerEncoderLayer``, causal),
a final LayerNorm and an output layer tied to the token embedding: 76 gradient tensors,
13.8M parameters at the defaults.

The task: sequences from a fixed random Markov chain over ``active`` of the vocabulary's
tokens in which every token has ``fanout`` equally likely successors, so the next-token
loss falls from ln(vocab) towards ln(fanout) as the model learns the chain, and accuracy
rises towards 1 / fanout.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = ["GPT", "MarkovTokens"]


class GPT(nn.Module):
    """A decoder-only transformer: ``layers`` blocks of width ``dim`` over ``ctx`` tokens."""

    def __init__(self, vocab: int = 8192, dim: int = 384, layers: int = 6, heads: int = 6,
                 ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        # GPT-2's scale: unit-variance rows would give the tied output layer logits of
        # standard deviation sqrt(dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        mask = nn.Transformer.generate_square_subsequent_mask(ctx)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the next token at every position: ``(batch, time, vocab)``."""
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.ln(x) @ self.tok.weight.t()  # the output layer is the embedding


class MarkovTokens:
    """Token sequences of a seeded Markov chain: ``batch(rank, step, n)`` gives rank
    ``rank``'s ``n`` sequences for ``step``, the same in every run."""

    def __init__(self, vocab: int = 8192, length: int = 65, fanout: int = 4,
                 active: int = 512, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.vocab, self.length, self.fanout, self.active = vocab, length, fanout, active
        # the chain visits ``active`` of the vocabulary's tokens: a model learns which in
        # a few dozen steps (the loss falls from ln(vocab) to ln(active)), then the chain
        self.successors = rng.integers(0, active, size=(active, fanout))

    def batch(self, rank: int, step: int, n: int) -> np.ndarray:
        rng = np.random.default_rng([rank, step, 7])
        out = np.empty((n, self.length), np.int64)
        out[:, 0] = rng.integers(0, self.active, n)
        picks = rng.integers(0, self.fanout, size=(n, self.length - 1))
        for t in range(1, self.length):
            out[:, t] = self.successors[out[:, t - 1], picks[:, t - 1]]
        return out
