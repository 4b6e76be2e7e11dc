"""CBOW word embeddings: the `cbow` recipe (mllm) beside gensim's Word2Vec, in one run.

    python -m benchmarks.embeddings [--quick] [--threads N] [--recipe cbow]

Both learn from the same tokens: War and Peace without its Gutenberg header and licence, cut into
paragraphs (blank-line separated), tokenized by basic_english; the last 10% of the paragraphs
are held out for mllm's validation loss, and both train on the rest. Same window (context words
each side), dimension, minimum count and epochs; gensim is `Word2Vec(sg=0, cbow_mean=1)` with its
own defaults otherwise (negative=5, sample=1e-3, alpha 0.025 -> 0.0001), `workers` = CPUs.
Reported for each: training wall time, WordSim-353 and SimLex-999 Spearman with coverage, and
Google analogy accuracy (3CosAdd) with coverage; for mllm also the held-out loss and the
nearest neighbours of a few probe words in both of its embeddings.

`train_cbow` is this benchmark's own small loop (Adam, linear decay to 0, as the reference
trains CBOW); the pipeline trains through mllm.train. `pca_picture` draws the most frequent
words' vectors in 2-D (matplotlib is no mllm dependency, so it lives here, for tasks/ to reuse).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import yaml

from benchmarks.common import OUT, REPO, corpus, header, load, parse_args, save, table
from mllm.data.text import read_chunks, strip_gutenberg
from mllm.data.vocab import Vocab
from mllm.embeddings.cbow import (
    CBOW,
    CbowBatches,
    CbowConfig,
    basic_english,
    paragraph_ids,
    split_by_paragraph,
    split_paragraphs,
)
from mllm.embeddings.evaluation import pca_picture
from mllm.embeddings.wordsim import (
    METRICS,
    WordVectors,
    evaluate_cbow,
    evaluate_embeddings,
    load_analogies,
    load_pairs,
    write_parquet,
    write_word2vec,
)

PROBES = ["king", "war", "moscow", "mother", "horse", "happy", "said", "natasha", "frenchmen"]
VAL_FRACTION = 0.1


def train_cbow(cfg: CbowConfig, batches: CbowBatches, epochs: float, lr: float, log=print) -> tuple[CBOW, list]:
    """Adam from `lr` decaying linearly to 0 over `epochs` passes; returns the model and the mean
    training loss of each epoch."""
    torch.manual_seed(batches.seed)
    model = CBOW(cfg)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    steps = max(1, round(epochs * batches.batches_per_epoch))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / steps)
    per_epoch, losses = [], []
    for step in range(steps):
        _, loss, _ = model(*batches.next())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if batches.position[1] == 0 or step == steps - 1:
            per_epoch.append(float(np.mean(losses)))
            log(f"  epoch {len(per_epoch)}: mean training loss {per_epoch[-1]:.4f}", flush=True)
            losses = []
    return model, per_epoch


def softmax_estimate(
    cfg: CbowConfig, ids, offsets, batch_size: int, epochs: float, per_epoch: int, steps: int = 3
) -> dict:
    """What the reference's full softmax would cost here: a few timed Adam steps, scaled up."""
    full = cfg.model_copy(update={"objective": "softmax"})
    batches = CbowBatches.from_config(full, ids, offsets, batch_size, seed=0)
    model = CBOW(full)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps + 1):  # the first step warms up the allocator
        t0 = time.perf_counter()
        _, loss, _ = model(*batches.next())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
    seconds = float(np.mean(times[1:])) * per_epoch * epochs
    return {"model": f"mllm, full softmax (estimate from {steps} steps)", "seconds": seconds}


def recipe(name: str) -> dict:
    return yaml.safe_load((REPO / "mllm" / "recipes" / f"{name}.yaml").read_text())


def paragraphs_of(path: Path) -> list[list[str]]:
    chunks = strip_gutenberg(read_chunks(str(path)))
    return [t for t in (basic_english(p) for p in split_paragraphs(chunks)) if t]


def gensim_word2vec(paragraphs: list[list[str]], cfg, min_freq: int, epochs: int) -> tuple[dict, float, float]:
    """gensim's CBOW on the same paragraphs and settings: its row, and gensim's own WS-353 and
    analogy scores of its vectors."""
    import gensim
    from gensim.models import Word2Vec

    t0, c0 = time.perf_counter(), time.process_time()
    w2v = Word2Vec(
        sentences=paragraphs,
        vector_size=cfg.n_embd,
        window=cfg.context,
        min_count=min_freq,
        sg=0,
        cbow_mean=1,
        epochs=epochs,
        workers=os.cpu_count() or 1,
        seed=0,
    )
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    kv = w2v.wv
    gensim_vecs = WordVectors(list(kv.index_to_key), kv.vectors)
    row = {
        "model": "gensim Word2Vec(sg=0, cbow_mean=1)",
        "seconds": seconds,
        "cpu_seconds": cpu,
        **evaluate_embeddings(gensim_vecs),
    }
    # gensim's own scorer on its own vectors: our evaluation must agree with it.
    data = Path(gensim.__file__).parent / "test" / "test_data"
    ws_gensim = kv.evaluate_word_pairs(str(data / "wordsim353.tsv"))[1].statistic
    an_gensim = kv.evaluate_word_analogies(str(data / "questions-words.txt"))[0]
    return row, ws_gensim, an_gensim


def print_neighbours(neighbours: list[dict], notes: list[str]) -> None:
    print("\nnearest neighbours (mllm):")
    for word in dict.fromkeys(n["probe"] for n in neighbours):
        for name in ("context", "centre"):
            near = [n["neighbour"] for n in neighbours if n["probe"] == word and n["embedding"] == name]
            print(f"  {word:>10} {name:>7}: {', '.join(near)}")
    for note in notes:
        print(f"  {note}")


def write_vectors(itos: list[str], model) -> None:
    """The context vectors as Parquet and word2vec text (read back by gensim), and their PCA picture."""
    from gensim.models import KeyedVectors

    OUT.mkdir(parents=True, exist_ok=True)
    vectors = WordVectors(itos, model.context_vectors().numpy())
    write_parquet(str(OUT / "cbow_vectors.parquet"), vectors)
    write_word2vec(str(OUT / "cbow_vectors.txt"), vectors)
    loaded = KeyedVectors.load_word2vec_format(str(OUT / "cbow_vectors.txt"), binary=False)
    assert loaded.vectors.shape == vectors.vectors.shape
    pca_picture(vectors, OUT / "cbow_pca.png")


COLUMNS = [
    ("model", "model"),
    ("seconds", "train s"),
    ("cpu_seconds", "train CPU s"),
    ("train_loss", "last epoch loss"),
    ("val_loss", "val loss"),
    ("wordsim353_spearman", "WS-353 rho"),
    ("wordsim353_coverage", "WS-353 cov"),
    ("simlex999_spearman", "SimLex rho"),
    ("simlex999_coverage", "SimLex cov"),
    ("analogy_accuracy", "analogy acc"),
    ("analogy_coverage", "analogy cov"),
]


def train_ours(name: str, cfg, vocab, train: tuple, val: tuple, train_cfg: dict, epochs: int) -> tuple:
    """The recipe's CBOW trained and scored: a row for each of its two embeddings, the model, its
    evaluation report and its batches."""
    train_ids, train_off = train
    val_ids, val_off = val
    rows = []
    batches = CbowBatches.from_config(cfg, train_ids, train_off, train_cfg["batch_size"], seed=0)
    t0, c0 = time.perf_counter(), time.process_time()
    model, per_epoch = train_cbow(cfg, batches, epochs, train_cfg["lr"])
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    val_batches = CbowBatches.from_config(cfg, val_ids, val_off, train_cfg["batch_size"], seed=0)
    report = evaluate_cbow(model, vocab.itos, val_batches.eval_batches(), PROBES, k=8)
    m = report["metrics"]
    for which in ("context", "centre"):
        prefix = "" if which == "context" else "centre_"
        rows.append(
            {
                "model": f"mllm {name} ({which})",
                "seconds": seconds,
                "cpu_seconds": cpu,
                "train_loss": per_epoch[-1],
                "val_loss": m["val_loss"],
                **{k: m[prefix + k] for k in METRICS},
            }
        )
    return rows, model, report, batches


def main() -> None:
    args = parse_args(
        __doc__.splitlines()[0], lambda p: p.add_argument("--recipe", default="cbow", help="mllm/recipes/<name>.yaml")
    )
    path = corpus("warandpeace")
    try:
        import gensim
    except ImportError:
        print("skipped: gensim is not installed (pip install 'mllm-pipeline[embeddings]')")
        raise SystemExit(0) from None
    machine = header(f"embeddings: recipe {args.recipe} vs gensim {gensim.__version__} Word2Vec", args.quick)
    r = recipe(args.recipe)
    train_cfg, min_freq = r["train"], r["data"]["vocab"]["min_freq"]
    epochs = 1 if args.quick else train_cfg["epochs"]

    paragraphs = paragraphs_of(path)
    n_train = len(paragraphs) - max(1, round(len(paragraphs) * VAL_FRACTION))
    counts = Counter(t for p in paragraphs[:n_train] for t in p)
    vocab = Vocab.build(counts, min_freq=min_freq)
    ids, offsets = paragraph_ids(paragraphs, vocab)
    train_ids, train_off, val_ids, val_off = split_by_paragraph(ids, offsets, VAL_FRACTION)
    cfg = CbowConfig(**{**r["model"], "vocab_size": len(vocab)})
    print(
        f"{len(paragraphs):,} paragraphs, {len(ids):,} tokens, vocabulary {len(vocab):,} "
        f"(min count {min_freq}), {cfg.objective} objective, {epochs} epoch(s)\n",
        flush=True,
    )

    rows, model, report, batches = train_ours(
        args.recipe, cfg, vocab, (train_ids, train_off), (val_ids, val_off), train_cfg, epochs
    )
    if cfg.objective == "negative":
        rows.append(
            softmax_estimate(cfg, train_ids, train_off, train_cfg["batch_size"], epochs, batches.batches_per_epoch)
        )

    row, ws_gensim, an_gensim = gensim_word2vec(paragraphs[:n_train], cfg, min_freq, epochs)
    rows.append(row)

    print("\n" + table(rows, COLUMNS))
    print(
        f"\ngensim's own evaluate_word_pairs / evaluate_word_analogies on its vectors: "
        f"WS-353 rho {ws_gensim:.3f}, analogy accuracy {an_gensim:.3f}"
    )
    print(f"load average at the end: {load()}")

    neighbours, notes = report["neighbours"], report["notes"]
    print_neighbours(neighbours, notes)

    write_vectors(vocab.itos, model)
    save(
        "embeddings",
        {
            "machine": machine,
            "recipe": r,
            "epochs": epochs,
            "rows": rows,
            "gensim_own_scores": {"wordsim353": ws_gensim, "analogy": an_gensim},
            "vocab_size": len(vocab),
            "tokens": len(ids),
            "paragraphs": len(paragraphs),
            "sets": {
                "wordsim353": len(load_pairs("wordsim353")),
                "simlex999": len(load_pairs("simlex999")),
                "analogies": len(load_analogies()),
            },
            "neighbours": neighbours,
            "notes": notes,
            "loadavg_end": load(),
        },
    )


if __name__ == "__main__":
    main()
