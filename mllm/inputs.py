"""What a training job reads: the files its config's `paths` section names, checked and loaded.

A language model or CBOW run reads token ids (and CBOW's paragraph offsets), one vocabulary and
its tokenizer; a seq2seq run reads the pairs' Parquet splits and both sides' vocabularies and
tokenizers. Each mistake (a missing file, ids made with another vocabulary, a model narrower
than its vocabulary) is one UserError that says how to fix it.
"""

from __future__ import annotations

import numpy as np

from mllm import UserError, storage
from mllm.cbow import load_offsets
from mllm.config import CbowConfig, RunConfig, Seq2SeqConfig
from mllm.data import load_ids
from mllm.pairs import check_vocab as check_pair_vocab
from mllm.pairs import load_split
from mllm.text import Tokenizer, build_tokenizer, tokenizer_from_json
from mllm.vocab import Vocab

Split = tuple[np.ndarray, "np.ndarray | None"]  # token ids, and paragraph offsets (CBOW)


def load_inputs(cfg: RunConfig) -> tuple[RunConfig, Vocab, Tokenizer, Split, Split, dict]:
    """The config with its vocabulary sizes set, the vocabulary and tokenizer, the train and
    validation data, and what else a checkpoint must carry to be used alone."""
    p = cfg.paths
    if p is None:
        raise UserError("the config has no paths section: add paths with train_ids, val_ids, vocab and checkpoint_dir")
    if isinstance(cfg.model, Seq2SeqConfig):
        return _pair_inputs(cfg)
    storage.require(p.train_ids, "train ids (paths.train_ids)")
    storage.require(p.val_ids, "validation ids (paths.val_ids)")
    storage.require(p.vocab, "vocabulary (paths.vocab)")
    vocab = Vocab.load(p.vocab)
    if p.tokenizer:
        storage.require(p.tokenizer, "tokenizer (paths.tokenizer)")
        tokenizer = tokenizer_from_json(storage.read_text(p.tokenizer), p.tokenizer)
    elif cfg.data.tokenizer.kind == "bpe":
        raise UserError("a BPE run needs paths.tokenizer: the JSON of the tokenizer its ids were made with")
    else:
        tokenizer = build_tokenizer(cfg.data.tokenizer)
    vocab_size = cfg.model.vocab_size or len(vocab)
    if vocab_size < len(vocab):
        raise UserError(f"model.vocab_size {vocab_size} is below the vocabulary's {len(vocab)}: "
                        "set it to 0 (taken from the vocabulary)")
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab_size})})
    splits = {}
    for what, url, offsets in (("train", p.train_ids, p.train_offsets), ("validation", p.val_ids, p.val_offsets)):
        ids = load_ids(url)
        top = int(ids.max()) if len(ids) else 0
        if top >= vocab_size:
            raise UserError(f"{what} ids at {url} hold id {top} but the vocabulary has {len(vocab)} tokens: "
                            "they were made with another vocabulary; re-run the split stage")
        if isinstance(cfg.model, CbowConfig) and offsets is None:
            raise UserError(f"a CBOW run needs paths.{'train' if what == 'train' else 'val'}_offsets: the "
                            "paragraph offsets the split stage wrote beside the ids")
        splits[what] = (ids, load_offsets(offsets, len(ids)) if offsets else None)
    return cfg, vocab, tokenizer, splits["train"], splits["validation"], {}


def _side(vocab_url: str | None, tokenizer_url: str | None, side: str) -> tuple[Vocab, Tokenizer]:
    prefix = "src_" if side == "source" else ""
    if not vocab_url or not tokenizer_url:
        raise UserError(f"a seq2seq run needs paths.{prefix}vocab and paths.{prefix}tokenizer: the {side} side's "
                        "files that mllm.pairs.prepare_pairs wrote")
    storage.require(vocab_url, f"{side} vocabulary (paths.{prefix}vocab)")
    storage.require(tokenizer_url, f"{side} tokenizer (paths.{prefix}tokenizer)")
    vocab = check_pair_vocab(Vocab.load(vocab_url), side)
    return vocab, tokenizer_from_json(storage.read_text(tokenizer_url), tokenizer_url)


def _pair_inputs(cfg: RunConfig) -> tuple[RunConfig, Vocab, Tokenizer, Split, Split, dict]:
    """A seq2seq run's inputs: the pairs' Parquet splits and both sides' vocabularies."""
    p, m = cfg.paths, cfg.model
    vocab, tokenizer = _side(p.vocab, p.tokenizer, "target")
    src_vocab, src_tokenizer = _side(p.src_vocab, p.src_tokenizer, "source")
    sizes = {"src_vocab_size": m.src_vocab_size or len(src_vocab), "tgt_vocab_size": m.tgt_vocab_size or len(vocab)}
    for field, have in (("src_vocab_size", len(src_vocab)), ("tgt_vocab_size", len(vocab))):
        if sizes[field] < have:
            raise UserError(f"model.{field} {sizes[field]} is below the vocabulary's {have}: set it to 0 "
                            "(taken from the vocabulary)")
    cfg = cfg.model_copy(update={"model": m.model_copy(update=sizes)})
    splits = {}
    for what, url in (("train", p.train_ids), ("validation", p.val_ids)):
        split = load_split(url)
        for side, ids, size in (("source", split.src_ids, sizes["src_vocab_size"]),
                                ("target", split.tgt_ids, sizes["tgt_vocab_size"])):
            if len(ids) and int(ids.max()) >= size:
                raise UserError(f"{what} pairs at {url} hold {side} id {int(ids.max())} but the {side} vocabulary "
                                f"has {size} tokens: they were made with another vocabulary; prepare the pairs again")
        splits[what] = (split, None)
    if len(splits["validation"][0]) == 0:
        raise UserError(f"the validation pairs at {p.val_ids} are empty: give more pairs or raise data.split.val_fraction")
    return cfg, vocab, tokenizer, splits["train"], splits["validation"], {
        "src_vocab": src_vocab.to_json(), "src_tokenizer": src_tokenizer.to_json()}
