"""Evaluation over a whole split, every target token scored exactly once, and n-gram baselines to read it against."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

LN2 = math.log(2)


def _scores(loss: float, tokens: int, n_bytes: int | None) -> dict[str, float]:
    out = {
        "loss": loss,
        "perplexity": math.exp(loss) if loss < 700 else math.inf,
        "bits_per_token": loss / LN2,
        "tokens": tokens,
    }
    if n_bytes:
        # Bits per byte of the raw text: comparable across tokenizers (nanochat's headline metric).
        out["bits_per_byte"] = loss * tokens / LN2 / n_bytes
    return out


def _rows(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, offset: int, window: int):
    """Inputs and targets for rows whose targets are ids[starts+1 : ends+1], from `offset` on.

    Positions past a row's end are padded: input 0, target -1 (ignored by the loss).
    """
    width = min(window, int((ends - starts).max()) - offset)
    pos = starts[:, None] + offset + np.arange(width)
    valid = pos < ends[:, None]
    safe = np.where(valid, pos, 0)
    x = torch.from_numpy(np.asarray(ids[safe], dtype=np.int64))
    y = torch.from_numpy(np.where(valid, np.asarray(ids[safe + 1], dtype=np.int64), -1))
    return x, y


def _sum_loss(model, x, y, device, state=None):
    logits, _, state = model(x.to(device), y.to(device), state=state)
    loss = F.cross_entropy(
        logits.float().view(-1, logits.size(-1)), y.to(device).view(-1), ignore_index=-1, reduction="sum"
    )
    return loss.double(), state


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    ids: np.ndarray,
    window: int,
    batch_size: int,
    device: str | torch.device = "cpu",
    n_bytes: int | None = None,
) -> dict[str, float]:
    """Mean cross-entropy over every target of `ids`, with perplexity and bits per token.

    `n_bytes`: the UTF-8 size of the text these ids came from, to add bits_per_byte.
    """
    n_targets = len(ids) - 1
    if n_targets < 1:
        raise ValueError("evaluate needs at least two tokens")
    config = getattr(model, "config", None)
    recurrent = getattr(config, "arch", "gpt") != "gpt"
    if not recurrent:
        window = min(window, getattr(config, "block_size", window))  # no positions past it
    was_training = model.training
    model.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    try:
        if recurrent:
            # Contiguous streams (lengths differ by at most one), walked window by window with
            # the hidden state carried over.
            streams = min(batch_size, n_targets)
            bounds = np.linspace(0, n_targets, streams + 1).round().astype(np.int64)
            starts, ends = bounds[:-1], bounds[1:]
            state = None
            for offset in range(0, int((ends - starts).max()), window):
                loss, state = _sum_loss(model, *_rows(ids, starts, ends, offset, window), device, state)
                total += loss
        else:
            every = np.arange(0, n_targets, window)
            for i in range(0, len(every), batch_size):
                starts = every[i : i + batch_size]
                ends = np.minimum(starts + window, n_targets)
                total += _sum_loss(model, *_rows(ids, starts, ends, 0, window), device)[0]
    finally:
        model.train(was_training)
    return _scores(total.item() / n_targets, n_targets, n_bytes)


def ngram_baseline(
    train_ids: np.ndarray, eval_ids: np.ndarray, vocab_size: int, order: int = 1, k: float = 1.0
) -> dict[str, float]:
    """Loss of an add-k smoothed unigram (order 1) or bigram (order 2) model fit on train_ids.

    Scores the same targets as `evaluate` (eval_ids[1:]), so the numbers compare directly.
    k=0 is the unsmoothed maximum-likelihood model (infinite loss on an unseen token).
    """
    if order not in (1, 2):
        raise ValueError("order must be 1 (unigram) or 2 (bigram)")
    train = np.asarray(train_ids, dtype=np.int64)
    ev = np.asarray(eval_ids, dtype=np.int64)
    if len(ev) < 2 or len(train) < order:
        raise ValueError("ngram_baseline needs at least two eval tokens and `order` train tokens")
    targets = ev[1:]
    V = vocab_size
    with np.errstate(divide="ignore"):
        if order == 1:
            counts = np.bincount(train, minlength=V).astype(np.float64)
            logp = np.log(counts[targets] + k) - np.log(counts.sum() + k * V)
        else:
            context = np.bincount(train[:-1], minlength=V).astype(np.float64)
            pair = _pair_counts(train[:-1] * V + train[1:], ev[:-1] * V + targets, V)
            logp = np.log(pair + k) - np.log(context[ev[:-1]] + k * V)
    loss = float(-logp.mean())
    return _scores(loss, len(targets), None)


def _pair_counts(train_pairs: np.ndarray, wanted: np.ndarray, V: int) -> np.ndarray:
    """Training counts of the wanted (prev * V + next) pairs."""
    if V * V <= 1 << 24:
        return np.bincount(train_pairs, minlength=V * V)[wanted].astype(np.float64)
    # A V x V table would not fit for large (BPE, word) vocabularies: count the pairs that occur.
    seen, counts = np.unique(train_pairs, return_counts=True)
    at = np.minimum(np.searchsorted(seen, wanted), len(seen) - 1)
    return np.where(seen[at] == wanted, counts[at], 0).astype(np.float64)
