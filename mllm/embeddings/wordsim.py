"""Word vectors: WordSim-353, SimLex-999 and the Google analogies (read from gensim's installed wheel),
nearest neighbours, and export."""

from __future__ import annotations

import difflib
import importlib.resources
import math
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mllm import UserError, storage

SETS = {"wordsim353": "wordsim353.tsv", "simlex999": "simlex999.txt", "analogies": "questions-words.txt"}
HEADLINE = "wordsim353_spearman"  # higher is better; decides the champion
METRICS = (
    "wordsim353_spearman",
    "wordsim353_coverage",
    "simlex999_spearman",
    "simlex999_coverage",
    "analogy_accuracy",
    "analogy_coverage",
)  # what evaluate_embeddings returns


def eval_set_text(name: str) -> str:
    """Text of one of the evaluation sets gensim ships (gensim/test/test_data/)."""
    try:
        root = importlib.resources.files("gensim")
    except ModuleNotFoundError:
        raise UserError(
            "word-embedding evaluation reads its test sets from gensim, which is not "
            "installed: pip install 'mllm-pipeline[embeddings]'"
        ) from None
    path = root / "test" / "test_data" / SETS[name]
    if not path.is_file():
        raise UserError(f"this gensim has no test_data/{SETS[name]}: pip install 'gensim>=4.3'")
    return path.read_text(encoding="utf-8")


def load_pairs(name: str) -> list[tuple[str, str, float]]:
    """(word, word, human score) of "wordsim353" or "simlex999", lower-cased like the vocabulary."""
    pairs = []
    for line in eval_set_text(name).splitlines():
        if line.strip() and not line.startswith("#"):
            a, b, score = line.split("\t")[:3]
            pairs.append((a.lower(), b.lower(), float(score)))
    return pairs


def load_analogies() -> list[tuple[str, str, str, str, str]]:
    """(section, a, b, c, d) for "a is to b as c is to d", lower-cased."""
    out, section = [], ""
    for line in eval_set_text("analogies").splitlines():
        if line.startswith(":"):
            section = line[1:].strip()
        elif line.strip():
            a, b, c, d = line.lower().split()
            out.append((section, a, b, c, d))
    return out


def rank(x: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties given the mean of the ranks they span (scipy.stats.rankdata 'average')."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    # Each run of equal values gets the mean of its first and last rank.
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_x)) + 1]
    ends = np.r_[starts[1:], len(x)]
    mean = (starts + ends + 1) / 2.0
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(mean, ends - starts)
    return ranks


def spearman(x: Iterable[float], y: Iterable[float]) -> float:
    """Spearman's rho: Pearson's r of the ranks; nan with fewer than 2 pairs or a constant side."""
    rx, ry = rank(np.asarray(list(x))), rank(np.asarray(list(y)))
    if len(rx) < 2:
        return math.nan
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / denom if denom else math.nan


class WordVectors:
    """Tokens and their vectors; `exclude` (<unk> by default) is never an answer or neighbour."""

    def __init__(self, tokens: list[str], vectors: np.ndarray, exclude: Iterable[str] = ("<unk>",)):
        vectors = np.asarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or len(tokens) != len(vectors):
            raise ValueError(f"{len(tokens)} tokens need a [{len(tokens)}, D] matrix, got {vectors.shape}")
        self.tokens, self.vectors = list(tokens), vectors
        self.index = {t: i for i, t in enumerate(self.tokens)}
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.unit = vectors / np.maximum(norms, 1e-12)
        self.candidate = np.ones(len(tokens), dtype=bool)
        for t in exclude:
            if t in self.index:
                self.candidate[self.index[t]] = False

    def __contains__(self, word: str) -> bool:
        return word in self.index and self.candidate[self.index[word]]

    def similarity(self, a: str, b: str) -> float:
        return float(self.unit[self.index[a]] @ self.unit[self.index[b]])

    def neighbours(self, word: str, k: int = 10) -> list[tuple[str, float]]:
        i = self.index[word]
        sims = self.unit @ self.unit[i]
        sims[~self.candidate] = -np.inf
        sims[i] = -np.inf
        top = np.argsort(-sims, kind="stable")[:k]
        return [(self.tokens[j], float(sims[j])) for j in top if np.isfinite(sims[j])]

    def evaluate_pairs(self, pairs: list[tuple[str, str, float]]) -> dict[str, float]:
        used = [(a, b, s) for a, b, s in pairs if a in self and b in self]
        rho = spearman([s for *_, s in used], [self.similarity(a, b) for a, b, _ in used])
        return {"spearman": rho, "coverage": len(used) / len(pairs), "pairs": len(used)}

    def evaluate_analogies(self, questions: list[tuple[str, str, str, str, str]], block: int = 512) -> dict[str, float]:
        used = [q[1:] for q in questions if all(w in self for w in q[1:])]
        correct = 0
        for lo in range(0, len(used), block):
            q = np.array([[self.index[w] for w in row] for row in used[lo : lo + block]])
            target = self.unit[q[:, 1]] - self.unit[q[:, 0]] + self.unit[q[:, 2]]
            sims = target @ self.unit.T
            sims[:, ~self.candidate] = -np.inf
            rows = np.arange(len(q))[:, None]
            sims[rows, q[:, :3]] = -np.inf  # the question's own words are never the answer
            correct += int((sims.argmax(axis=1) == q[:, 3]).sum())
        accuracy = correct / len(used) if used else math.nan
        return {"accuracy": accuracy, "coverage": len(used) / len(questions), "questions": len(used)}


def evaluate_embeddings(vectors: WordVectors) -> dict[str, float]:
    """Every headline number, flat, for a metrics log: `<set>_<metric>`."""
    out = {}
    for name in ("wordsim353", "simlex999"):
        r = vectors.evaluate_pairs(load_pairs(name))
        out |= {f"{name}_spearman": r["spearman"], f"{name}_coverage": r["coverage"]}
    r = vectors.evaluate_analogies(load_analogies())
    out |= {"analogy_accuracy": r["accuracy"], "analogy_coverage": r["coverage"]}
    return out


@torch.no_grad()
def evaluate_loss(model, batches: Iterable[tuple], device: str | torch.device = "cpu") -> float:
    """Mean loss per sample over fixed batches (mllm.embeddings.cbow.CbowBatches.eval_batches of the
    validation paragraphs): the held-out CBOW loss."""
    was_training = model.training
    model.eval()
    total, n = 0.0, 0
    for batch in batches:
        _, loss, _ = model(*(t.to(device) for t in batch))
        total += loss.item() * len(batch[-1])
        n += len(batch[-1])
    model.train(was_training)
    if n == 0:
        raise UserError("the validation paragraphs hold no CBOW sample: raise the validation fraction")
    return total / n


def evaluate_cbow(
    model,
    tokens: list[str],
    val_batches: Iterable[tuple] | None = None,
    probes: Iterable[str] = (),
    k: int = 10,
    device: str | torch.device = "cpu",
) -> dict:
    """One eval of a CBOW model (mllm.embeddings.cbow.CBOW): {"metrics", "neighbours", "notes"}.

    metrics: the word-similarity and analogy scores of the input ("context") embedding, the usual
    word vectors, under their plain names (HEADLINE among them), the output ("centre") rows' under
    centre_<name>, and val_loss when `val_batches` are given. neighbours and notes: see
    neighbours_table, for both embeddings.
    """
    named = {
        "context": WordVectors(tokens, model.context_vectors().cpu().numpy()),
        "centre": WordVectors(tokens, model.centre_vectors().cpu().numpy()),
    }
    metrics = evaluate_embeddings(named["context"])
    metrics |= {f"centre_{name}": v for name, v in evaluate_embeddings(named["centre"]).items()}
    if val_batches is not None:
        metrics["val_loss"] = evaluate_loss(model, val_batches, device)
    rows, notes = neighbours_table(named, probes, k)
    return {"metrics": metrics, "neighbours": rows, "notes": notes}


def missing_word(word: str, tokens: Iterable[str]) -> str:
    """The one line that tells a user a probe word is not in the vocabulary."""
    close = difflib.get_close_matches(word, list(tokens), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{word!r} is not in the vocabulary{hint}"


def neighbours_table(named: dict[str, WordVectors], probes: Iterable[str], k: int = 10):
    """Nearest neighbours of each probe word in each embedding (e.g. {"context": .., "centre": ..}).

    Returns (rows of {probe, embedding, rank, neighbour, cosine}, notes): one note line per probe
    word not in the vocabulary.
    """
    rows, notes = [], []
    for word in probes:
        first = next(iter(named.values()))
        if word not in first:
            notes.append(missing_word(word, (t for t in first.tokens if t in first)))
            continue
        for name, vecs in named.items():
            for r, (token, cos) in enumerate(vecs.neighbours(word, k), start=1):
                rows.append({"probe": word, "embedding": name, "rank": r, "neighbour": token, "cosine": round(cos, 4)})
    return rows, notes


# -----------------------------------------------------------------------------
# export


def write_parquet(url: str, vectors: WordVectors) -> None:
    """Columns token (string) and vector (fixed-size list of float32)."""
    d = vectors.vectors.shape[1]
    flat = pa.array(vectors.vectors.reshape(-1), type=pa.float32())
    table = pa.table(
        {"token": pa.array(vectors.tokens, type=pa.string()), "vector": pa.FixedSizeListArray.from_arrays(flat, d)}
    )
    with storage.atomic_open(url, "wb") as f:
        pq.write_table(table, f)


def read_parquet(url: str) -> WordVectors:
    storage.require(url, "word vectors")
    fs, path = storage.filesystem(url)
    with fs.open(path, "rb") as f:
        table = pq.read_table(f)
    d = table.schema.field("vector").type.list_size
    flat = table.column("vector").combine_chunks().flatten().to_numpy()
    return WordVectors(table.column("token").to_pylist(), flat.reshape(-1, d))


def write_word2vec(url: str, vectors: WordVectors) -> None:
    """word2vec's text format ("V D", then "token x1 .. xD" a line), what gensim and fastText read."""
    bad = [t for t in vectors.tokens if not t or any(c.isspace() for c in t)]
    if bad:
        raise UserError(
            f"token {bad[0]!r} holds whitespace, which the word2vec text format cannot store: export as Parquet instead"
        )
    with storage.atomic_open(url, "wb") as f:
        f.write(f"{len(vectors.tokens)} {vectors.vectors.shape[1]}\n".encode())
        for token, row in zip(vectors.tokens, vectors.vectors):
            f.write((token + " " + " ".join(f"{x:.6g}" for x in row) + "\n").encode("utf-8"))
