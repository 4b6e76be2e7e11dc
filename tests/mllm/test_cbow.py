"""CBOW: tokenizer, paragraphs, paragraph-bound contexts, resumable batches, model, evaluation, export."""

from __future__ import annotations

import math
import random
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from pydantic import ValidationError

from mllm import UserError
from mllm.data.vocab import Vocab
from mllm.embeddings.cbow import (
    CBOW,
    PAD_ID,
    BasicEnglishTokenizer,
    CbowBatches,
    CbowConfig,
    basic_english,
    contexts,
    noise_distribution,
    paragraph_ids,
    sample_centres,
    split_by_paragraph,
    split_paragraphs,
)
from mllm.embeddings.wordsim import (
    HEADLINE,
    METRICS,
    WordVectors,
    evaluate_cbow,
    evaluate_loss,
    load_analogies,
    load_pairs,
    missing_word,
    neighbours_table,
    rank,
    read_parquet,
    spearman,
    write_parquet,
    write_word2vec,
)
from mllm.runtime.epochs import check_offsets, load_offsets, save_array

# -----------------------------------------------------------------------------
# basic_english: torchtext's rules, one special character at a time


@pytest.mark.parametrize(
    "text, tokens",
    [
        ("Hello World", ["hello", "world"]),
        ("it's", ["it", "'", "s"]),  # ' split off
        ('he said "yes" twice', ["he", "said", "yes", "twice"]),  # " removed
        ("end. next", ["end", ".", "next"]),
        ("a,b", ["a", ",", "b"]),
        ("(quietly)", ["(", "quietly", ")"]),
        ("stop!", ["stop", "!"]),
        ("why?no", ["why", "?", "no"]),
        ("one;two", ["one", "two"]),  # ; becomes a space
        ("time:now", ["time", "now"]),  # : becomes a space
        ("line<br />break", ["line", "break"]),  # <br /> becomes a space
        ("LINE<BR />Break", ["line", "break"]),  # after lower-casing, so it matches
        ("<br/>", ["<br/>"]),  # only the exact "<br />"
        ("tabs\tand\nnew  lines", ["tabs", "and", "new", "lines"]),
        ('Don\'t (really)! Said: "no"; ok?', ["don", "'", "t", "(", "really", ")", "!", "said", "no", "ok", "?"]),
        ("well-known 1812 naïve", ["well-known", "1812", "naïve"]),  # - and digits are word characters
        ("...", [".", ".", "."]),
        ("", []),
    ],
)
def test_basic_english_follows_torchtext_rules(text, tokens):
    assert basic_english(text) == tokens


def test_basic_english_keeps_case_without_normalize():
    assert BasicEnglishTokenizer(normalize=False).split("The Prince.") == ["The", "Prince", "."]


def test_paragraphs_are_blank_line_blocks_of_the_raw_text_for_any_chunking():
    text = 'First line\r\nstill first.\r\n\r\nSecond "one".\r\n   \r\n\r\n\tThird\rpara\r\r4th\n\n\n'
    want = ["First line\nstill first.", 'Second "one".', "\tThird\npara", "4th"]
    assert list(split_paragraphs([text])) == want
    rng = random.Random(0)
    for n in (1, 2, 3):
        assert list(split_paragraphs(text[i : i + n] for i in range(0, len(text), n))) == want
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), 6))
        assert list(split_paragraphs(text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)]))) == want
    assert list(split_paragraphs(["no newline at all"])) == ["no newline at all"]


def test_tokenizer_yields_one_token_list_per_paragraph():
    tok = BasicEnglishTokenizer()
    text = 'One, two.\n\n"\n\nThree\nfour!\n'
    assert list(tok.tokenize([text])) == [["one", ",", "two", "."], ["three", "four", "!"]]
    assert tok.kind == "basic_english" and '"kind": "basic_english"' in tok.to_json()


# -----------------------------------------------------------------------------
# contexts never cross a paragraph


def _corpus(lengths):
    """Ids 1..N, each position its own id, so a context id says where it came from."""
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    return np.arange(1, offsets[-1] + 1, dtype=np.int32), offsets


def test_contexts_stay_in_the_paragraph_and_are_shorter_at_its_edges():
    lengths = [1, 2, 3, 9, 5, 1, 12]
    ids, offsets = _corpus(lengths)
    C = 4
    centres = sample_centres(ids, offsets, C, skip_unk=False)
    ctx, mask = contexts(ids, offsets, centres, C, skip_unk=False)
    para_of = np.repeat(np.arange(len(lengths)), lengths)
    for p, row, m in zip(centres, ctx, mask):
        a, b = offsets[para_of[p]], offsets[para_of[p] + 1]
        want = [q + 1 for q in range(max(a, p - C), min(b, p + C + 1)) if q != p]
        assert sorted(row[m].tolist()) == want  # every in-paragraph neighbour within C, nothing else
        assert (row[~m] == PAD_ID).all()
    # One-word paragraphs have no context, so they make no sample.
    one_word = [offsets[i] for i, n in enumerate(lengths) if n == 1]
    assert not set(one_word) & set(centres.tolist())
    assert len(centres) == sum(n for n in lengths if n > 1)


def test_unknown_words_are_neither_centre_nor_context():
    ids = np.array([5, 0, 6, 7, 0], dtype=np.int32)
    offsets = np.array([0, 5])
    centres = sample_centres(ids, offsets, 2, skip_unk=True)
    assert centres.tolist() == [0, 2, 3]
    ctx, mask = contexts(ids, offsets, centres, 2, skip_unk=True)
    assert [sorted(r[m].tolist()) for r, m in zip(ctx, mask)] == [[6], [5, 7], [6]]


def test_paragraph_arrays_and_offsets():
    vocab = Vocab(["<unk>", "a", "b"])
    ids, offsets = paragraph_ids([["a", "b"], [], ["b", "zzz", "a"]], vocab)
    assert ids.tolist() == [1, 2, 2, 0, 1] and offsets.tolist() == [0, 2, 5]
    train, train_off, val, val_off = split_by_paragraph(ids, offsets, 0.5)
    assert train.tolist() == [1, 2] and train_off.tolist() == [0, 2]
    assert val.tolist() == [2, 0, 1] and val_off.tolist() == [0, 3]
    for bad in ([1, 5], [0, 3, 2, 5], [0, 4]):
        with pytest.raises(UserError, match="re-run the split stage"):
            check_offsets(np.array(bad), 5)


def test_offsets_round_trip_through_storage(tmp_path):
    url = str(tmp_path / "offsets.npy")
    save_array(url, np.array([0, 3, 7]))
    assert load_offsets(url, 7).tolist() == [0, 3, 7]
    with pytest.raises(UserError):
        load_offsets(url, 8)


# -----------------------------------------------------------------------------
# batches: epochs, noise words, exact resume


def _batches(**kw):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 30, size=2000).astype(np.int32)
    offsets = np.r_[0, np.sort(rng.choice(np.arange(1, 2000), 150, replace=False)), 2000]
    cfg = CbowConfig(vocab_size=30, objective="negative", n_negative=3, context=3)
    return CbowBatches.from_config(cfg, ids, offsets, batch_size=64, seed=7, **kw)


def test_batcher_resumes_exactly_across_epochs():
    a = _batches()
    for _ in range(a.batches_per_epoch - 2):
        a.next()
    state = a.state_dict()
    want = [a.next() for _ in range(5)]  # crosses into the next epoch
    b = _batches()
    b.load_state_dict(state, b.rng_state())
    for w, got in zip(want, (b.next() for _ in range(5))):
        assert all(torch.equal(x, y) for x, y in zip(w, got))
    assert b.epoch == pytest.approx(1 + 3 / b.batches_per_epoch)


def test_an_epoch_visits_every_sample_once_and_ranks_share_it():
    whole = _batches()
    seen = torch.cat([whole.next()[-1] for _ in range(whole.batches_per_epoch)])
    assert whole.position == (1, 0)
    assert sorted(seen.tolist()) == sorted(whole.ids[whole.centres].tolist())
    # Two ranks: as many batches each, together every sample (the last few twice, as padding).
    ranks = [_batches(rank=r, world_size=2) for r in range(2)]
    assert ranks[0].batches_per_epoch == ranks[1].batches_per_epoch
    shared = [t for r in ranks for _ in range(r.batches_per_epoch) for t in r.next()[-1].tolist()]
    assert len(shared) == 2 * ranks[0].per_rank < whole.num_samples + 2
    missing = Counter(seen.tolist()) - Counter(shared)
    assert not missing


def test_noise_follows_unigram_to_the_three_quarters():
    ids = np.array([1] * 16 + [2] * 1 + [0] * 50)
    p = noise_distribution(ids, 4, 0.75, skip_unk=True)
    assert p[0] == 0 and p[3] == 0 and p[1] / p[2] == pytest.approx(16**0.75)
    neg = _batches().next()[2]
    assert neg.shape == (64, 3) and neg.min() >= 1  # <unk> is never drawn


# -----------------------------------------------------------------------------
# the model


def test_max_norm_keeps_every_looked_up_row_inside_the_unit_ball():
    cfg = CbowConfig(vocab_size=50, n_embd=8)
    model = CBOW(cfg)
    with torch.no_grad():
        model.embedding.weight.mul_(5)
        model.embedding.weight[40:].mul_(0.01)  # some rows already inside the ball
    reference = nn.Embedding(50, 8, max_norm=1.0)
    reference.weight.data.copy_(model.embedding.weight)
    before = model.embedding.weight.detach().clone()
    ctx = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 41]])
    model(ctx, torch.ones_like(ctx, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.long), torch.tensor([8, 9]))
    reference(ctx)
    looked_up = ctx.unique()
    # The rows a lookup uses are exactly what torch's max_norm makes of them...
    torch.testing.assert_close(model.embedding.weight[looked_up], reference.weight[looked_up])
    assert (model.embedding.weight[looked_up].norm(dim=1) <= 1 + 1e-6).all()
    # ...every row is inside the ball (the same on every DDP rank), and short rows are untouched.
    assert (model.embedding.weight.norm(dim=1) <= 1 + 1e-6).all()
    assert torch.equal(model.embedding.weight[40:], before[40:])
    assert (model.context_vectors().norm(dim=1) <= 1 + 1e-6).all()


def test_padding_never_enters_the_mean():
    model = CBOW(CbowConfig(vocab_size=10, n_embd=4, max_norm=None))
    mask = torch.tensor([[True, True, False, False]])
    h1 = model.encode(torch.tensor([[3, 4, 0, 0]]), mask)
    h2 = model.encode(torch.tensor([[3, 4, 9, 8]]), mask)
    torch.testing.assert_close(h1, h2)
    torch.testing.assert_close(h1[0], model.embedding.weight[[3, 4]].mean(0))


def test_softmax_forward_is_cross_entropy_and_heldout_loss_averages_it():
    cfg = CbowConfig(vocab_size=30, n_embd=8, context=3)
    model = CBOW(cfg)
    batches = _batches().eval_batches(count=100)
    logits, loss, state = model(*batches[0])
    assert state is None and logits.shape == (len(batches[0][-1]), 30)
    torch.testing.assert_close(loss, nn.functional.cross_entropy(logits, batches[0][-1]))
    total = sum(model(*b)[1].item() * len(b[-1]) for b in batches)
    assert evaluate_loss(model, batches) == pytest.approx(total / 100, rel=1e-5)


def test_evaluate_cbow_reports_both_embeddings_and_the_heldout_loss():
    pytest.importorskip("gensim", reason="the embeddings extra (WordSim-353 and SimLex-999 ship in gensim)")
    tokens = ["<unk>", "tiger", "cat", "book", "paper", "love", "sex", "money", "cash"]
    model = CBOW(CbowConfig(vocab_size=len(tokens), n_embd=8, max_norm=None))
    ids, offsets = np.array([1, 2, 3, 4, 5, 6, 7, 8] * 4, dtype=np.int32), np.array([0, 8, 16, 24, 32])
    val = CbowBatches.from_config(model.config, ids, offsets, batch_size=10, seed=0).eval_batches()
    r = evaluate_cbow(model, tokens, val, probes=["cat", "tigers"], k=3)
    m = r["metrics"]
    want = WordVectors(tokens, model.embedding.weight.detach().numpy()).evaluate_pairs(load_pairs("wordsim353"))
    assert m["wordsim353_spearman"] == pytest.approx(want["spearman"]) and want["pairs"] >= 4
    assert set(METRICS) | {f"centre_{k}" for k in METRICS} | {"val_loss"} == set(m) and HEADLINE in METRICS
    assert m["val_loss"] == pytest.approx(evaluate_loss(model, val))
    assert {(row["embedding"], row["rank"]) for row in r["neighbours"]} == {
        (e, k) for e in ("context", "centre") for k in (1, 2, 3)
    }
    assert r["notes"] == ["'tigers' is not in the vocabulary; did you mean 'tiger'?"]


def test_negative_sampling_forward_has_no_logits():
    cfg = CbowConfig(vocab_size=30, n_embd=8, context=3, objective="negative", n_negative=3)
    logits, loss, _ = CBOW(cfg)(*_batches().next())
    assert logits is None and loss.item() > 0


def test_config_is_strict():
    with pytest.raises(ValidationError):
        CbowConfig(window=4)
    with pytest.raises(ValidationError):
        CbowConfig(objective="hierarchical")


TOPICS = {
    "animals": "cat dog horse cow sheep goat".split(),
    "numbers": "one two three four five six".split(),
    "colours": "red green blue yellow white black".split(),
}


@pytest.mark.parametrize("objective", ["softmax", "negative"])
def test_a_few_hundred_steps_make_related_words_neighbours(objective):
    # Each paragraph talks about one topic, with filler words common to all.
    rng = random.Random(0)
    paragraphs = []
    for _ in range(300):
        words = TOPICS[rng.choice(list(TOPICS))]
        paragraphs.append(
            [rng.choice(words) if rng.random() < 0.7 else rng.choice(["the", "and", "of"]) for _ in range(12)]
        )
    vocab = Vocab.build({t: 1 for p in paragraphs for t in p})
    ids, offsets = paragraph_ids(paragraphs, vocab)
    torch.manual_seed(0)
    cfg = CbowConfig(vocab_size=len(vocab), n_embd=16, context=2, objective=objective)
    batches = CbowBatches.from_config(cfg, ids, offsets, batch_size=128, seed=0)
    model = CBOW(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(300):
        _, loss, _ = model(*batches.next())
        opt.zero_grad()
        loss.backward()
        opt.step()
    vecs = WordVectors(vocab.itos, model.context_vectors().numpy())
    for words in TOPICS.values():
        for w in words:
            near = [t for t, _ in vecs.neighbours(w, k=3)]
            assert set(near) <= set(words), (w, near)


# -----------------------------------------------------------------------------
# evaluation and export


def test_spearman_matches_the_textbook_with_ties():
    assert rank([10, 20, 20, 5]).tolist() == [2, 3.5, 3.5, 1]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # Hand computed: ranks x (1, 2, 3, 4), y (1, 2.5, 2.5, 4): r = 4.5 / sqrt(5 * 4.5)
    assert spearman([1, 2, 3, 4], [1, 5, 5, 9]) == pytest.approx(4.5 / math.sqrt(5 * 4.5))
    assert math.isnan(spearman([1], [2]))


def _toy_vectors():
    e = np.eye(5)
    vectors = {
        "man": e[0],
        "woman": e[1],
        "king": (e[0] + e[2]) / 2**0.5,
        "queen": (e[1] + e[2]) / 2**0.5,
        "apple": e[3],
        "pear": e[3] + 0.2 * e[4],
        "<unk>": e[1] - e[0] + (e[0] + e[2]) / 2**0.5,
    }  # = king - man + woman
    return WordVectors(list(vectors), np.array(list(vectors.values())))


def test_pairs_evaluation_gives_the_known_spearman_and_coverage():
    vecs = _toy_vectors()
    # Cosines: apple/pear 0.98, king/queen 0.5, man/king 0.71, man/apple 0.
    pairs = [
        ("apple", "pear", 9.0),
        ("man", "king", 7.0),
        ("king", "queen", 5.0),
        ("man", "apple", 1.0),
        ("man", "zebra", 3.0),
        ("<unk>", "queen", 8.0),
    ]
    r = vecs.evaluate_pairs(pairs)
    assert r["spearman"] == pytest.approx(1.0) and r["pairs"] == 4 and r["coverage"] == pytest.approx(4 / 6)
    r = vecs.evaluate_pairs([(a, b, -s) for a, b, s in pairs])
    assert r["spearman"] == pytest.approx(-1.0)


def test_analogies_answer_3cosadd_without_the_question_words():
    vecs = _toy_vectors()
    questions = [
        ("family", "man", "king", "woman", "queen"),  # king - man + woman = queen
        ("family", "man", "woman", "king", "queen"),  # the same, the other way
        ("fruit", "man", "king", "apple", "pear"),  # wrong: royal apple is no pear...
        ("family", "man", "king", "woman", "zebra"),
    ]  # not covered
    r = vecs.evaluate_analogies(questions)
    assert r["questions"] == 3 and r["coverage"] == pytest.approx(3 / 4)
    # ...but with apple itself excluded, pear is the nearest word left: 3 of 3. Without the
    # exclusion "apple" (or "king") would win and the last two would fail.
    assert r["accuracy"] == pytest.approx(1.0)
    # <unk> is exactly king - man + woman, and the nearest word to queen, yet never an answer.
    assert vecs.neighbours("queen", 1)[0][0] != "<unk>"


def test_the_shipped_sets_load_from_gensim():
    pytest.importorskip("gensim", reason="the embeddings extra (WordSim-353 and SimLex-999 ship in gensim)")
    ws, sl, an = load_pairs("wordsim353"), load_pairs("simlex999"), load_analogies()
    assert (len(ws), len(sl), len(an)) == (353, 999, 19544)
    assert ws[0] == ("love", "sex", 6.77) and an[0] == (
        "capital-common-countries",
        "athens",
        "greece",
        "baghdad",
        "iraq",
    )


def test_missing_gensim_is_a_one_line_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "gensim", None)
    with pytest.raises(UserError, match=r"pip install 'mllm-pipeline\[embeddings\]'") as e:
        load_pairs("wordsim353")
    assert "\n" not in str(e.value)


def test_a_probe_word_not_in_the_vocabulary_gets_one_line_and_a_spelling():
    assert (
        missing_word("natasha", ["natásha", "pierre"]) == "'natasha' is not in the vocabulary; did you mean 'natásha'?"
    )
    assert missing_word("zzzz", ["natásha"]) == "'zzzz' is not in the vocabulary"
    vecs = _toy_vectors()
    rows, notes = neighbours_table({"context": vecs, "centre": vecs}, ["kings", "apple"], k=2)
    assert notes == ["'kings' is not in the vocabulary; did you mean 'king'?"]
    assert [(r["embedding"], r["neighbour"]) for r in rows] == [
        ("context", "pear"),
        ("context", "man"),
        ("centre", "pear"),
        ("centre", "man"),
    ]


def test_gensim_loads_the_exported_vectors(tmp_path):
    pytest.importorskip("gensim", reason="the embeddings extra (WordSim-353 and SimLex-999 ship in gensim)")
    from gensim.models import KeyedVectors

    rng = np.random.default_rng(0)
    vecs = WordVectors(["<unk>", "the", "natásha", "'", "."], rng.normal(size=(5, 7)).astype(np.float32))
    write_word2vec(str(tmp_path / "v.txt"), vecs)
    kv = KeyedVectors.load_word2vec_format(str(tmp_path / "v.txt"), binary=False)
    assert kv.index_to_key == vecs.tokens
    np.testing.assert_allclose(kv.vectors, vecs.vectors, rtol=1e-5)
    write_parquet(str(tmp_path / "v.parquet"), vecs)
    back = read_parquet(str(tmp_path / "v.parquet"))
    assert back.tokens == vecs.tokens and np.array_equal(back.vectors, vecs.vectors)
    with pytest.raises(UserError, match="Parquet"):
        write_word2vec(str(tmp_path / "bad.txt"), WordVectors(["a b"], np.zeros((1, 2))))


@pytest.mark.parametrize("name", ["cbow", "cbow-smoke"])
def test_the_draft_recipes_model_sections_are_valid(name):
    import yaml

    recipe = yaml.safe_load((Path(__file__).parents[2] / "mllm" / "recipes" / f"{name}.yaml").read_text())
    assert CbowConfig(**recipe["model"]).arch == "cbow"
    assert recipe["data"]["tokenizer"]["kind"] == BasicEnglishTokenizer.kind
