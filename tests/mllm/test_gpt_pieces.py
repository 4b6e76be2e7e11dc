"""The GPT's modern pieces (mllm.lm.gpt_pieces): each against a written-out reference, forward and
backward; cached decoding equals recomputation with them; the defaults are nanoGPT's GPT."""

import math

import pytest
import torch
import torch.nn.functional as F

from mllm import UserError
from mllm.config import model_config
from mllm.families.base import build_model
from mllm.lm.generate import generate
from mllm.lm.gpt_pieces import Rotary, qk_norm, softcap, value_layers
from mllm.resolve import validate
from mllm.runtime import speed
from mllm.runtime.optim import muon_split

ALL = dict(
    positions="rotary",
    norm="rmsnorm",
    qk_norm=True,
    mlp="relu2",
    zero_init_proj=True,
    logit_softcap=15.0,
    tie_weights=False,
    value_embeds=True,
    residual_scalars=True,
)


def gpt(**kw):
    base = dict(arch="gpt", vocab_size=11, n_embd=16, n_layer=2, n_head=2, block_size=16, dropout=0.0)
    return build_model(model_config(**{**base, **kw}))


def shaken(model):
    """`model` with its weights pushed off their small (or zero) init: far from uniform attention
    and equal logits, where almost any computation would agree to 1e-5."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def rotate_by_hand(x, past=0, base=10000.0, d=None):
    """Pair i of each vector, coordinates (i, i + h) with h = d // 2, turned by the angle
    pos * base^(-2i/d)."""
    out = x.clone()
    d = d or x.size(-1)
    for t in range(x.size(-2)):
        for i in range(d // 2):
            a = (past + t) * base ** (-2 * i / d)
            c, s = math.cos(a), math.sin(a)
            u, w = x[..., t, i], x[..., t, i + d // 2]
            out[..., t, i], out[..., t, i + d // 2] = c * u - s * w, s * u + c * w  # d odd: [2h] stays
    return out


@pytest.mark.parametrize("past", [0, 5])
def test_rotary_turns_each_pair_by_its_angle(past):
    torch.manual_seed(0)
    x = torch.randn(2, 3, 7, 8, dtype=torch.float64)
    rot = Rotary(16, 8).double()
    torch.testing.assert_close(rot(x, past), rotate_by_hand(x, past), atol=1e-6, rtol=0)
    # A rotation: lengths hold, and the gradient is the transposed rotation of the upstream one.
    torch.testing.assert_close(rot(x, past).norm(dim=-1), x.norm(dim=-1))
    x.requires_grad_()
    g = torch.randn_like(x)
    rot(x, past).backward(g)
    # R^T g is g turned by minus the angle: past positions backwards are the same as -pos.
    gx = x.grad.clone()
    x.grad = None
    rotate_by_hand(x, past).backward(g)
    torch.testing.assert_close(gx, x.grad, atol=1e-6, rtol=0)


def test_rotary_scores_depend_on_the_offset_only():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)
    rot = Rotary(32, 8).double()
    score = lambda i, j: (rot(q, i) * rot(k, j)).sum().item()  # noqa: E731 (a one-line helper, named where it is used)
    assert score(3, 1) == pytest.approx(score(12, 10)) == pytest.approx(score(25, 23))
    assert score(3, 1) != pytest.approx(score(3, 2))


def test_an_odd_head_size_keeps_its_last_coordinate():
    x = torch.randn(1, 1, 4, 5)
    y = Rotary(8, 5)(x, 2)
    torch.testing.assert_close(y[..., 4], x[..., 4], atol=0, rtol=0)
    torch.testing.assert_close(y, rotate_by_hand(x, 2), atol=1e-6, rtol=0)


def test_rmsnorm_blocks_follow_the_formula():
    torch.manual_seed(0)
    model = shaken(gpt(norm="rmsnorm"))
    ln = model.transformer.h[0].ln_1
    x = torch.randn(3, 5, 16, requires_grad=True)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * ln.weight
    torch.testing.assert_close(ln(x), ref, atol=1e-6, rtol=0)
    g = torch.randn_like(x)
    (gx,) = torch.autograd.grad(ln(x), x, g)
    (gref,) = torch.autograd.grad(ref, x, g)
    torch.testing.assert_close(gx, gref, atol=1e-5, rtol=0)
    assert not [n for n, _ in model.named_parameters() if "ln" in n and n.endswith("bias")]


def test_qk_norm_gives_unit_rms_heads_and_is_applied_before_attention():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 5, 8)
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(qk_norm(x), ref, atol=1e-6, rtol=0)
    # Attention written out by hand with normalised q and k equals the model's layer.
    model = shaken(gpt(qk_norm=True)).eval()
    attn, h = model.transformer.h[0].attn, torch.randn(2, 6, 16)
    q, k, v = attn.c_attn(h).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
    q, k = qk_norm(q), qk_norm(k)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.full((6, 6), float("-inf")).triu(1)
    y = attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 16))
    torch.testing.assert_close(attn(h), y, atol=1e-5, rtol=0)


def test_relu2_mlp_is_relu_squared():
    model = shaken(gpt(mlp="relu2"))
    mlp, x = model.transformer.h[1].mlp, torch.randn(4, 16)
    torch.testing.assert_close(mlp(x), mlp.c_proj(F.relu(mlp.c_fc(x)) ** 2), atol=1e-6, rtol=0)


def test_softcap_bounds_the_logits_forward_and_backward():
    torch.manual_seed(0)
    plain = shaken(gpt(tie_weights=False))
    with torch.no_grad():
        plain.lm_head.weight.mul_(4)  # logits past the cap, where tanh bends (not flat)
    capped = gpt(tie_weights=False, logit_softcap=2.0)
    capped.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 11, (2, 16)), torch.randint(0, 11, (2, 16))
    raw, _, _ = plain(idx)
    assert raw.abs().max() > 4
    ref = 2.0 * torch.tanh(raw / 2.0)
    logits, loss, _ = capped(idx, targets)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    assert logits.abs().max() <= 2.0
    torch.testing.assert_close(softcap(torch.tensor([0.0, 1e4]), 3.0), torch.tensor([0.0, 3.0]))
    loss.backward()
    F.cross_entropy(ref.view(-1, 11), targets.view(-1)).backward()
    for (name, p), q in zip(capped.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_zero_init_projections_make_each_block_the_identity_at_first():
    model = gpt(zero_init_proj=True)
    projections = [p for n, p in model.named_parameters() if n.endswith("c_proj.weight")]
    assert len(projections) == 4 and all(torch.count_nonzero(p) == 0 for p in projections)
    seen = []
    model.transformer.ln_f.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    idx = torch.randint(0, 11, (2, 16))
    _, loss, _ = model(idx, idx)
    x0 = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(16))
    torch.testing.assert_close(seen[0], x0, atol=0, rtol=0)
    loss.backward()
    assert all(p.grad.abs().sum() > 0 for p in projections)  # they learn from the first step
    assert gpt().transformer.h[0].attn.c_proj.weight.abs().sum() > 0  # the default is GPT-2's init


def test_value_embeddings_mix_into_the_values_of_every_other_layer_from_the_last():
    assert value_layers(4) == [1, 3] and value_layers(3) == [0, 2] and value_layers(1) == [0]
    model = shaken(gpt(n_layer=3, value_embeds=True)).eval()
    assert sorted(model.value_embeds) == ["0", "2"] and model.transformer.h[1].attn.ve_lambdas is None
    # Layer 2's attention written out: v = a * v + b * ve(token), a and b the layer's own.
    attn, h, idx = model.transformer.h[2].attn, torch.randn(2, 6, 16), torch.randint(0, 11, (2, 6))
    q, k, v = attn.c_attn(h).view(2, 6, 3, 2, 8).permute(2, 0, 3, 1, 4)
    a, b = attn.ve_lambdas
    v = a * v + b * model.value_embeds["2"](idx).view(2, 6, 2, 8).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.full((6, 6), float("-inf")).triu(1)
    y = attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 6, 16))
    ve = model.value_embeds["2"](idx)
    torch.testing.assert_close(attn(h, ve=ve), y, atol=1e-5, rtol=0)
    assert (attn(h) - y).abs().max() > 0.1  # without it, another output
    # Backward: the table and both mixing weights learn; the tables are AdamW's, not Muon's.
    gy = torch.randn_like(y)
    grads = torch.autograd.grad(attn(h, ve=ve), [attn.ve_lambdas, model.value_embeds["2"].weight], gy)
    ref = torch.autograd.grad(y, [attn.ve_lambdas, model.value_embeds["2"].weight], gy)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
        assert g.abs().sum() > 0
    muon, _ = muon_split(model)
    assert not {id(p) for p in muon} & {id(p) for p in model.value_embeds.parameters()}


def test_residual_scalars_start_as_the_plain_gpt_and_scale_each_layers_input():
    torch.manual_seed(0)
    plain = shaken(gpt()).eval()
    scaled = gpt(residual_scalars=True).eval()
    missing = scaled.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["resid_lambdas", "x0_lambdas"]
    idx = torch.randint(0, 11, (2, 16))
    torch.testing.assert_close(scaled(idx)[0], plain(idx)[0], atol=0, rtol=0)  # r = 1, s = 0
    with torch.no_grad():
        scaled.resid_lambdas.copy_(torch.tensor([0.7, 1.3]))
        scaled.x0_lambdas.copy_(torch.tensor([0.2, -0.4]))
    x0 = scaled.transformer.wte(idx) + scaled.transformer.wpe(torch.arange(16))
    x = x0
    for i, block in enumerate(scaled.transformer.h):
        x = block(scaled.resid_lambdas[i] * x + scaled.x0_lambdas[i] * x0)
    ref = scaled.lm_head(scaled.transformer.ln_f(x))
    logits, loss, _ = scaled(idx, idx)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    scalars = [scaled.resid_lambdas, scaled.x0_lambdas]
    grads = torch.autograd.grad(loss, scalars)
    for g, r in zip(grads, torch.autograd.grad(F.cross_entropy(ref.view(-1, 11), idx.view(-1)), scalars)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
        assert g.abs().min() > 0  # every layer's pair learns
    assert [n for n, p in scaled.named_parameters() if p.dim() < 2 and "lambdas" in n] == [
        "resid_lambdas",
        "x0_lambdas",
    ]


def test_the_defaults_are_nanogpts_gpt():
    model = gpt()
    assert model.speed_variant == {} and isinstance(model.transformer.ln_f, torch.nn.LayerNorm)
    assert isinstance(model.transformer.h[0].mlp.gelu, torch.nn.GELU) and model.rotary is None
    assert model.lm_head.weight is model.transformer.wte.weight
    rotary = gpt(**ALL)
    assert "wpe" not in rotary.transformer and not [k for k in rotary.state_dict() if "rotary" in k]
    assert rotary.lm_head.weight is not rotary.transformer.wte.weight
    assert rotary.speed_variant == {
        "positions": "rotary",
        "norm": "rmsnorm",
        "qk_norm": True,
        "mlp": "relu2",
        "logit_softcap": 15.0,
    }
    assert gpt(positions="sinusoidal").speed_variant == {}  # its probe keys predate the variants
    # mllm.speed's probe keys tell the variants apart (no parameter shape does), not the defaults.
    assert speed._shape(gpt(qk_norm=True)) != speed._shape(gpt())
    assert not [k for k in speed._shape(gpt()) if k[0] == "variant"]


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
@pytest.mark.parametrize(
    "pieces",
    [
        dict(positions="rotary"),
        dict(positions="rotary", mlp="relu2"),
        dict(value_embeds=True, residual_scalars=True),
        ALL,
    ],
    ids=["rotary", "the-default-recipes", "value-embeds-residual-scalars", "all"],
)
def test_the_cache_equals_the_full_forward(attention, pieces):
    model = shaken(gpt(attention=attention, **pieces)).eval()
    idx = torch.randint(0, 11, (2, 16))
    full, _, _ = model(idx)
    assert full.std() > 0.5
    cache, parts = model.new_state(2), []
    for a, b in [(0, 5), (5, 6), (6, 13), (13, 16)]:  # a prompt, one token, a chunk, the rest
        logits, _, cache = model(idx[:, a:b], state=cache)
        parts.append(logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_cached_decoding_equals_recomputation_with_every_piece(attention):
    model = shaken(gpt(attention=attention, **ALL)).eval()
    prompt = [1, 2, 3, 4]
    # Within the block (4 + 12 = 16 positions) the cache and recomputation see the same context;
    # past it generate refills the cache, so they differ there for any positions.
    for method in ("greedy", "top-p"):
        cached = generate(model, prompt, 12, method=method, top_p=0.9, seed=3, use_cache=True)
        assert cached == generate(model, prompt, 12, method=method, top_p=0.9, seed=3, use_cache=False)
    assert len(generate(model, prompt, 40)) == 40
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _, _ = model(torch.tensor([prompt]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "pieces",
    [
        dict(positions="rotary"),
        dict(norm="rmsnorm", qk_norm=True),
        dict(mlp="relu2", zero_init_proj=True),
        dict(logit_softcap=10.0),
        dict(value_embeds=True, residual_scalars=True),
        ALL,
    ],
    ids=["rotary", "norms", "relu2-zero", "softcap", "value-embeds-scalars", "all"],
)
def test_each_piece_learns(pieces):
    text = torch.tensor([i % 11 for i in range(400)]) * 7 % 11
    x = torch.stack([text[s : s + 16] for s in range(0, 300, 7)])
    y = torch.stack([text[s + 1 : s + 17] for s in range(0, 300, 7)])
    torch.manual_seed(0)
    model = gpt(**pieces)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(40):
        _, loss, _ = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_config_refuses_unknown_pieces_and_muon_off_the_gpt():
    with pytest.raises(ValueError, match="norm"):
        model_config(arch="gpt", norm="batchnorm")
    with pytest.raises(ValueError, match="logit_softcap"):
        model_config(arch="gpt", logit_softcap=0)
    with pytest.raises(UserError, match="train.optimizer muon is for the GPT"):
        validate({"model": {"arch": "lstm"}, "train": {"max_steps": 1, "optimizer": "muon"}}, "recipe")
