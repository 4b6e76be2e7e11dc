"""The word-embedding family's evaluation and samples: word-similarity and analogy scores,
held-out loss, the vectors exported (Parquet, word2vec text), a PCA picture, and nearest
neighbours."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np

from mllm import UserError, storage
from mllm.embeddings.cbow import CbowBatches
from mllm.embeddings.wordsim import HEADLINE, WordVectors, evaluate_cbow, missing_word, write_parquet, write_word2vec
from mllm.runtime.checkpoint import Loaded
from mllm.runtime.epochs import load_ids, load_offsets


def vectors(loaded: Loaded) -> WordVectors:
    """The input ("context") embedding: the word vectors word2vec users mean."""
    return WordVectors(loaded.vocab.itos, loaded.model.context_vectors().detach().cpu().numpy())


def evaluate(loaded: Loaded, part: Any, cfg: Any, out: str) -> dict[str, Any]:
    """Scores on the held-out paragraphs and the standard sets, with the vectors and a picture
    written under `out` (`vectors.parquet`, `vectors.w2v.txt`, `pca.png`)."""
    t = cfg.train
    ids = load_ids(part.ids)
    batches = CbowBatches.from_config(
        loaded.config.model, ids, load_offsets(part.offsets, len(ids)), t.batch_size, t.seed
    ).eval_batches(seed=t.seed)
    result = evaluate_cbow(loaded.model, loaded.vocab.itos, batches, probes=cfg.sample.probes, k=cfg.sample.neighbours)
    words = vectors(loaded)
    write_parquet(storage.join(out, "vectors.parquet"), words)
    write_word2vec(storage.join(out, "vectors.w2v.txt"), words)
    png = io.BytesIO()
    pca_picture(words, png, title=f"{cfg.recipe}: the 150 most frequent words, first two principal components")
    storage.write_bytes(storage.join(out, "pca.png"), png.getvalue())
    result["n_samples"] = int(sum(len(b[-1]) for b in batches))
    return result


def report(cfg: Any, checkpoint: str, steps: int, result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [
        ("WordSim-353 Spearman", "wordsim353"),
        ("SimLex-999 Spearman", "simlex999"),
        ("Google analogies, 3CosAdd accuracy", "analogy"),
    ]
    value = {"wordsim353": "spearman", "simlex999": "spearman", "analogy": "accuracy"}
    lines = [
        f"# Evaluation of {cfg.recipe} (CBOW word embeddings)",
        "",
        f"Checkpoint: `{checkpoint}` after {steps} steps. Headline: {HEADLINE} (higher is better).",
        "",
        "| measure | context embedding | centre embedding | coverage |",
        "|---|---|---|---|",
    ]
    for label, name in rows:
        key = f"{name}_{value[name]}"
        lines.append(
            f"| {label} | {m.get(key, float('nan')):.4f} | {m.get('centre_' + key, float('nan')):.4f} "
            f"| {m.get(name + '_coverage', float('nan')):.3f} |"
        )
    lines += [
        "",
        f"Held-out CBOW loss on the validation paragraphs: {m['val_loss']:.4f} ({result['n_samples']} centre words).",
        "",
        "",
    ]
    return "\n".join(lines) + neighbours_text(result)


def neighbours_text(result: dict[str, Any]) -> str:
    """The neighbours table as text: a line per probe word and embedding."""
    lines: dict[tuple[str, str], list[str]] = {}
    for row in result["neighbours"]:
        lines.setdefault((row["probe"], row["embedding"]), []).append(f"{row['neighbour']} {row['cosine']:.2f}")
    body = [f"{probe} ({embedding}): {', '.join(words)}" for (probe, embedding), words in lines.items()]
    return "\n".join(["## Nearest neighbours (cosine)", "", *body, *result["notes"], ""])


def neighbours_of(loaded: Loaded, words: list[str], k: int) -> list[str]:
    """A line per word: its k nearest neighbours in the context embedding. A word the vocabulary
    lacks is a UserError naming the nearest spelling it has."""
    vecs = vectors(loaded)
    for word in words:
        if word not in vecs:
            raise UserError(missing_word(word, (t for t in vecs.tokens if t in vecs)))
    return [f"{word}: " + ", ".join(f"{t} {c:.2f}" for t, c in vecs.neighbours(word, k)) for word in words]


def pca_picture(words: WordVectors, path: str | Path | io.BytesIO, n: int = 150, title: str = "") -> None:
    """The first `n` candidate tokens (the most frequent, in a Vocab's order) on their top two
    principal components, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no GUI

    rows = [i for i, t in enumerate(words.tokens) if t in words][:n]
    x = words.unit[rows] - words.unit[rows].mean(axis=0)
    _, _, vt = np.linalg.svd(x, full_matrices=False)
    xy = x @ vt[:2].T
    fig = Figure(figsize=(12, 12))
    ax = fig.subplots()
    ax.scatter(xy[:, 0], xy[:, 1], s=4, alpha=0.4)
    for (px, py), i in zip(xy, rows):
        ax.annotate(words.tokens[i], (px, py), fontsize=8)
    ax.set_title(title or f"{n} most frequent words, first two principal components")
    fig.savefig(path, format="png", dpi=100, bbox_inches="tight")
