"""What a training job reads when its data is token ids: the files its config's `paths` section names,
checked and loaded, each mistake one UserError that says how to fix it."""

from __future__ import annotations

import numpy as np

from mllm import UserError, storage
from mllm.config import RunConfig
from mllm.data.text import Tokenizer, build_tokenizer, tokenizer_from_json
from mllm.data.vocab import Vocab
from mllm.runtime.epochs import load_ids, load_offsets

Split = tuple[np.ndarray, "np.ndarray | None"]  # token ids, and where each paragraph starts in them


def load_token_inputs(cfg: RunConfig) -> tuple[RunConfig, Vocab, Tokenizer, Split, Split, dict]:
    """Token ids of the train and validation splits, their offsets when given, one vocabulary."""
    p = cfg.paths
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
        raise UserError(
            f"model.vocab_size {vocab_size} is below the vocabulary's {len(vocab)}: "
            "set it to 0 (taken from the vocabulary)"
        )
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": vocab_size})})
    splits = {}
    for what, url, offsets in (("train", p.train_ids, p.train_offsets), ("validation", p.val_ids, p.val_offsets)):
        ids = load_ids(url)
        top = int(ids.max()) if len(ids) else 0
        if top >= vocab_size:
            raise UserError(
                f"{what} ids at {url} hold id {top} but the vocabulary has {len(vocab)} tokens: "
                "they were made with another vocabulary; re-run the split stage"
            )
        splits[what] = (ids, load_offsets(offsets, len(ids)) if offsets else None)
    return cfg, vocab, tokenizer, splits["train"], splits["validation"], {}
