"""Evaluation over a whole split, and the n-gram baselines."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mllm.config import model_config
from mllm.families.base import build_model
from mllm.lm.evaluate import evaluate, ngram_baseline


class BigramTable(nn.Module):
    """A model whose loss is known in closed form: logits of the next token are a row of `table`.

    It follows the forward contract and records every target it is asked to score.
    """

    def __init__(self, vocab_size: int, arch: str, seed: int = 0):
        super().__init__()
        self.config = model_config(arch=arch, vocab_size=vocab_size)
        self.table = nn.Parameter(torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(seed)))
        self.scored: list[int] = []

    def forward(self, idx, targets=None, state=None):
        logits = self.table[idx]
        if targets is not None:
            self.scored += targets[targets >= 0].tolist()
        return logits, None, state


def hand_loss(table: torch.Tensor, ids: np.ndarray) -> float:
    logp = F.log_softmax(table.double(), dim=-1).numpy()
    return float(-np.mean(logp[ids[:-1], ids[1:]]))


@pytest.mark.parametrize("arch", ["lstm", "gpt"])
@pytest.mark.parametrize("n,window,batch_size", [(101, 8, 4), (57, 5, 3), (10, 16, 64), (2, 3, 2), (64, 7, 1)])
def test_every_target_is_scored_exactly_once(arch, n, window, batch_size):
    # Distinct ids, so the targets scored name their positions.
    ids = np.arange(n, dtype=np.uint16)
    model = BigramTable(n, arch)
    result = evaluate(model, ids, window=window, batch_size=batch_size)
    assert sorted(model.scored) == list(range(1, n))
    assert result["tokens"] == n - 1
    assert result["loss"] == pytest.approx(hand_loss(model.table.detach(), ids), rel=1e-6)


def test_loss_matches_a_hand_computation_with_repeated_tokens():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 11, size=333).astype(np.int32)
    model = BigramTable(11, "gpt", seed=3)
    result = evaluate(model, ids, window=10, batch_size=7, n_bytes=500)
    loss = hand_loss(model.table.detach(), ids)
    assert result["loss"] == pytest.approx(loss, rel=1e-6)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert result["bits_per_token"] == pytest.approx(loss / math.log(2), rel=1e-6)
    assert result["bits_per_byte"] == pytest.approx(loss * 332 / math.log(2) / 500, rel=1e-6)


def test_lstm_carries_its_state_across_windows():
    torch.manual_seed(0)
    model = build_model(model_config(arch="lstm", vocab_size=13, n_embd=8, hidden_size=16, n_layer=2, dropout=0.5))
    model.train()
    ids = np.random.default_rng(1).integers(0, 13, size=47)
    x = torch.from_numpy(ids[None, :-1].astype(np.int64))
    y = torch.from_numpy(ids[None, 1:].astype(np.int64))
    model.eval()
    with torch.no_grad():
        _, whole, _ = model(x, y)  # one pass over the split: the state never resets
    model.train()
    result = evaluate(model, ids, window=5, batch_size=1)
    assert result["loss"] == pytest.approx(whole.item(), rel=1e-5)
    assert model.training  # evaluate puts the mode back


def test_gpt_reads_consecutive_windows_of_its_block_size():
    torch.manual_seed(0)
    model = build_model(model_config(arch="gpt", vocab_size=13, n_embd=16, n_head=2, n_layer=2, block_size=8))
    model.eval()
    ids = np.random.default_rng(2).integers(0, 13, size=30)
    total = 0.0
    with torch.no_grad():
        for start in range(0, 29, 8):  # windows of 8 targets, the last one 5
            x = torch.from_numpy(ids[None, start : start + 8].astype(np.int64))
            y = torch.from_numpy(ids[None, start + 1 : start + 9].astype(np.int64))
            logits, _, _ = model(x[:, : y.size(1)], y)
            total += F.cross_entropy(logits[0], y[0], reduction="sum").item()
    # A window wider than the block is cut to it: a GPT has no positions past block_size.
    result = evaluate(model, ids, window=64, batch_size=3)
    assert result["loss"] == pytest.approx(total / 29, rel=1e-5)


def test_unigram_baseline_is_the_entropy_of_the_counts():
    train = np.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 3])
    counts = np.bincount(train) / len(train)
    entropy = -float(np.sum(counts * np.log(counts)))
    # Scored on the same tokens it was fit on (eval_ids[1:] are the targets), unsmoothed.
    result = ngram_baseline(train, np.concatenate([[2], train]), vocab_size=4, order=1, k=0.0)
    assert result["loss"] == pytest.approx(entropy)
    assert result["bits_per_token"] == pytest.approx(entropy / math.log(2))


def test_unigram_add_one_smoothing_gives_unseen_tokens_mass():
    # p(0) = (2 + 1) / (3 + 3), p(2) = (0 + 1) / (3 + 3)
    result = ngram_baseline(np.array([0, 0, 1]), np.array([2, 0, 2]), vocab_size=3, order=1)
    assert result["loss"] == pytest.approx(-(math.log(0.5) + math.log(1 / 6)) / 2)
    assert math.isinf(ngram_baseline(np.array([0, 0, 1]), np.array([2, 0, 2]), 3, order=1, k=0.0)["loss"])


@pytest.mark.parametrize("vocab_size", [7, 5000])  # a dense count table, and sorted pair counts
def test_bigram_baseline_matches_counting_by_hand(vocab_size):
    rng = np.random.default_rng(4)
    train, ev = rng.integers(0, 7, size=400), rng.integers(0, 7, size=90)
    pairs, contexts = Counter(zip(train[:-1], train[1:])), Counter(train[:-1])
    k = 0.5
    loss = -np.mean([math.log((pairs[(a, b)] + k) / (contexts[a] + k * vocab_size)) for a, b in zip(ev[:-1], ev[1:])])
    assert ngram_baseline(train, ev, vocab_size, order=2, k=k)["loss"] == pytest.approx(loss)


def test_bigram_baseline_sees_structure_the_unigram_cannot():
    ids = np.tile(np.arange(5), 60)  # every token predicts the next one exactly
    uni, bi = ngram_baseline(ids, ids, 5, order=1), ngram_baseline(ids, ids, 5, order=2)
    assert uni["loss"] == pytest.approx(math.log(5), rel=1e-3) and bi["loss"] < 0.1
