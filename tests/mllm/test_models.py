"""Models: from-scratch cells match torch's, GPT is causal and its cache exact, and each model learns."""

import pytest
import torch
import torch.nn as nn

from mllm import UserError
from mllm.config import model_config
from mllm.families.base import build_model
from mllm.lm.gpt import GPT
from mllm.lm.rnn import LSTM, RNN, LSTMCell, RecurrentLM, RNNCell


def cfg(**kw):
    base = dict(vocab_size=11, n_embd=16, n_layer=2, n_head=2, block_size=16, hidden_size=24, dropout=0.0)
    fields = type(model_config(arch=kw.get("arch", "lstm"))).model_fields  # the sizes of arch's own family
    return model_config(**{k: v for k, v in base.items() if k in fields and k not in kw}, **kw)


@pytest.mark.parametrize("layers", [1, 3])
def test_from_scratch_lstm_equals_torch(layers):
    torch.manual_seed(0)
    dropout = 0.3 if layers > 1 else 0.0  # set, to show eval mode turns it off as torch does
    ref = nn.LSTM(5, 7, layers, batch_first=True, dropout=dropout)
    ours = LSTM(5, 7, layers, dropout=dropout)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in ref.state_dict().items()]
    ours.load_state_dict(ref.state_dict())
    ref.eval(), ours.eval()
    x = torch.randn(3, 9, 5)
    for state in (None, (torch.randn(layers, 3, 7), torch.randn(layers, 3, 7))):
        (y_ref, (h_ref, c_ref)), (y, (h, c)) = ref(x, state), ours(x, state)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(c, c_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layers", [1, 3])
def test_from_scratch_rnn_equals_torch(layers):
    torch.manual_seed(0)
    ref = nn.RNN(5, 7, layers, batch_first=True)
    ours = RNN(5, 7, layers)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 9, 5)
    for h0 in (None, torch.randn(layers, 3, 7)):
        (y_ref, h_ref), (y, h) = ref(x, h0), ours(x, h0)
        torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=1e-5, rtol=0)


def test_cells_equal_torch_cells():
    torch.manual_seed(0)
    x, h, c = torch.randn(4, 5), torch.randn(4, 7), torch.randn(4, 7)
    ref, ours = nn.LSTMCell(5, 7), LSTMCell(5, 7)
    ours.load_state_dict(ref.state_dict())
    for a, b in zip(ours(x, (h, c)), ref(x, (h, c))):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    ref, ours = nn.RNNCell(5, 7), RNNCell(5, 7)
    ours.load_state_dict(ref.state_dict())
    torch.testing.assert_close(ours(x, h), ref(x, h), atol=1e-5, rtol=0)


def test_from_scratch_lstm_dropout_acts_between_layers_only_in_training():
    torch.manual_seed(0)
    lstm = LSTM(5, 7, 2, dropout=0.5)
    x = torch.randn(2, 6, 5)
    lstm.train()
    assert not torch.allclose(lstm(x)[0], lstm(x)[0])
    lstm.eval()
    torch.testing.assert_close(lstm(x)[0], lstm(x)[0])


@pytest.mark.parametrize("arch", ["lstm", "rnn"])
def test_from_scratch_checkpoint_loads_into_torch_model(arch):
    torch.manual_seed(0)
    ours = build_model(cfg(arch=arch, from_scratch=True)).eval()
    fused = build_model(cfg(arch=arch)).eval()
    assert isinstance(ours.rnn, (LSTM, RNN)) and not isinstance(fused.rnn, (LSTM, RNN))
    fused.load_state_dict(ours.state_dict())
    idx = torch.randint(0, 11, (2, 12))
    torch.testing.assert_close(ours(idx)[0], fused(idx)[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["lstm", "gru", "rnn"])
def test_recurrent_state_carries_across_calls(arch):
    torch.manual_seed(0)
    model = build_model(cfg(arch=arch)).eval()
    idx = torch.randint(0, 11, (2, 20))
    whole, _, _ = model(idx)
    first, _, state = model(idx[:, :7])
    rest, _, _ = model(idx[:, 7:], state=state)
    torch.testing.assert_close(torch.cat([first, rest], 1), whole, atol=1e-5, rtol=0)
    zeros, _, _ = model(idx[:, :7], state=model.new_state(2, "cpu"))
    torch.testing.assert_close(zeros, first)


def test_recurrent_ties_weights_only_when_sizes_match():
    tied = build_model(cfg(arch="lstm", n_embd=24, hidden_size=24))
    assert tied.head.weight is tied.embedding.weight
    untied = build_model(cfg(arch="lstm", n_embd=24, hidden_size=24, tie_weights=False))
    assert untied.head.weight is not untied.embedding.weight
    mismatched = build_model(cfg(arch="lstm", n_embd=16, hidden_size=24))
    assert mismatched.head.weight.shape == (11, 24) and mismatched.embedding.weight.shape == (11, 16)


def test_gpt_is_causal():
    torch.manual_seed(0)
    model = build_model(cfg(arch="gpt")).eval()
    idx = torch.randint(0, 11, (1, 16))
    before, _, _ = model(idx)
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[0, t] = (idx[0, t] + 1) % 11
        after, _, _ = model(changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], atol=1e-6, rtol=0)
        assert (after[:, t] - before[:, t]).abs().max() > 1e-4


def test_gpt_cache_in_chunks_equals_full_forward():
    torch.manual_seed(0)
    model = build_model(cfg(arch="gpt")).eval()
    idx = torch.randint(0, 11, (2, 16))
    full, _, _ = model(idx)
    cache = model.new_state(2, "cpu")
    pieces = []
    for a, b in [(0, 5), (5, 6), (6, 13), (13, 16)]:  # a prompt, one token, a chunk, the rest
        logits, _, cache = model(idx[:, a:b], state=cache)
        pieces.append(logits)
        assert cache.length == b
    torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="block_size"):
        model(idx[:, :1], state=cache)
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_gpt_parameters_init_and_flops():
    c = cfg(arch="gpt", vocab_size=50, n_embd=32, n_layer=3, n_head=4, block_size=8)
    model = build_model(c)
    d, L = 32, 3
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = 50 * d + 8 * d + L * per_block + 2 * d  # the tied head counted once
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.num_params() == expected
    assert model.num_params(non_embedding=True) == expected - 8 * d
    assert model.flops_per_token(8) == 6 * (expected - 8 * d) + 12 * L * 4 * 8 * 8
    # GPT-2's scaled init: residual projections are smaller by sqrt(2 * n_layer).
    big = build_model(cfg(arch="gpt", n_embd=256, n_layer=8, n_head=4))
    assert big.transformer.h[0].attn.c_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert big.transformer.h[0].mlp.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    untied = build_model(cfg(arch="gpt", tie_weights=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight


@pytest.mark.parametrize("arch", ["gpt", "lstm"])
def test_optim_groups_decay_matrices_only(arch):
    model = build_model(cfg(arch=arch))
    decay, no_decay = model.optim_groups(0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    ids = [id(p) for g in (decay, no_decay) for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    torch.optim.AdamW([decay, no_decay], lr=1e-3)  # accepted as is, tied weights only once


def test_build_model_dispatch_and_missing_vocab():
    assert isinstance(build_model(cfg(arch="gpt")), GPT)
    model = build_model(cfg(arch="gru"))
    assert isinstance(model, RecurrentLM) and isinstance(model.rnn, nn.GRU)
    assert model.config.arch == "gru"
    with pytest.raises(UserError, match="vocab_size"):
        build_model(cfg(vocab_size=0))


def test_loss_ignores_minus_one_targets():
    torch.manual_seed(0)
    model = build_model(cfg(arch="gpt")).eval()
    idx = torch.randint(0, 11, (2, 8))
    targets = torch.randint(0, 11, (2, 8))
    logits, loss, _ = model(idx, targets)
    masked = targets.clone()
    masked[:, 4:] = -1
    _, partial, _ = model(idx, masked)
    expected = nn.functional.cross_entropy(logits[:, :4].reshape(-1, 11), targets[:, :4].reshape(-1))
    torch.testing.assert_close(partial, expected)
    assert not torch.isclose(loss, partial)


TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs! "


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("gpt", dict(n_embd=32, n_layer=1, n_head=2, block_size=32)),
        ("lstm", dict(n_embd=16, hidden_size=48, n_layer=1)),
        ("lstm", dict(n_embd=16, hidden_size=32, n_layer=1, from_scratch=True)),
    ],
)
def test_tiny_model_overfits_tiny_text(arch, extra):
    torch.manual_seed(0)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(ch) for ch in TEXT * 3])
    window = 32
    starts = torch.arange(0, len(TEXT), 3)
    x = torch.stack([data[s : s + window] for s in starts])
    y = torch.stack([data[s + 1 : s + window + 1] for s in starts])
    y[:, :8] = -1  # a window's first characters have too little context to be certain
    model = build_model(model_config(arch=arch, vocab_size=len(chars), dropout=0.0, **extra))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = 150 if arch == "gpt" else 250
    for _ in range(steps):
        _, loss, _ = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    assert loss.item() < 0.05, loss.item()
