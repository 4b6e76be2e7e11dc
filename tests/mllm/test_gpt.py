"""The GPT's positions (learned, sinusoidal) and attention (SDPA, written out): every combination
learns, the written-out attention computes what SDPA does, whole or through the KV cache, the
sinusoids follow the formula, and older checkpoints load as they were trained."""

import math

import pytest
import torch
import torch.nn.functional as F

from mllm.config import RunConfig, model_config
from mllm.data.text import CharTokenizer
from mllm.data.vocab import Vocab
from mllm.families.base import build_model
from mllm.lm.generate import generate
from mllm.runtime.checkpoint import load_checkpoint, save_checkpoint
from mllm.transformer import causal_attention, causal_mask, explicit_attention, sinusoidal_positions

COMBINATIONS = [(p, a) for p in ("learned", "sinusoidal") for a in ("sdpa", "explicit")]
TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs! "
CHARS = sorted(set(TEXT))


def gpt(**kw):
    base = dict(arch="gpt", vocab_size=11, n_embd=16, n_layer=2, n_head=2, block_size=16, dropout=0.0)
    return build_model(model_config(**{**base, **kw}))


def with_attention(model, attention: str):
    """A GPT like `model`, the same weights, with the other attention."""
    twin = build_model(model_config(**{**model.config.model_dump(), "attention": attention}))
    twin.load_state_dict(model.state_dict())
    return twin.train(model.training)


def twins(positions: str):
    """An SDPA GPT and an explicit one with the same weights, in eval mode.

    The weights are pushed off their small init so attention is far from uniform and the logits
    far from equal: otherwise almost any attention would agree to 1e-5.
    """
    torch.manual_seed(0)
    sdpa = gpt(positions=positions).eval()
    with torch.no_grad():
        for p in sdpa.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return sdpa, with_attention(sdpa, "explicit")


# ---------------------------------------------------------------------------------------------
# the shared pieces


@pytest.mark.parametrize("d", [10, 7])
def test_sinusoidal_positions_follow_the_formula(d):
    pe = sinusoidal_positions(50, d)
    assert pe.shape == (50, d)
    for pos in (0, 1, 7, 49):
        for i in range(math.ceil(d / 2)):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            if 2 * i + 1 < d:
                assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_explicit_attention_equals_torch_sdpa_with_and_without_a_cache():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8), torch.randn(2, 3, 9, 8)
    y, w = explicit_attention(q, k, v, causal_mask(9))
    torch.testing.assert_close(y, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=0)
    assert torch.all(w.triu(diagonal=1) == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 9))
    # The last 5 queries after 4 cached positions: query i is position 4 + i.
    y, _ = explicit_attention(q[:, :, 4:], k, v, causal_mask(5, past=4))
    ref = F.scaled_dot_product_attention(q[:, :, 4:], k, v, attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(4))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=0)
    assert torch.equal(causal_mask(5, past=4).isinf(), ~torch.ones(5, 9, dtype=torch.bool).tril(4))


@pytest.mark.parametrize("T", [9, 131])  # in one piece, and in two halves of the queries (odd: unequal)
def test_causal_attention_written_out_equals_torch_sdpa_forward_and_backward(T):
    torch.manual_seed(0)
    base = [torch.randn(2, 3, T, 8) for _ in range(3)]
    grad = torch.randn(2, 3, T, 8)
    outs = []
    for attend in (causal_attention, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)):
        q, k, v = (x.clone().requires_grad_() for x in base)
        y = attend(q, k, v)
        y.backward(grad)
        outs.append([y, q.grad, k.grad, v.grad])
    for ours, theirs in zip(*outs):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# the GPT


def test_sinusoidal_gpt_adds_the_table_and_stores_no_positions():
    torch.manual_seed(0)
    model = gpt(positions="sinusoidal").eval()
    assert list(model.transformer.wpe.parameters()) == []
    assert not [k for k in model.state_dict() if "wpe" in k]
    torch.testing.assert_close(model.transformer.wpe.pe, sinusoidal_positions(16, 16), atol=0, rtol=0)
    seen = []
    model.transformer.h[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    idx = torch.randint(0, 11, (2, 16))
    model(idx)
    # As the seq2seq transformer: sqrt(n_embd) * the token's embedding + its position's row.
    expected = model.transformer.wte(idx) * math.sqrt(16) + sinusoidal_positions(16, 16)
    torch.testing.assert_close(seen[0], expected, atol=1e-6, rtol=0)


def test_sinusoidal_gpt_has_block_size_times_n_embd_fewer_parameters():
    learned = gpt(n_embd=32, n_head=4, block_size=24)
    sinusoidal = gpt(n_embd=32, n_head=4, block_size=24, positions="sinusoidal")
    assert sinusoidal.num_params() == learned.num_params() - 24 * 32
    assert sinusoidal.num_params(non_embedding=True) == learned.num_params(non_embedding=True)
    assert sinusoidal.flops_per_token(24) == learned.flops_per_token(24)
    assert gpt(attention="explicit").num_params() == gpt().num_params()


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_explicit_attention_equals_sdpa(positions):
    sdpa, explicit = twins(positions)
    idx, targets = torch.randint(0, 11, (3, 16)), torch.randint(0, 11, (3, 16))
    (a, loss_a, _), (b, loss_b, _) = sdpa(idx, targets), explicit(idx, targets)
    assert a.std() > 1  # far from uniform: a wrong mask or scale would show
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_b, loss_a, atol=1e-5, rtol=0)
    # Training mode without dropout: the same gradients too.
    sdpa.train(), explicit.train()
    sdpa(idx, targets)[1].backward()
    explicit(idx, targets)[1].backward()
    for (name, p), q in zip(sdpa.named_parameters(), explicit.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_explicit_attention_through_the_cache_equals_sdpa_and_the_full_forward(positions):
    sdpa, explicit = twins(positions)
    idx = torch.randint(0, 11, (2, 16))
    full, _, _ = sdpa(idx)
    for model in (sdpa, explicit):
        cache, pieces = model.new_state(2, "cpu"), []
        for a, b in [(0, 5), (5, 6), (6, 13), (13, 16)]:  # a prompt, one token, a chunk, the rest
            logits, _, cache = model(idx[:, a:b], state=cache)
            pieces.append(logits)
        torch.testing.assert_close(torch.cat(pieces, 1), full, atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="block_size"):  # block_size still bounds the cache
            model(idx[:, :1], state=cache)


def test_explicit_attention_drops_weights_only_in_training():
    torch.manual_seed(0)
    model = gpt(attention="explicit", dropout=0.5)
    idx = torch.randint(0, 11, (2, 16))
    model.train()
    assert not torch.allclose(model(idx)[0], model(idx)[0])
    model.eval()
    torch.testing.assert_close(model(idx)[0], model(idx)[0], atol=0, rtol=0)


@pytest.fixture(scope="module")
def trained():
    """Each combination trained 40 steps on TEXT, from the same seed: (model, losses)."""
    data = torch.tensor([CHARS.index(ch) for ch in TEXT * 3])
    starts = torch.arange(0, len(TEXT), 3)
    x = torch.stack([data[s : s + 32] for s in starts])
    y = torch.stack([data[s + 1 : s + 33] for s in starts])
    runs = {}
    for positions, attention in COMBINATIONS:
        torch.manual_seed(0)
        model = build_model(
            model_config(
                arch="gpt",
                vocab_size=len(CHARS),
                n_embd=32,
                n_layer=1,
                n_head=2,
                block_size=32,
                dropout=0.1,
                positions=positions,
                attention=attention,
            )
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(40):
            _, loss, _ = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        runs[positions, attention] = model.eval(), losses
    return runs


@pytest.mark.parametrize("positions,attention", COMBINATIONS)
def test_every_combination_learns(trained, positions, attention):
    _, losses = trained[positions, attention]
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_greedy_decoding_agrees_with_and_without_cache_and_either_attention(trained, positions):
    sdpa = trained[positions, "sdpa"][0]
    explicit = with_attention(sdpa, "explicit")
    prompt = [CHARS.index(ch) for ch in "the quick"]
    # Within the block (9 + 23 = 32 positions) the cache and recomputation see the same context.
    runs = {
        (a, c): generate(m, prompt, 23, use_cache=c)
        for a, m in (("sdpa", sdpa), ("explicit", explicit))
        for c in (True, False)
    }
    assert len(set(map(tuple, runs.values()))) == 1, runs
    # Past it the cache is refilled, the same way for either attention.
    assert generate(explicit, prompt, 60) == generate(sdpa, prompt, 60)


# ---------------------------------------------------------------------------------------------
# checkpoints


def test_a_checkpoint_from_before_the_fields_loads_as_learned_sdpa(tmp_path):
    vocab = Vocab.build({ch: TEXT.count(ch) for ch in TEXT})
    cfg = RunConfig(
        model=model_config(
            arch="gpt", vocab_size=len(vocab), n_embd=16, n_layer=1, n_head=2, block_size=64, dropout=0.0
        )
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    old = cfg.to_dict()
    del old["model"]["positions"], old["model"]["attention"]  # as written before they existed
    url = str(tmp_path / "best.pt")
    save_checkpoint(
        url,
        {
            "model": model.state_dict(),
            "step": 1,
            "config": old,
            "vocab": vocab.to_json(),
            "vocab_digest": vocab.digest,
            "tokenizer": CharTokenizer(normalize=True).to_json(),
        },
    )
    loaded = load_checkpoint(url)
    assert (loaded.config.model.positions, loaded.config.model.attention) == ("learned", "sdpa")
    idx = torch.randint(0, len(vocab), (1, 64))
    torch.testing.assert_close(loaded.model(idx)[0], model(idx)[0], atol=0, rtol=0)


def test_state_dicts_do_not_cross_position_kinds():
    learned, sinusoidal = gpt(), gpt(positions="sinusoidal")
    with pytest.raises(RuntimeError, match="wpe"):
        sinusoidal.load_state_dict(learned.state_dict())
    with pytest.raises(RuntimeError, match="wpe"):
        learned.load_state_dict(sinusoidal.state_dict())
    # The attention has no weights of its own: a state_dict loads into either.
    gpt(attention="explicit").load_state_dict(learned.state_dict())


def test_config_refuses_other_kinds():
    with pytest.raises(ValueError, match="positions"):
        model_config(arch="gpt", positions="alibi")
    with pytest.raises(ValueError, match="attention"):
        model_config(arch="gpt", attention="flash")
