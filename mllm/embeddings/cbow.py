"""CBOW word embeddings (word2vec's continuous bag of words) in plain PyTorch, on contexts that stay
inside a paragraph, by a full softmax or negative sampling."""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm import UserError
from mllm.config import CbowConfig
from mllm.data.text import BasicEnglishTokenizer, basic_english, split_paragraphs  # noqa: F401  (the family's API)
from mllm.data.vocab import Vocab
from mllm.runtime.epochs import ChainedIds, EpochOrder, check_offsets

PAD_ID = 0  # <unk>'s id stands in for a missing context word; the mask keeps it out of the mean


# -----------------------------------------------------------------------------
# paragraphs as arrays: flat ids + offsets (offsets[i]: where paragraph i starts; last: len(ids))


def paragraph_ids(paragraphs: Iterable[list[str]], vocab: Vocab) -> tuple[np.ndarray, np.ndarray]:
    """Flat int32 ids of token lists (one per paragraph) and the int64 offsets of the paragraphs."""
    lengths, tokens = [], []
    for p in paragraphs:
        if p:
            lengths.append(len(p))
            tokens.extend(p)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    ids = vocab.encode_array(tokens) if tokens else np.zeros(0, dtype=np.int32)
    return ids, offsets


def split_by_paragraph(ids: np.ndarray, offsets: np.ndarray, val_fraction: float):
    """The last `val_fraction` of the paragraphs (at least one) held out, whole paragraphs only.

    Returns (train_ids, train_offsets, val_ids, val_offsets).
    """
    n = len(offsets) - 1
    n_val = max(1, round(n * val_fraction)) if val_fraction > 0 else 0
    if n - n_val < 1:
        raise UserError(
            f"{n} paragraph(s) cannot be split {1 - val_fraction:g}/{val_fraction:g}: "
            "use more text or a smaller val_fraction"
        )
    cut = offsets[n - n_val]
    return ids[:cut], offsets[: n - n_val + 1], ids[cut:], offsets[n - n_val :] - cut


# -----------------------------------------------------------------------------
# samples and batches


def _relative(context: int) -> np.ndarray:
    return np.r_[np.arange(-context, 0), np.arange(1, context + 1)]


def _take(ids, index: np.ndarray) -> np.ndarray:
    # A split of a many-file corpus is a chain of pieces (mllm.runtime.epochs.ChainedIds), which gathers
    # from them; np.asarray would copy it whole for every batch.
    return ids[index] if isinstance(ids, ChainedIds) else np.asarray(ids)[index]


def contexts(
    ids: np.ndarray, offsets: np.ndarray, centres: np.ndarray, context: int, skip_unk: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Context ids [N, 2*context] around each centre position, and the mask of real words.

    A position outside the centre's paragraph (or <unk>, with skip_unk) is masked and holds PAD_ID.
    """
    centres = np.asarray(centres, dtype=np.int64)
    para = np.searchsorted(offsets, centres, side="right") - 1
    start, end = offsets[para][:, None], offsets[para + 1][:, None]
    where = centres[:, None] + _relative(context)
    mask = (where >= start) & (where < end)
    ctx = np.where(mask, _take(ids, np.clip(where, 0, max(len(ids) - 1, 0))), PAD_ID)
    if skip_unk:
        mask &= ctx != 0
        ctx[~mask] = PAD_ID
    return ctx.astype(np.int64), mask


def sample_centres(
    ids: np.ndarray, offsets: np.ndarray, context: int, skip_unk: bool = True, block: int = 1 << 20
) -> np.ndarray:
    """Every position that makes a sample: its word is kept and its context holds one word or more."""
    out = []
    for lo in range(0, len(ids), block):
        pos = np.arange(lo, min(lo + block, len(ids)), dtype=np.int64)
        _, mask = contexts(ids, offsets, pos, context, skip_unk)
        keep = mask.any(axis=1)
        if skip_unk:
            keep &= np.asarray(ids[lo : lo + block]) != 0
        out.append(pos[keep])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def noise_distribution(ids: np.ndarray, vocab_size: int, power: float = 0.75, skip_unk: bool = True) -> np.ndarray:
    """word2vec's noise: unigram counts ** power, normalised (<unk> never drawn with skip_unk)."""
    counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab_size)[:vocab_size]
    weights = counts.astype(np.float64) ** power
    weights[counts == 0] = 0.0
    if skip_unk:
        weights[0] = 0.0
    if weights.sum() <= 0:
        raise UserError("the training text has no word to draw noise words from: use more text")
    return weights / weights.sum()


def make_batch(
    ids,
    offsets,
    centres,
    context: int,
    skip_unk: bool,
    noise_cdf: np.ndarray | None,
    n_negative: int,
    rng: np.random.Generator | None,
):
    """(context [B, 2C] int64, mask [B, 2C] bool, negatives [B, K] int64, centre [B] int64).

    K is 0 without noise (full softmax). Negatives come from `rng`, so a batch is a pure function
    of its position and the seed.
    """
    ctx, mask = contexts(ids, offsets, centres, context, skip_unk)
    if noise_cdf is not None and n_negative > 0:
        u = rng.random((len(centres), n_negative))
        neg = np.minimum(np.searchsorted(noise_cdf, u, side="right"), len(noise_cdf) - 1)
    else:
        neg = np.zeros((len(centres), 0), dtype=np.int64)
    centre = _take(ids, np.asarray(centres)).astype(np.int64)
    return (
        torch.from_numpy(ctx),
        torch.from_numpy(mask),
        torch.from_numpy(neg.astype(np.int64)),
        torch.from_numpy(centre),
    )


class CbowBatches(EpochOrder):
    """Shuffled passes over every sample (centre position), like mllm.lm.windows.EpochWindows.

    A batch's noise words depend only on (seed, epoch, batch, rank), so the position (epoch,
    batch) stays the whole state.
    """

    def __init__(
        self,
        ids: np.ndarray,
        offsets: np.ndarray,
        context: int,
        batch_size: int,
        seed: int,
        noise: np.ndarray | None = None,
        n_negative: int = 0,
        skip_unk: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.ids, self.offsets = ids, check_offsets(offsets, len(ids))
        self.context, self.skip_unk = context, skip_unk
        self.n_negative = n_negative if noise is not None else 0
        self.noise_cdf = None if noise is None else np.cumsum(noise)
        self.centres = sample_centres(ids, self.offsets, context, skip_unk)
        if len(self.centres) == 0:
            raise UserError(
                "the training text has no CBOW sample (no paragraph with two known "
                "words): use more text or lower vocab.min_freq"
            )
        self.num_samples = len(self.centres)
        super().__init__(self.num_samples, batch_size, seed, rank, world_size)

    @classmethod
    def from_config(
        cls, cfg: CbowConfig, ids, offsets, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> "CbowBatches":
        noise = None
        if cfg.objective == "negative":
            vocab_size = cfg.vocab_size or int(np.max(ids)) + 1
            noise = noise_distribution(ids, vocab_size, cfg.noise_power, cfg.skip_unk)
        return cls(ids, offsets, cfg.context, batch_size, seed, noise, cfg.n_negative, cfg.skip_unk, rank, world_size)

    def next(self):
        epoch, batch = self.position
        rng = np.random.default_rng([self.seed, epoch, batch, self.rank, 1])
        return make_batch(
            self.ids,
            self.offsets,
            self.centres[self.take()],
            self.context,
            self.skip_unk,
            self.noise_cdf,
            self.n_negative,
            rng,
        )

    def eval_batches(self, count: int | None = None, seed: int = 0) -> list[tuple]:
        """Fixed batches (centres and noise words) to score the same way at every eval."""
        centres = self.centres
        if count is not None and count < len(centres):
            centres = np.sort(np.random.default_rng(seed).choice(centres, size=count, replace=False))
        rng = np.random.default_rng([seed, 2])
        return [
            make_batch(
                self.ids,
                self.offsets,
                centres[i : i + self.batch_size],
                self.context,
                self.skip_unk,
                self.noise_cdf,
                self.n_negative,
                rng,
            )
            for i in range(0, len(centres), self.batch_size)
        ]


# -----------------------------------------------------------------------------
# the model


class CBOW(nn.Module):
    """Embedding(V, D, max_norm) averaged over the context -> bias-free Linear(D, V).

    forward(context, mask, negatives, target) -> (logits | None, loss | None, None), the language
    models' contract: logits [B, V] with the softmax objective; with negative sampling only the
    target's and the noise words' scores are computed, so logits are None.
    """

    def __init__(self, config: CbowConfig):
        super().__init__()
        assert config.vocab_size > 0, "set vocab_size to the vocabulary's size first"
        self.config = config
        # max_norm is applied by `renorm_`, not by nn.Embedding: see there.
        self.embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def flops_per_target(self) -> int:
        """Training FLOPs per centre word (mllm.runtime.speed): the output layer's product with the mean
        context, over every word of the vocabulary (softmax) or the centre and noise words only
        (negative sampling). Averaging the context is additions, and is left out."""
        c = self.config
        scored = c.vocab_size if c.objective == "softmax" else 1 + c.n_negative
        return 6 * c.n_embd * scored

    @torch.no_grad()
    def renorm_(self) -> None:
        """nn.Embedding(max_norm=...)'s rule, torch's formula (1e-7 included), on every row.

        torch scales only the rows a batch looks up, one at a time on CPU (half of a step's
        time); under DDP each rank looks up different rows, so the replicas would drift apart.
        Scaling every row too long is a function of the weights alone, so every rank does the
        same, and a looked-up row is exactly what torch's lookup would use.
        """
        if self.config.max_norm is None:
            return
        w = self.embedding.weight
        norms = w.norm(dim=1)
        over = norms > self.config.max_norm
        if over.any():
            w[over] *= (self.config.max_norm / (norms[over] + 1e-7)).unsqueeze(1).to(w.dtype)

    def encode(self, context: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The mean input embedding of each row's real context words: [B, D]."""
        self.renorm_()
        m = mask.to(self.embedding.weight.dtype)
        weights = m / m.sum(1, keepdim=True).clamp_min(1.0)
        # embedding_bag sums the weighted rows without materialising [B, 2C, D]: the step's
        # largest cost otherwise.
        return F.embedding_bag(context, self.embedding.weight, per_sample_weights=weights, mode="sum")

    def forward(self, context, mask, negatives=None, target=None):
        h = self.encode(context, mask)
        if self.config.objective == "softmax" or target is None:
            logits = self.head(h)
            loss = None if target is None else F.cross_entropy(logits, target)
            return logits, loss, None
        # Column 0 is the centre word, the rest are noise words: one gather and one product.
        words = torch.cat([target.unsqueeze(1), negatives], dim=1)
        # Not bmm: on CPU, thousands of [K, D] x [D, 1] products are slower than a multiply-sum.
        scores = (self.head.weight[words] * h.unsqueeze(1)).sum(-1)
        # A noise draw that happens to be the centre word is no negative example of it.
        real = (negatives != target.unsqueeze(-1)).to(h.dtype)
        loss = -(F.logsigmoid(scores[:, 0]) + (F.logsigmoid(-scores[:, 1:]) * real).sum(-1)).mean()
        return None, loss, None

    @torch.no_grad()
    def context_vectors(self) -> torch.Tensor:
        """The input embeddings as a lookup returns them (rows scaled back to max_norm): [V, D]."""
        w = self.embedding.weight.detach().float().clone()
        if self.config.max_norm is not None:
            norm = w.norm(dim=1, keepdim=True)
            w = torch.where(norm > self.config.max_norm, w * (self.config.max_norm / norm), w)
        return w

    @torch.no_grad()
    def centre_vectors(self) -> torch.Tensor:
        """The output layer's rows, one per centre word: [V, D]."""
        return self.head.weight.detach().float().clone()

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def optim_groups(self, weight_decay: float) -> list[dict]:
        # No decay: it would pull the vectors of rare words, updated seldom, towards zero.
        return [{"params": [p for p in self.parameters() if p.requires_grad], "weight_decay": 0.0}]
