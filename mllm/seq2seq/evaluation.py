"""The sequence-to-sequence family's evaluation and samples: loss, exact match, BLEU and chrF on the
held-out pairs, a table of translations, attention heatmaps."""

from __future__ import annotations

import io
import textwrap
from typing import Any

import numpy as np
import torch

from mllm import UserError, storage
from mllm.runtime.checkpoint import Loaded
from mllm.seq2seq.pairs import PairSplit, eval_batches, load_split
from mllm.seq2seq.translate import decode, translate_texts
from mllm.seq2seq.translate import evaluate as score_pairs

HEATMAPS = 3  # held-out pairs drawn as attention pictures
# Whatever the run trained with: a run's own pairs and the champion's rescoring are decoded alike.
EVAL_BATCH = 256


def evaluate(loaded: Loaded, part: Any, cfg: Any, out: str) -> dict[str, Any]:
    """Scores of greedy translations of the held-out pairs, and `attention-<i>.png` under `out`."""
    split = load_split(part.parquet)
    if len(split) == 0:
        raise UserError(
            f"the held-out pairs at {part.parquet} are empty: give more pairs or raise the split's fraction"
        )
    report = score_pairs(
        loaded.model,
        split,
        loaded.tokenizer,
        loaded.vocab,
        method="greedy",
        batch_size=EVAL_BATCH,
        table_rows=10,
        bleu_tokenize=cfg.data.pairs.bleu_tokenize,
    )
    pictures = []
    src, _, _ = next(eval_batches(split, min(HEATMAPS, len(split))))
    for i, h in enumerate(decode(loaded.model, src.to(next(loaded.model.parameters()).device))):
        if not h.ids:  # an empty translation: no row to draw
            continue
        src_tokens = [loaded.src_tokenizer.detokenize([t]) for t in loaded.src_vocab.decode(split.src(i))]
        tgt_tokens = [loaded.tokenizer.detokenize([t]) for t in loaded.vocab.decode(h.ids)]
        png = io.BytesIO()
        plot_attention(
            src_tokens,
            tgt_tokens,
            h.attention,
            png,
            f"{cfg.recipe}: {split.source[i]}\n-> {loaded.tokenizer.detokenize(loaded.vocab.decode(h.ids))}",
        )
        name = f"attention-{i + 1}.png"
        storage.write_bytes(storage.join(out, name), png.getvalue())
        pictures.append(name)
    metrics = {
        "val_loss": report["loss"],
        "exact_match": report["exact_match"],
        "bleu": report["bleu"],
        "chrf": report["chrf"],
    }
    n_targets = int(sum(len(split.tgt(i)) + 1 for i in range(len(split))))  # each with its <eos>
    return {
        "metrics": metrics,
        "table": report["table"],
        "pairs": report["pairs"],
        "n_targets": n_targets,
        "pictures": pictures,
    }


def score_texts(loaded: Loaded, part: Any, bleu_tokenize: str) -> dict[str, float]:
    """Exact match, BLEU, chrF and loss of `loaded` on a split's texts, encoded with the
    checkpoint's own tokenizers and vocabularies (an unknown token becomes <unk>, a source longer
    than the model's max_src_len is cut), whatever ids the split itself holds."""
    split = load_split(part.parquet)
    m = loaded.config.model
    src = [loaded.src_vocab.encode(loaded.src_tokenizer.split(t))[: m.max_src_len] for t in split.source]
    tgt = [loaded.vocab.encode(loaded.tokenizer.split(t))[: m.max_tgt_len] for t in split.target]
    ours = PairSplit(split.source, split.target, *_flat(src), *_flat(tgt))
    report = score_pairs(
        loaded.model,
        ours,
        loaded.tokenizer,
        loaded.vocab,
        batch_size=EVAL_BATCH,
        table_rows=0,
        bleu_tokenize=bleu_tokenize,
    )
    return {
        "val_loss": report["loss"],
        "exact_match": report["exact_match"],
        "bleu": report["bleu"],
        "chrf": report["chrf"],
        "targets": int(sum(len(t) + 1 for t in tgt)),
    }


def _flat(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.asarray([i for s in seqs for i in s], dtype=np.int64),
        np.cumsum([0] + [len(s) for s in seqs], dtype=np.int64),
    )


def report(cfg: Any, checkpoint: str, steps: int, result: dict[str, Any]) -> str:
    m = result["metrics"]
    lines = [
        f"# Evaluation of {cfg.recipe} ({cfg.model.arch})",
        "",
        f"Checkpoint: `{checkpoint}` after {steps} steps. Greedy translations of the {result['pairs']} "
        "held-out pairs; headline chrF (higher is better).",
        "",
        "| measure | value |",
        "|---|---|",
        f"| validation loss (nats per target token, teacher forced) | {m['val_loss']:.4f} |",
        f"| exact match | {100 * m['exact_match']:.2f}% |",
        f"| BLEU (sacrebleu, tokenize {cfg.data.pairs.bleu_tokenize}) | {m['bleu']:.2f} |",
        f"| chrF (sacrebleu) | {m['chrf']:.2f} |",
        "",
        "| source | reference | greedy translation |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(r['source'])} | {_cell(r['reference'])} | {_cell(r['hypothesis'])} |" for r in result["table"]]
    lines += ["", "Attention of the first held-out pairs: " + ", ".join(f"`{p}`" for p in result["pictures"]), ""]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def translations(loaded: Loaded, prompts: list[str], method: str, s: Any) -> list[str]:
    return translate_texts(loaded, prompts, method, beam_width=s.beam_width, temperature=s.temperature, seed=s.seed)


def usable_prompts(loaded: Loaded, prompts: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The prompts whose tokens the source vocabulary holds, and for the others what it lacks."""
    ok, left_out = [], {}
    for p in prompts:
        missing = loaded.src_vocab.missing(loaded.src_tokenizer.split(p))
        if missing or not loaded.src_tokenizer.split(p):
            left_out[p] = missing
        else:
            ok.append(p)
    return ok, left_out


def plot_attention(src_tokens: list[str], tgt_tokens: list[str], weights, out, title: str = "") -> None:
    """A heatmap of attention weights [target, source] with the tokens on its axes, as PNG into
    `out` (a path or a binary file), as the Bahdanau paper draws them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(weights, torch.Tensor):
        weights = weights.numpy()
    width = max(5.0, 1.5 + 0.6 * len(src_tokens))
    fig, ax = plt.subplots(figsize=(width, max(3.0, 1.5 + 0.4 * len(tgt_tokens))))
    ax.imshow(weights, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(src_tokens)), src_tokens, rotation=60, ha="right")
    ax.set_yticks(range(len(tgt_tokens)), tgt_tokens)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    if title:
        # Wrapped to the figure's width (about 10 characters an inch at this size): a long
        # sentence would otherwise run off the picture.
        lines = [textwrap.fill(line, int(width * 10)) for line in title.splitlines()]
        ax.set_title("\n".join(lines), fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100, format="png")
    plt.close(fig)
