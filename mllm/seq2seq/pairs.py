"""Parallel text for sequence to sequence: TSV pairs, the numbers corpus, splits written as Parquet
with their vocabularies and tokenizers, and batches."""

from __future__ import annotations

import io
import random
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from mllm import UserError, storage
from mllm.config import DataConfig, TokenizerConfig
from mllm.data.text import Tokenizer, build_tokenizer, tokenizer_from_json
from mllm.data.vocab import UNK, Vocab
from mllm.runtime.epochs import EpochOrder
from mllm.seq2seq.model import BOS_ID, EOS_ID, PAD_ID, SPECIALS

SPLITS = ("train", "val", "test")


# ---------------------------------------------------------------------------------------------
# reading and making pairs


def parse_tsv(text: str) -> tuple[list[tuple[str, str]], int]:
    """(source, target) pairs of tab-separated lines and the count of bad lines (one column, an
    empty side). Columns after the second (Tatoeba/Anki's attribution) are ignored."""
    pairs, bad = [], 0
    for line in text.splitlines():
        cols = line.split("\t")
        if len(cols) < 2 or not cols[0].strip() or not cols[1].strip():
            bad += 1
            continue
        pairs.append((cols[0].strip(), cols[1].strip()))
    return pairs, bad


def read_tsv(url: str, name: str | None = None) -> tuple[list[tuple[str, str]], int]:
    """The pairs of a TSV file and its count of bad lines; `name` is how errors call the file
    (the source the user gave, when `url` is the pipeline's copy of it)."""
    name = name or url
    storage.require(url, "parallel text")
    try:
        text = storage.read_bytes(url).decode("utf-8-sig")
    except UnicodeDecodeError:
        raise UserError(f"{name} is not UTF-8 text: convert it to UTF-8 tab-separated pairs") from None
    pairs, bad = parse_tsv(text)
    if not pairs:
        raise UserError(
            f"{name} has no valid pair in {bad} lines: give lines of 'source<TAB>target' (a TSV of parallel text)"
        )
    return pairs, bad


def numbers_pairs(count: int, seed: int = 0, max_number: int = 9_999, language: str = "de") -> list[tuple[str, str]]:
    """`count` distinct numbers drawn with `seed`, as (English words, the same in `language`)."""
    try:
        from num2words import num2words
    except ImportError:
        raise UserError("the numbers corpus needs num2words: pip install 'mllm-pipeline[seq2seq]'") from None
    if count > max_number + 1:
        raise UserError(f"count {count} exceeds the {max_number + 1} numbers up to {max_number}: lower it")
    numbers = random.Random(seed).sample(range(max_number + 1), count)
    return [(num2words(n, lang="en"), num2words(n, lang=language)) for n in numbers]


def write_numbers_tsv(url: str, count: int, seed: int = 0, max_number: int = 9_999, language: str = "de") -> int:
    """The numbers corpus as a TSV file, so it goes through the same stages as any parallel text."""
    pairs = numbers_pairs(count, seed, max_number, language)
    storage.write_text(url, "".join(f"{s}\t{t}\n" for s, t in pairs))
    return len(pairs)


def split_pairs(
    pairs: list[tuple[str, str]], val_fraction: float, test_fraction: float = 0.0, seed: int = 1337
) -> dict[str, list[tuple[str, str]]]:
    """Shuffled pairs cut into train/val/test; every pair with the same source lands in one split,
    so a held-out source (one sentence with several translations) is never seen in training."""
    groups: dict[str, list[tuple[str, str]]] = {}
    for pair in pairs:
        groups.setdefault(pair[0], []).append(pair)
    sources = list(groups)
    random.Random(seed).shuffle(sources)
    n = len(pairs)
    want = {"test": round(test_fraction * n), "val": round(val_fraction * n)}
    out: dict[str, list[tuple[str, str]]] = {name: [] for name in SPLITS}
    i = 0
    for name in ("test", "val"):
        while len(out[name]) < want[name] and i < len(sources):
            out[name] += groups[sources[i]]
            i += 1
    for s in sources[i:]:
        out["train"] += groups[s]
    if not out["train"] or (val_fraction and not out["val"]):
        raise UserError(
            f"{n} pairs ({len(groups)} distinct sources) are too few to split "
            f"{val_fraction}/{test_fraction}: give more pairs or change the fractions"
        )
    return out


# ---------------------------------------------------------------------------------------------
# tokens and ids


def _tokenizer(cfg: TokenizerConfig, texts: list[str]) -> Tokenizer:
    return build_tokenizer(cfg, lambda: iter(texts))


def _vocab(counts: Counter, data: DataConfig) -> Vocab:
    return Vocab.build(counts, min_freq=data.vocab.min_freq, max_size=data.vocab.max_size, specials=SPECIALS)


def check_vocab(vocab: Vocab, what: str) -> Vocab:
    if vocab.itos[:4] != [UNK, *SPECIALS]:
        raise UserError(
            f"the {what} vocabulary does not start {UNK} {' '.join(SPECIALS)}: "
            "build it with mllm.seq2seq.pairs.prepare_pairs"
        )
    return vocab


def prepare_pairs(
    pairs: list[tuple[str, str]], data: DataConfig, out_url: str, max_src_len: int, max_tgt_len: int, bad_lines: int = 0
) -> dict:
    """Split, tokenize (data.tokenizer the source side, data.pairs.target_tokenizer the target),
    build the vocabularies on the training split, write ids; return the summary.

    Pairs whose sides exceed max_src_len / max_tgt_len tokens are dropped and counted.
    """
    if data.pairs is None:
        raise UserError("data.pairs is not set: parallel text needs a data.pairs section")
    cfg = data.pairs
    splits = split_pairs(pairs, data.split.val_fraction, data.split.test_fraction, data.split.seed)
    train = splits["train"]
    src_tok = _tokenizer(data.tokenizer, [s for s, _ in train])
    tgt_tok = _tokenizer(cfg.target_tokenizer, [t for _, t in train])
    tokens = {name: [(src_tok.split(s), tgt_tok.split(t)) for s, t in ps] for name, ps in splits.items()}
    src_counts = Counter(tok for s, _ in tokens["train"] for tok in s)
    tgt_counts = Counter(tok for _, t in tokens["train"] for tok in t)
    if cfg.shared_vocab:
        src_vocab = tgt_vocab = _vocab(src_counts + tgt_counts, data)
    else:
        src_vocab, tgt_vocab = _vocab(src_counts, data), _vocab(tgt_counts, data)
    summary = {
        "pairs": len(pairs),
        "bad_lines": bad_lines,
        "too_long": 0,
        "src_vocab_size": len(src_vocab),
        "tgt_vocab_size": len(tgt_vocab),
    }
    for name in SPLITS:
        keep = [i for i, (s, t) in enumerate(tokens[name]) if len(s) <= max_src_len and len(t) <= max_tgt_len]
        summary["too_long"] += len(tokens[name]) - len(keep)
        summary[f"{name}_pairs"] = len(keep)
        summary[f"{name}_src_tokens"] = sum(len(tokens[name][i][0]) for i in keep)
        summary[f"{name}_tgt_tokens"] = sum(len(tokens[name][i][1]) for i in keep)
        summary[f"{name}_tgt_bytes"] = sum(len(splits[name][i][1].encode()) for i in keep)
        table = pa.table(
            {
                "source": pa.array([splits[name][i][0] for i in keep], pa.string()),
                "target": pa.array([splits[name][i][1] for i in keep], pa.string()),
                "src_ids": pa.array([src_vocab.encode(tokens[name][i][0]) for i in keep], pa.list_(pa.int32())),
                "tgt_ids": pa.array([tgt_vocab.encode(tokens[name][i][1]) for i in keep], pa.list_(pa.int32())),
            }
        )
        with storage.atomic_open(storage.join(out_url, f"{name}.parquet")) as f:
            pq.write_table(table, f)
    if summary["train_pairs"] == 0:
        raise UserError(
            f"every training pair is longer than max_src_len {max_src_len} / max_tgt_len "
            f"{max_tgt_len} tokens: raise them"
        )
    src_vocab.save(storage.join(out_url, "src_vocab.json"))
    tgt_vocab.save(storage.join(out_url, "tgt_vocab.json"))
    storage.write_text(storage.join(out_url, "src_tokenizer.json"), src_tok.to_json())
    storage.write_text(storage.join(out_url, "tgt_tokenizer.json"), tgt_tok.to_json())
    storage.write_json(storage.join(out_url, "summary.json"), summary)
    return summary


@dataclass
class PairSplit:
    """One split: the texts and, per side, flat token ids with offsets (pair i is ids[off[i]:off[i+1]])."""

    source: list[str]
    target: list[str]
    src_ids: np.ndarray
    src_offsets: np.ndarray
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.source)

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]


def _flat(column: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    arr = column.combine_chunks()
    offsets = np.asarray(arr.offsets.to_numpy(), dtype=np.int64)
    values = np.asarray(arr.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    return values[offsets[0] : offsets[-1]], offsets - offsets[0]


def load_split(url: str) -> PairSplit:
    storage.require(url, "pairs split")
    try:
        table = pq.read_table(io.BytesIO(storage.read_bytes(url)))
        src, tgt = _flat(table["src_ids"]), _flat(table["tgt_ids"])
        return PairSplit(table["source"].to_pylist(), table["target"].to_pylist(), *src, *tgt)
    except (pa.ArrowException, KeyError) as e:
        raise UserError(f"{url} is not a pairs split ({e}): re-run prepare_pairs") from None


def load_side(folder: str, side: Literal["src", "tgt"]) -> tuple[Tokenizer, Vocab]:
    """The tokenizer and vocabulary prepare_pairs wrote for one side."""
    vocab = check_vocab(Vocab.load(storage.join(folder, f"{side}_vocab.json")), side)
    url = storage.join(folder, f"{side}_tokenizer.json")
    storage.require(url, f"{side} tokenizer")
    return tokenizer_from_json(storage.read_text(url), source=url), vocab


def vocab_sizes(folder: str) -> dict[str, int]:
    """{"src_vocab_size": ..., "tgt_vocab_size": ...}: the fields to set on Seq2SeqConfig."""
    s = storage.read_json(storage.join(folder, "summary.json"))
    return {"src_vocab_size": s["src_vocab_size"], "tgt_vocab_size": s["tgt_vocab_size"]}


# ---------------------------------------------------------------------------------------------
# batches


def make_batch(srcs: list, tgts: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """src [B, S] padded with <pad>; tgt_in = <bos> y padded with <pad>; tgt_out = y <eos> padded with -1."""
    B, S, T = len(srcs), max(len(s) for s in srcs), max(len(t) for t in tgts) + 1
    src = torch.full((B, max(S, 1)), PAD_ID, dtype=torch.long)
    tgt_in = torch.full((B, T), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((B, T), -1, dtype=torch.long)
    for b, (s, t) in enumerate(zip(srcs, tgts)):
        src[b, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        t = torch.as_tensor(t, dtype=torch.long)
        tgt_in[b, 0], tgt_in[b, 1 : len(t) + 1] = BOS_ID, t
        tgt_out[b, : len(t)], tgt_out[b, len(t)] = t, EOS_ID
    return src, tgt_in, tgt_out


def batch_of(split: PairSplit, index) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return make_batch([split.src(i) for i in index], [split.tgt(i) for i in index])


class PairBatches(EpochOrder):
    """Shuffled passes over the pairs, resumable exactly (see mllm.runtime.epochs.EpochOrder)."""

    def __init__(self, split: PairSplit, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        if len(split) == 0:
            raise UserError("the training split has no pairs: give more pairs or lower val_fraction")
        self.split = split
        super().__init__(len(split), batch_size, seed, rank, world_size)

    def next(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return batch_of(self.split, self.take())


def eval_batches(split: PairSplit, batch_size: int, limit: int | None = None):
    """The split in order (the first `limit` pairs), batch by batch: validation is the same every time."""
    n = len(split) if limit is None else min(limit, len(split))
    for start in range(0, n, batch_size):
        yield batch_of(split, range(start, min(start + batch_size, n)))


def read_pairs(data: DataConfig) -> tuple[list[tuple[str, str]], int]:
    """The pairs a config names: its TSV source, or the numbers corpus when it names none."""
    if data.source:
        return read_tsv(data.source)
    n = data.pairs.numbers
    return numbers_pairs(n.count, n.seed, n.max_number, n.language), 0
