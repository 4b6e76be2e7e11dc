"""Decoding and evaluation for sequence to sequence: greedy, beam search and sampling in batches,
every hypothesis with its attention weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from mllm import UserError
from mllm.seq2seq.model import BOS_ID, EOS_ID, PAD_ID
from mllm.seq2seq.pairs import PairSplit, eval_batches, make_batch

METHODS = ("greedy", "beam", "sample")


@dataclass
class Hypothesis:
    ids: list[int]  # target token ids, without <eos>
    score: float  # sum of log-probs, <eos> included (beam: / (tokens + 1) ** length_penalty)
    attention: np.ndarray  # [len(ids), source length without padding]


def _expand(memory: dict, k: int) -> dict:
    return {name: t.repeat_interleave(k, dim=0) for name, t in memory.items()}


def _src_lengths(src) -> list[int]:
    return (src != PAD_ID).sum(1).tolist()


def _log_probs(logits):
    # <pad> and <bos> are never outputs; the model only learns they are unlikely.
    never = torch.tensor([PAD_ID, BOS_ID], device=logits.device)
    return F.log_softmax(logits.float().index_fill(1, never, float("-inf")), dim=-1)


def _step_by_step(model, src, max_len, sample, temperature, generator) -> list[Hypothesis]:
    B = src.size(0)
    memory = model.encode(src)
    state = model.start(memory)
    token = torch.full((B,), BOS_ID, dtype=torch.long, device=src.device)
    done = torch.zeros(B, dtype=torch.bool, device=src.device)
    score = torch.zeros(B, device=src.device)
    tokens, weights = [], []
    for _ in range(max_len + 1):  # + 1: <eos> may follow max_len tokens
        logits, state, a = model.step(memory, state, token)
        logp = _log_probs(logits)
        if sample:
            token = torch.multinomial((logp / temperature).softmax(-1), 1, generator=generator).squeeze(1)
        else:
            token = logp.argmax(dim=-1)
        score += torch.where(done, 0.0, logp.gather(1, token[:, None]).squeeze(1))
        # Finished rows feed <pad>: masked in the transformer, ignored in the RNN's output.
        token = token.masked_fill(done, PAD_ID)
        tokens.append(token)
        weights.append(a)
        done |= token == EOS_ID
        if done.all():
            break
    tokens, weights = torch.stack(tokens, 1).tolist(), torch.stack(weights, 1).float().cpu().numpy()
    out = []
    for b, (row, S) in enumerate(zip(tokens, _src_lengths(src))):
        n = row.index(EOS_ID) if EOS_ID in row else max_len
        out.append(Hypothesis(row[:n], score[b].item(), weights[b, :n, :S]))
    return out


def _beam(model, src, max_len, K, alpha) -> list[Hypothesis]:
    """Batched beam search with an exact stop: a source is done once its best ended hypothesis
    beats anything a live beam can still reach. Log-probs only fall as a hypothesis grows, so a
    live beam's sum S bounds its future sums, and S / (max_len + 1) ** alpha its normalised
    score (S <= 0). With alpha 0 this stops as soon as the best candidate is <eos>, so width 1 is
    exactly greedy. (Stopping at K ended hypotheses instead, Hugging Face's early stopping, lets
    unlikely beams that end early crowd out the likely one still running.)"""
    B, S = src.shape
    dev = src.device
    memory = _expand(model.encode(src), K)
    state = model.start(memory)
    scores = torch.full((B, K), float("-inf"), device=dev)
    scores[:, 0] = 0.0  # one live beam at first, or the K copies would fill the beam with one prefix
    token = torch.full((B * K,), BOS_ID, dtype=torch.long, device=dev)
    hist = torch.zeros(B, K, 0, dtype=torch.long, device=dev)
    att = torch.zeros(B, K, 0, S, device=dev)
    finished: list[list[tuple[float, list[int], np.ndarray]]] = [[] for _ in range(B)]
    best = [float("-inf")] * B  # best normalised score of an ended hypothesis
    done = [False] * B
    rows = torch.arange(B, device=dev)[:, None]
    for t in range(max_len + 1):
        logits, state, a = model.step(memory, state, token)
        logp = _log_probs(logits)
        V = logp.size(-1)
        top, flat = (scores[:, :, None] + logp.view(B, K, V)).view(B, -1).topk(min(2 * K, K * V), dim=1)
        parent, tok = flat // V, flat % V
        is_eos = tok == EOS_ID
        for b, r in is_eos[:, :K].nonzero().tolist():
            if not done[b] and math.isfinite(top[b, r].item()):
                p, score = parent[b, r].item(), top[b, r].item() / (t + 1) ** alpha
                finished[b].append((score, hist[b, p].tolist(), att[b, p].float().cpu().numpy()))
                best[b] = max(best[b], score)
        # The live beams: the K best-ranked candidates that did not end.
        keep = (is_eos.long() * 2 * K + torch.arange(top.size(1), device=dev)).argsort(dim=1)[:, :K]
        scores, parent, tok = top.gather(1, keep), parent.gather(1, keep), tok.gather(1, keep)
        scores = scores.masked_fill(is_eos.gather(1, keep), float("-inf"))  # fewer than K alive
        reach = scores.max(dim=1).values / ((max_len + 1) ** alpha if alpha > 0 else 1.0)
        done = [d or best[b] >= reach[b].item() for b, d in enumerate(done)]
        if all(done):
            break
        state = model.reorder(state, (rows * K + parent).view(-1))
        hist = torch.cat([hist[rows, parent], tok[:, :, None]], dim=2)
        att = torch.cat([att[rows, parent], a.view(B, K, S)[rows, parent][:, :, None]], dim=2)
        token = tok.view(-1)
    out = []
    for b, n in enumerate(_src_lengths(src)):
        hyps = finished[b]
        if not done[b]:  # out of steps: the live beams compete too, cut at max_len
            hyps = hyps + [
                (
                    scores[b, k].item() / max(hist.size(2), 1) ** alpha,
                    hist[b, k].tolist(),
                    att[b, k].float().cpu().numpy(),
                )
                for k in range(K)
                if math.isfinite(scores[b, k].item())
            ]
        score, ids, w = max(hyps, key=lambda h: h[0])
        out.append(Hypothesis(ids[:max_len], score, w[:max_len, :n]))
    return out


@torch.no_grad()
def decode(
    model,
    src,
    method: str = "greedy",
    max_len: int | None = None,
    beam_width: int = 4,
    length_penalty: float = 1.0,
    temperature: float = 1.0,
    seed: int | None = None,
) -> list[Hypothesis]:
    """One hypothesis per row of src [B, S] (padded with <pad>).

    beam: the best hypothesis by sum of log-probs / length ** length_penalty (0: plain sums, which
    favour short outputs). sample: tokens drawn from softmax(logits / temperature), seeded.
    """
    if method not in METHODS:
        raise UserError(f"unknown decoding method {method!r}: choose one of {', '.join(METHODS)}")
    if method == "beam" and beam_width < 1:
        raise UserError(f"beam_width is {beam_width}: give 1 or more")
    if method == "beam" and length_penalty < 0:
        raise UserError(f"length_penalty is {length_penalty}: give 0 (plain sums) or more")
    if method == "sample" and temperature <= 0:
        raise UserError(f"temperature is {temperature}: give a value > 0, or use greedy")
    max_len = model.config.max_tgt_len if max_len is None else max_len
    was_training = model.training
    model.eval()
    try:
        if method == "beam":
            return _beam(model, src, max_len, beam_width, length_penalty)
        gen = torch.Generator(device=src.device).manual_seed(seed) if seed is not None else None
        return _step_by_step(model, src, max_len, method == "sample", temperature, gen)
    finally:
        model.train(was_training)


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def validation_loss(model, split: PairSplit, batch_size: int = 128, limit: int | None = None) -> float:
    """Teacher-forced cross-entropy per target token (<eos> included), over the split's first pairs."""
    was_training, total, count = model.training, 0.0, 0
    model.eval()
    try:
        for src, tgt_in, tgt_out in eval_batches(split, batch_size, limit):
            dev = _device(model)
            logits, _, _ = model(src.to(dev), tgt_in.to(dev), None)
            tgt_out = tgt_out.to(dev)
            total += F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), tgt_out.reshape(-1), ignore_index=-1, reduction="sum"
            ).item()
            count += (tgt_out != -1).sum().item()
    finally:
        model.train(was_training)
    return total / max(count, 1)


def _sacrebleu():
    try:
        import sacrebleu
    except ImportError:
        raise UserError("BLEU and chrF need sacrebleu: pip install 'mllm-pipeline[seq2seq]'") from None
    return sacrebleu


def scores(hypotheses: list[str], references: list[str], bleu_tokenize: str = "13a") -> dict[str, float]:
    """Exact match (a fraction), corpus BLEU and chrF (sacrebleu, 0-100).

    bleu_tokenize is sacrebleu's: "13a" (words, the WMT default) or "char", for targets of one
    word (German numbers), where word 4-grams do not exist and word BLEU is 0 whatever the output.
    """
    sb = _sacrebleu()
    exact = sum(h == r for h, r in zip(hypotheses, references)) / max(len(references), 1)
    try:
        bleu = sb.corpus_bleu(hypotheses, [references], tokenize=bleu_tokenize).score
    except (KeyError, ValueError, AttributeError):
        raise UserError(f"unknown BLEU tokenization {bleu_tokenize!r}: use 13a, char, intl or none") from None
    return {"exact_match": exact, "bleu": bleu, "chrf": sb.corpus_chrf(hypotheses, [references]).score}


def evaluate(
    model,
    split: PairSplit,
    tgt_tokenizer,
    tgt_vocab,
    method: str = "greedy",
    beam_width: int = 4,
    batch_size: int = 128,
    limit: int | None = None,
    table_rows: int = 5,
    bleu_tokenize: str = "13a",
    **decode_kw,
) -> dict:
    """Validation loss, exact match, BLEU and chrF of decoded hypotheses on the split's first pairs,
    and a table of (source, reference, hypothesis) for the first `table_rows`.

    References go through the target tokenizer and back, so that what the tokenizer normalises
    (lower case, dropped characters) does not count as an error.
    """
    n = len(split) if limit is None else min(limit, len(split))
    dev = _device(model)
    refs = [tgt_tokenizer.detokenize(tgt_tokenizer.split(t)) for t in split.target[:n]]
    hyps = []
    for src, _, _ in eval_batches(split, batch_size, n):
        for h in decode(model, src.to(dev), method, beam_width=beam_width, **decode_kw):
            hyps.append(tgt_tokenizer.detokenize(tgt_vocab.decode(h.ids)))
    report = {"loss": validation_loss(model, split, batch_size, n), "pairs": n, **scores(hyps, refs, bleu_tokenize)}
    report["table"] = [
        {"source": s, "reference": r, "hypothesis": h} for s, r, h in zip(split.source[:table_rows], refs, hyps)
    ]
    return report


def encode_sources(texts: list[str], src_tokenizer, src_vocab, max_src_len: int | None = None) -> list[list[str]]:
    """Source tokens of each text; a token outside the source vocabulary is a UserError naming it."""
    tokens = [src_tokenizer.split(t) for t in texts]
    missing = src_vocab.missing(tok for ts in tokens for tok in ts)
    if missing:
        shown = " ".join(repr(t) for t in missing[:20]) + (" ..." if len(missing) > 20 else "")
        raise UserError(f"the input has tokens the source vocabulary lacks: {shown}; leave them out or rephrase")
    if empty := [t for t, ts in zip(texts, tokens) if not ts]:
        raise UserError(f"input {empty[0]!r} has no tokens: give text to translate")
    if max_src_len and (long := [t for t, ts in zip(texts, tokens) if len(ts) > max_src_len]):
        raise UserError(f"input {long[0][:40]!r} is longer than max_src_len {max_src_len} tokens: shorten it")
    return tokens


def translate(
    model, texts: list[str], src_tokenizer, src_vocab, tgt_tokenizer, tgt_vocab, method: str = "greedy", **decode_kw
) -> list[tuple[list[str], list[str], str, np.ndarray]]:
    """(source tokens, target tokens, translation, attention [target, source]) for each text.

    Tokens come as text (a byte-level BPE piece "fÃ¼nf" as "fünf"), to label attention pictures.
    """
    tokens = encode_sources(texts, src_tokenizer, src_vocab, model.config.max_src_len)
    src, _, _ = make_batch([src_vocab.encode(ts) for ts in tokens], [[] for _ in texts])
    out = []
    for ts, h in zip(tokens, decode(model, src.to(_device(model)), method, **decode_kw)):
        tgt_tokens = tgt_vocab.decode(h.ids)
        out.append(
            (
                [src_tokenizer.detokenize([t]) for t in ts],
                [tgt_tokenizer.detokenize([t]) for t in tgt_tokens],
                tgt_tokenizer.detokenize(tgt_tokens),
                h.attention,
            )
        )
    return out


# The sample section's method names, and what decode calls them.
SAMPLE_METHODS = {"greedy": "greedy", "beam": "beam", "temperature": "sample"}


def translate_texts(
    loaded,
    texts: list[str],
    method: str | None = None,
    beam_width: int | None = None,
    temperature: float | None = None,
    seed: int | None = None,
    **_ignored,
) -> list[str]:
    """Translations of `texts` by a loaded seq2seq checkpoint (mllm.runtime.checkpoint.Loaded).

    `method` is a sample-section name (greedy, beam, temperature); what is left unset takes the
    run's own sample section. Options of the language models' sampling (top_k, ...) are ignored.
    """
    if loaded.src_vocab is None or loaded.src_tokenizer is None:
        raise UserError("this checkpoint is not a sequence-to-sequence model: it has no source vocabulary")
    s = loaded.config.sample
    method = method or s.methods[0]
    if method not in SAMPLE_METHODS:
        raise UserError(f"a seq2seq model translates with {', '.join(SAMPLE_METHODS)}, not {method!r}")
    out = translate(
        loaded.model,
        texts,
        loaded.src_tokenizer,
        loaded.src_vocab,
        loaded.tokenizer,
        loaded.vocab,
        SAMPLE_METHODS[method],
        beam_width=beam_width or s.beam_width,
        temperature=temperature or s.temperature,
        seed=s.seed if seed is None else seed,
    )
    return [text for _, _, text, _ in out]
