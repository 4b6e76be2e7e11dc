"""The project's char, word and BPE tokenizers as Hugging Face `tokenizers` objects, with the
vocabulary's own ids and the tokenizer's normalisation, so text encodes to the ids the model
trained on with no mllm installed."""

from __future__ import annotations

import json
from typing import Any

from mllm import UserError
from mllm.data import text as mtext

SPECIALS = ("<unk>", "<pad>", "<bos>", "<eos>")


def _char_normalizer(normalize: bool):
    from tokenizers import Regex, normalizers

    if not normalize:
        return None
    kept = "".join("\\" + c if c in "-.?!;," else c for c in mtext._CHAR_KEPT)
    # CharTokenizer's order: drop every character it does not keep, newlines become spaces, then
    # each run of spaces becomes one.
    return normalizers.Sequence(
        [
            normalizers.Replace(Regex(f"[^{kept}\\n]"), ""),
            normalizers.Replace("\n", " "),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    )


def _char(tok: Any, vocab: Any):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    hf = Tokenizer(models.WordLevel(dict(vocab.stoi), unk_token="<unk>"))
    if (norm := _char_normalizer(tok.normalize)) is not None:
        hf.normalizer = norm
    # Every character its own token, newlines included.
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    hf.decoder = decoders.Fuse()
    return hf


def _word(tok: Any, vocab: Any):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    hf = Tokenizer(models.WordLevel(dict(vocab.stoi), unk_token="<unk>"))
    if tok.normalize:
        hf.normalizer = normalizers.Sequence([normalizers.Replace(Regex("<[bB][rR] />"), " "), normalizers.Lowercase()])
    # WordTokenizer's findall: runs of anything but whitespace and ' . , ( ) ! ? " ; :, and each of those alone.
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("['.,()!?\";:]"), behavior="isolated")]
    )
    # WordTokenizer.detokenize: words joined by spaces, none before . , ! ? ; : ) nor after (.
    steps = [decoders.Replace(Regex("^"), " "), decoders.Fuse()]
    steps += [decoders.Replace(f" {p}", p) for p in ".,!?;:)"] + [
        decoders.Replace("( ", "("),
        decoders.Strip(" ", 1, 0),
    ]
    hf.decoder = decoders.Sequence(steps)
    return hf


def _bpe(tok: Any, vocab: Any):
    from tokenizers import Tokenizer

    state = json.loads(tok.hf.to_str())
    pieces = set(state["model"]["vocab"])
    if lacking := sorted(pieces - set(vocab.stoi)):
        # A merge whose result the vocabulary lacks makes one <unk> in mllm; a BPE model cannot
        # say that (its merges need their results in the vocabulary), so it would differ.
        raise UserError(
            f"the model's vocabulary lacks {len(lacking)} of its BPE tokenizer's pieces "
            f"(e.g. {lacking[0]!r}; data.vocab.min_freq or max_size cut them): a Hugging Face "
            "tokenizer cannot encode them to <unk> as mllm does; export with --format onnx or gguf"
        )
    # The vocabulary's ids, <unk> and the specials beyond the BPE's own pieces included.
    state["model"]["vocab"] = dict(vocab.stoi)
    state["model"]["unk_token"] = "<unk>"
    state["added_tokens"] = []
    hf = Tokenizer.from_str(json.dumps(state))
    return hf


def hf_tokenizer(tok: Any, vocab: Any):
    """A `tokenizers.Tokenizer` that encodes as `tok` then `vocab` do, and decodes back."""
    from tokenizers import AddedToken

    kinds = {"char": _char, "word": _word, "bpe": _bpe}
    if tok.kind not in kinds:
        raise UserError(f"a {tok.kind} tokenizer has no Hugging Face form here: export with --format onnx")
    hf = kinds[tok.kind](tok, vocab)
    # Marked special so that decoding can skip them; mllm's tokenizers never produce them from text.
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS if t in vocab.stoi])
    return hf


def fast_tokenizer(tok: Any, vocab: Any):
    """The tokenizer as transformers' PreTrainedTokenizerFast, its special tokens named."""
    from transformers import PreTrainedTokenizerFast

    named = {f"{t[1:-1]}_token": t for t in SPECIALS if t in vocab.stoi}
    return PreTrainedTokenizerFast(
        tokenizer_object=hf_tokenizer(tok, vocab), clean_up_tokenization_spaces=False, **named
    )
