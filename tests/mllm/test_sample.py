"""Sampling: cached generation equals recomputation, each method picks what it promises, seeds
repeat, beam search beats greedy, and the CLI turns a checkpoint and a prompt into text."""

import json

import prewarmed
import pytest
import torch
import torch.nn.functional as F

from mllm import UserError
from mllm.config import RunConfig, model_config
from mllm.data.text import CharTokenizer
from mllm.data.vocab import Vocab
from mllm.families.base import build_model
from mllm.lm import decode
from mllm.lm.generate import filter_top_k, filter_top_p, generate, next_token, sample_text
from mllm.runtime import speed
from mllm.runtime.checkpoint import load_checkpoint, save_checkpoint
from mllm.sample import main

V = 13


def tiny(arch, seed=4, **kw):
    """A small random model with confident predictions, so near-ties cannot flip an argmax."""
    torch.manual_seed(seed)
    base = dict(vocab_size=V, n_embd=16, n_layer=2, n_head=2, block_size=16, hidden_size=16, dropout=0.0)
    fields = type(model_config(arch=arch)).model_fields  # the sizes of arch's own family
    model = build_model(
        model_config(arch=arch, **{k: v for k, v in base.items() if k in fields and k not in kw}, **kw)
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.5)
    return model


def log_prob(model, prompt, new):
    """Sum of the model's log-probs of `new` after `prompt`, from one full forward."""
    seq = torch.tensor([prompt + new])
    logp = F.log_softmax(model(seq)[0][0, :-1], -1)
    return sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(new))


PROMPT = [1, 2, 3, 4]
ARCHS = [("lstm", {}), ("gru", {}), ("rnn", {}), ("lstm", {"from_scratch": True})]


def test_gpt_cache_equals_recompute_token_for_token():
    model = tiny("gpt")
    n = 16 - len(PROMPT)  # everything fits in one block
    greedy = generate(model, PROMPT, n)
    assert greedy == generate(model, PROMPT, n, use_cache=False)
    assert len(set(greedy)) > 2  # not one token repeated: the comparison is not trivial
    for seed in (0, 1, 2):
        kw = dict(method="top-k", top_k=4, seed=seed, temperature=1.5)
        assert generate(model, PROMPT, n, **kw) == generate(model, PROMPT, n, use_cache=False, **kw)


def test_gpt_generates_past_block_size():
    model = tiny("gpt")
    n = 3 * 16
    plain = generate(model, PROMPT, n, use_cache=False)
    # Without the cache every token is the argmax over the last block_size tokens.
    seq = list(PROMPT)
    for t in plain:
        assert t == model(torch.tensor([seq[-16:]]))[0][0, -1].argmax().item()
        seq.append(t)
    cached = generate(model, PROMPT, n)
    assert len(cached) == n and all(0 <= t < V for t in cached)
    assert cached[: 16 - len(PROMPT)] == plain[: 16 - len(PROMPT)]
    # A prompt longer than the block is cropped to its end, not refused.
    long_prompt = plain[:30]
    assert generate(model, long_prompt, 5) == generate(model, long_prompt[-16:], 5)
    assert len(generate(model, PROMPT, n, method="beam", beam_width=3)) == n
    assert len(generate(model, PROMPT, n, method="top-p", top_p=0.9, seed=0)) == n


@pytest.mark.parametrize("arch,kw", ARCHS)
def test_recurrent_carried_state_equals_running_whole_sequence(arch, kw):
    model = tiny(arch, **kw)
    n = 40  # recurrent models have no block limit
    greedy = generate(model, PROMPT, n)
    assert greedy == generate(model, PROMPT, n, use_cache=False)
    seq = list(PROMPT)
    for t in greedy[:10]:
        assert t == model(torch.tensor([seq]))[0][0, -1].argmax().item()
        seq.append(t)
    kw = dict(method="temperature", temperature=1.0, seed=7)
    assert generate(model, PROMPT, n, **kw) == generate(model, PROMPT, n, use_cache=False, **kw)


def test_top_k_never_picks_outside_the_k_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(50)
    top5 = set(logits.topk(5).indices.tolist())
    kept = filter_top_k(logits[None], 5)[0]
    assert set(torch.isfinite(kept).nonzero()[:, 0].tolist()) == top5
    g = torch.Generator().manual_seed(0)
    draws = next_token(logits.expand(4000, 50), "top-k", top_k=5, temperature=2.0, generator=g)[:, 0].tolist()
    assert set(draws) == top5  # all of them drawn, nothing else
    # Ties at the k-th value still keep exactly k.
    assert torch.isfinite(filter_top_k(torch.zeros(1, 10), 3)).sum() == 3


def test_top_p_picks_only_the_smallest_set_reaching_p():
    probs = torch.tensor([0.06, 0.5, 0.04, 0.1, 0.3])  # sorted: 1 (0.5), 4 (0.3), 3 (0.1), 0, 2
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    draw = lambda p: next_token(logits.expand(4000, 5), "top-p", top_p=p, generator=g)[:, 0]  # noqa: E731 (a one-line helper, named where it is used)
    d = draw(0.75)  # 0.5 < 0.75 <= 0.8
    assert set(d.tolist()) == {1, 4}
    assert (d == 1).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)  # renormalised
    assert set(draw(0.85).tolist()) == {1, 4, 3}
    assert set(draw(0.01).tolist()) == {1}  # always at least the most likely token
    assert set(draw(1.0).tolist()) == {0, 1, 2, 3, 4}
    kept = filter_top_p(logits[None], 0.75)[0]
    torch.testing.assert_close(kept[[1, 4]], logits[[1, 4]])


@pytest.mark.parametrize("arch", ["gpt", "lstm"])
def test_tiny_temperature_equals_greedy(arch):
    model = tiny(arch)
    greedy = generate(model, PROMPT, 12)
    for method in ("temperature", "top-k", "top-p"):
        for t in (1e-6, 0.0):
            assert generate(model, PROMPT, 12, method=method, temperature=t, top_k=5, top_p=0.9, seed=3) == greedy


def test_same_seed_same_text():
    model = tiny("gpt")
    kw = dict(method="top-p", top_p=0.95, temperature=1.5)
    a = generate(model, PROMPT, 12, seed=5, **kw)
    torch.manual_seed(123)  # the global RNG must not matter
    assert generate(model, PROMPT, 12, seed=5, **kw) == a
    assert generate(model, PROMPT, 12, seed=6, **kw) != a


@pytest.mark.parametrize("arch", ["gpt", "lstm"])
def test_beam_search(arch):
    model = tiny(arch, seed=1)
    n = 10
    greedy = generate(model, PROMPT, n)
    assert generate(model, PROMPT, n, method="beam", beam_width=1) == greedy
    beam = generate(model, PROMPT, n, method="beam", beam_width=4)
    assert len(beam) == n
    assert log_prob(model, PROMPT, beam) >= log_prob(model, PROMPT, greedy) - 1e-4
    assert generate(model, PROMPT, n, method="beam", beam_width=4, use_cache=False) == beam
    wide = generate(model, PROMPT, n, method="beam", beam_width=12)
    assert log_prob(model, PROMPT, wide) >= log_prob(model, PROMPT, beam) - 1e-4


class Bigram(torch.nn.Module):
    """A model whose next-token distribution is a fixed table row for the last token."""

    def __init__(self, table):
        super().__init__()
        self.logits = torch.nn.Parameter(table.log())
        self.config = model_config(arch="lstm", vocab_size=len(table))

    def forward(self, idx, targets=None, state=None):
        return self.logits[idx], None, state


def test_beam_search_finds_the_best_sequence_greedy_misses():
    # Greedy takes 1 (p=0.6) and then meets a flat row; 2 (p=0.4) leads to a sure 3, so [2, 3]
    # (0.4 * 0.97) beats greedy's [1, 2] (0.6 * 0.34).
    table = torch.full((5, 5), 0.01)
    table[0] = torch.tensor([0.0, 0.6, 0.4, 0.0, 0.0])
    table[1] = torch.tensor([0.02, 0.02, 0.34, 0.32, 0.30])
    table[2, 3] = 0.96
    model = Bigram(table + 1e-9)
    assert generate(model, [0], 2) == [1, 2]
    assert generate(model, [0], 2, method="beam", beam_width=2) == [2, 3]


def test_eos_stops_generation():
    model = tiny("gpt")
    greedy = generate(model, PROMPT, 10)
    eos = greedy[3]
    stop = greedy.index(eos)
    assert generate(model, PROMPT, 10, eos_id=eos) == greedy[:stop]
    beam = generate(model, PROMPT, 10, method="beam", beam_width=3, eos_id=eos)
    assert eos not in beam and len(beam) <= 10


def test_generate_restores_training_mode_and_turns_dropout_off():
    model = tiny("gpt", dropout=0.5).train()
    a = generate(model, PROMPT, 8)
    assert model.training
    assert generate(model, PROMPT, 8) == a == generate(model.eval(), PROMPT, 8)


def test_cached_generation_runs_on_one_thread_and_restores_the_count():
    model = tiny("gpt")
    seen = []

    class Spy(torch.nn.Module):
        def forward(self, x):
            seen.append(torch.get_num_threads())
            return x

    model.transformer.ln_f = torch.nn.Sequential(Spy(), model.transformer.ln_f)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cached = generate(model, PROMPT, 6)
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        assert generate(model, PROMPT, 6, use_cache=False) == cached
        assert set(seen) == {2}  # recomputing is big enough to share out: the caller's count
        with pytest.raises(UserError):
            generate(model, PROMPT, 6, method="top-k", top_k=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


needs_onednn = pytest.mark.skipif(not decode.available(), reason=f"no bf16 decoding here: {decode.unavailable()}")


@needs_onednn
@pytest.mark.parametrize("kw", [{}, {"positions": "sinusoidal", "bias": True}, {"attention": "explicit"}])
def test_bf16_decoding_follows_float32_within_bf16_rounding(kw):
    model = tiny("gpt", **kw)
    seq = PROMPT + [5, 9, 0, 7, 7, 2, 11, 3, 8, 1, 6, 12]
    full = model(torch.tensor([seq]))[0][0]  # float32, no cache: the reference
    decoder = decode.bf16_decoder(model)
    with torch.inference_mode():
        logits, _, state = decoder(torch.tensor([PROMPT]), state=decoder.new_state(1))
        steps = [logits[0, -1]]
        for t in seq[len(PROMPT) :]:  # the cached one-token steps (the flat path for SDPA)
            steps.append(decoder(torch.tensor([[t]]), state=state)[0][0, -1])
    got, want = torch.stack(steps), full[len(PROMPT) - 1 :]
    # bf16 keeps 8 bits of mantissa: each weight within 0.4%, each logit within a few percent of
    # the logits' spread, and the ranking of clear winners intact.
    assert (got - want).abs().max() < 0.03 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    greedy = generate(model, PROMPT, 12, dtype="bfloat16")
    assert greedy == generate(model, PROMPT, 12, dtype="float32") == generate(model, PROMPT, 12, use_cache=False)


@needs_onednn
def test_the_bf16_copy_is_built_once_and_again_after_training():
    model = tiny("gpt")
    first = decode.bf16_decoder(model)
    assert decode.bf16_decoder(model) is first
    before = generate(model, PROMPT, 10, dtype="bfloat16")
    model.load_state_dict(tiny("gpt", seed=5).state_dict())  # in place, as an optimizer step changes them
    assert decode.bf16_decoder(model) is not first
    after = generate(model, PROMPT, 10, dtype="bfloat16")
    assert after == generate(tiny("gpt", seed=5), PROMPT, 10, dtype="bfloat16") and after != before


def test_auto_decodes_small_models_in_float32_and_probes_large_ones_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLLM_CACHE_DIR", str(tmp_path))
    small = tiny("gpt")
    chosen = decode.decode_precision(small)
    assert chosen.dtype == "float32" and chosen.probe_ms is None
    assert decode.decode_precision(small, "bfloat16").dtype == ("bfloat16" if decode.available() else "float32")
    if not decode.available():  # a CPU with AVX2 alone: bf16 asked for decodes in float32, saying why
        assert decode.decode_precision(small, "bfloat16").reason == decode.unavailable()
    assert decode.decode_precision(tiny("lstm"), "bfloat16").dtype == "float32"  # a GPT's path only
    torch.manual_seed(0)
    large = build_model(model_config(arch="gpt", vocab_size=V, n_embd=384, n_layer=2, n_head=6, block_size=64))
    chosen = decode.decode_precision(large)  # 2 x 1.8M weights, 14 MB in float32
    if not (decode.available() and speed.fast_bf16()):
        assert chosen.dtype == "float32" and chosen.probe_ms is None
        return
    assert set(chosen.probe_ms) == {"float32", "bfloat16"}
    assert chosen.dtype == (
        "bfloat16" if chosen.probe_ms["bfloat16"] <= 0.9 * chosen.probe_ms["float32"] else "float32"
    )
    cache = json.loads((tmp_path / "speed.json").read_text())
    assert [e["value"] for e in cache.values()] == [chosen.probe_ms]
    monkeypatch.setattr(speed, "fast_bf16", lambda flags=None: False)
    assert decode.decode_precision(large).reason == "this CPU has neither AMX nor AVX512-BF16"


def test_bad_arguments_are_user_errors():
    model = tiny("gpt")
    for kw, words in [
        (dict(method="nucleus"), "unknown sampling method"),
        (dict(method="top-k"), "top_k"),
        (dict(method="top-p", top_p=1.5), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(dtype="float16"), "decoding dtype"),
    ]:
        with pytest.raises(UserError, match=words):
            generate(model, PROMPT, 4, **kw)
    with pytest.raises(UserError, match="empty"):
        generate(model, [], 4)
    with pytest.raises(UserError, match="outside the vocabulary"):
        generate(model, [V], 4)


TEXT = "the cat sat on the mat. "


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of a tiny LSTM that has learned TEXT by heart, saved as training saves it."""
    tokenizer = CharTokenizer(normalize=True)
    vocab = Vocab.build({ch: TEXT.count(ch) for ch in TEXT})
    cfg = RunConfig(
        model=model_config(arch="lstm", vocab_size=len(vocab), n_embd=16, hidden_size=48, n_layer=1, dropout=0.0)
    )
    torch.manual_seed(0)
    model = build_model(cfg.model)
    data = torch.tensor(vocab.encode(list(TEXT * 4)))
    x = torch.stack([data[s : s + 24] for s in range(len(TEXT))])
    y = torch.stack([data[s + 1 : s + 25] for s in range(len(TEXT))])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for _ in range(150):
        loss = model(x, y)[1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.set_num_threads(threads)
    url = str(tmp_path_factory.mktemp("ckpt") / "best.pt")
    save_checkpoint(
        url,
        {
            "model": model.state_dict(),
            "step": 150,
            "config": cfg.to_dict(),
            "vocab": vocab.to_json(),
            "vocab_digest": vocab.digest,
            "tokenizer": tokenizer.to_json(),
            "metrics": {"train_loss": loss.item()},
        },
    )
    return url


def test_sample_text_continues_the_prompt(checkpoint):
    loaded = load_checkpoint(checkpoint)
    assert sample_text(loaded, "the c", "greedy", max_new_tokens=18) == "the cat sat on the mat."
    assert sample_text(loaded, "on the ", "beam", max_new_tokens=8, beam_width=3) == "on the mat. the"
    text = sample_text(loaded, "the ", "top-p", max_new_tokens=30, top_p=0.9, seed=1)
    assert text.startswith("the ") and len(text) == 34 and set(text) <= set(TEXT)


def test_sample_text_names_characters_the_vocabulary_lacks(checkpoint):
    loaded = load_checkpoint(checkpoint)
    with pytest.raises(UserError) as e:
        sample_text(loaded, "The cat ate Q", "greedy", max_new_tokens=5)
    msg = str(e.value)
    assert "characters" in msg and "'T' 'Q'" in msg and "'c'" not in msg and "training corpus" in msg
    assert "\n" not in msg


def test_a_prompt_is_normalised_as_the_corpus_was(checkpoint):
    """The char tokenizer with normalize=true dropped ':', quotes and accents from the corpus and
    folded newlines and spaces: a prompt gets the same, so the model sees what it learned."""
    loaded = load_checkpoint(checkpoint)
    assert sample_text(loaded, "the:\n\n  'c'", "greedy", max_new_tokens=18) == "the cat sat on the mat."
    assert sample_text(loaded, "thé\r\nc", "greedy", max_new_tokens=0) == "th c"
    with pytest.raises(UserError, match="is empty once normalised as the model's corpus was"):
        sample_text(loaded, "«»", "greedy")


def test_cli_prints_continuation_and_repeats_with_a_seed(checkpoint, capsys):
    args = ["--checkpoint", checkpoint, "--prompt", "the c", "--max-new-tokens", "18"]
    assert main(args) == 0
    assert capsys.readouterr().out == "the cat sat on the mat.\n"
    sampled = args + ["--method", "top-k", "--top-k", "3", "--temperature", "2", "--seed", "4"]
    main(sampled)
    first = capsys.readouterr().out
    main(sampled)
    assert capsys.readouterr().out == first
    main(sampled + ["--no-cache"])
    assert capsys.readouterr().out == first


def test_cli_user_errors_exit_2_without_traceback(checkpoint, tmp_path, capsys):
    assert main(["--checkpoint", checkpoint, "--prompt", "Q?", "--method", "beam"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "'Q'" in err and err.count("\n") == 1
    # The module runs as a script too.
    r = prewarmed.run("mllm.sample", ["--checkpoint", str(tmp_path / "none.pt"), "--prompt", "the "])
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "none.pt" in r.stderr
    assert "Traceback" not in r.stderr
