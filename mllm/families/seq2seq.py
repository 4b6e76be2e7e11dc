"""The sequence-to-sequence family as every stage sees it (its `Family`): config sections,
parallel-text data, batches, evaluation, translations. Its models live in `mllm/seq2seq/`."""

from __future__ import annotations

from typing import Any

from mllm import UserError, storage
from mllm.config import Seq2SeqConfig
from mllm.data.text import Tokenizer, tokenizer_from_json
from mllm.data.vocab import Vocab
from mllm.families.base import Evaluation, Family, Samples, option, register


@register
class SequenceToSequence(Family):
    name = "sequence-to-sequence"
    sections = (Seq2SeqConfig,)
    data = "pairs"
    headline = "chrf"
    higher_is_better = True
    methods = ("greedy", "beam", "temperature")
    extra = "seq2seq"  # sacrebleu (BLEU, chrF), num2words (the numbers corpus)

    def check(self, cfg: Any) -> None:
        d = cfg.data
        if d.pairs is None:
            raise ValueError(
                f"model.arch {cfg.model.arch} learns from pairs: add a data.pairs section (see recipe seq2seq-smoke)"
            )
        if not d.source and d.pairs.numbers is None:
            raise ValueError(
                "no parallel text: set data.source to a TSV file of pairs, or data.pairs.numbers for the numbers corpus"
            )
        if d.source and d.pairs.numbers is not None:
            raise ValueError(
                "data.source and data.pairs.numbers are both set: give one (a TSV file of pairs, or the numbers corpus)"
            )
        if bad := [m for m in cfg.sample.methods if m not in self.methods]:
            raise ValueError(
                f"sample.methods {', '.join(bad)}: a seq2seq model translates with greedy, beam or temperature"
            )
        for side, tok in (("data.tokenizer", d.tokenizer), ("data.pairs.target_tokenizer", d.pairs.target_tokenizer)):
            if tok.kind == "basic_english":
                raise ValueError(f"{side}.kind basic_english is for CBOW paragraphs: use char, word or bpe")

    def size(self, m: Any) -> str:
        # As the language models' sizes read: an RNN's encoder layers x hidden size (n_embd is
        # only its embedding); a transformer's encoder+decoder layers x heads x width.
        if m.arch == "seq2seq-rnn":
            return f"{m.n_layer}x{m.hidden_size}"
        return f"{m.n_layer}+{m.n_layer}x{m.n_head}x{m.n_embd}"

    def check_source(self, cfg: Any) -> None:
        from mllm.seq2seq.pairs import read_tsv

        path = cfg.data.source.removeprefix("file://")
        with open(path, "rb") as f:
            compressed = f.read(4).startswith((b"\x1f\x8b", b"BZh", b"\xfd7zX", b"\x28\xb5\x2f\xfd"))
        if not compressed:  # (a compressed file is read once decompressed, by the pairs stage)
            read_tsv(path, name=cfg.data.source)

    def tokens(self, data: Any) -> str:
        return f"{data.tokenizer.kind} -> {data.pairs.target_tokenizer.kind}"

    def build_model(self, m: Any):
        from mllm.seq2seq.model import build_seq2seq

        return build_seq2seq(m)

    def load_inputs(self, cfg: Any) -> tuple:
        """The pairs' Parquet splits and both sides' vocabularies and tokenizers."""
        from mllm.seq2seq.pairs import load_split

        p, m = cfg.paths, cfg.model
        vocab, tokenizer = _side(p.vocab, p.tokenizer, "target")
        src_vocab, src_tokenizer = _side(p.src_vocab, p.src_tokenizer, "source")
        sizes = {"src_vocab_size": m.src_vocab_size or len(src_vocab), "tgt_vocab_size": m.tgt_vocab_size or len(vocab)}
        for name, have in (("src_vocab_size", len(src_vocab)), ("tgt_vocab_size", len(vocab))):
            if sizes[name] < have:
                raise UserError(
                    f"model.{name} {sizes[name]} is below the vocabulary's {have}: set it to 0 "
                    "(taken from the vocabulary)"
                )
        cfg = cfg.model_copy(update={"model": m.model_copy(update=sizes)})
        splits = {}
        for what, url in (("train", p.train_ids), ("validation", p.val_ids)):
            split = load_split(url)
            for side, ids, size in (
                ("source", split.src_ids, sizes["src_vocab_size"]),
                ("target", split.tgt_ids, sizes["tgt_vocab_size"]),
            ):
                if len(ids) and int(ids.max()) >= size:
                    raise UserError(
                        f"{what} pairs at {url} hold {side} id {int(ids.max())} but the {side} "
                        f"vocabulary has {size} tokens: they were made with another vocabulary; "
                        "prepare the pairs again"
                    )
            splits[what] = (split, None)
        if len(splits["validation"][0]) == 0:
            raise UserError(
                f"the validation pairs at {p.val_ids} are empty: give more pairs or raise data.split.val_fraction"
            )
        return (
            cfg,
            vocab,
            tokenizer,
            splits["train"],
            splits["validation"],
            {"src_vocab": src_vocab.to_json(), "src_tokenizer": src_tokenizer.to_json()},
        )

    def train_batches(self, cfg: Any, train: Any, rank: int, world_size: int):
        from mllm.seq2seq.pairs import PairBatches

        return PairBatches(train[0], cfg.train.batch_size, cfg.train.seed, rank, world_size)

    def val_batches(self, cfg: Any, val: Any) -> list[tuple]:
        from mllm.seq2seq.pairs import eval_batches

        t = cfg.train  # the first pairs of the validation split
        return list(eval_batches(val[0], t.batch_size, t.eval_batches * t.batch_size))

    def evaluate(self, loaded: Any, cfg: Any, part: Any, train_part: Any, out: str) -> Evaluation:
        from mllm.seq2seq import evaluation

        result = evaluation.evaluate(loaded, part, cfg, storage.join(out, "attention"))
        m = result["metrics"]
        return Evaluation(
            self.headline,
            self.higher_is_better,
            m["val_loss"],
            result["n_targets"],
            dict(m),
            evaluation.report(cfg, loaded.url, loaded.step, result),
            [f"attention/{name}" for name in result["pictures"]],
        )

    def rescore(self, loaded: Any, cfg: Any, part: Any, vocab_url: str) -> Evaluation:
        # The held-out texts go through the checkpoint's own tokenizers and vocabularies (an
        # unknown word becomes <unk>), so a champion trained on other pairs translates exactly
        # the same sentences.
        from mllm.seq2seq.evaluation import score_texts

        m = score_texts(loaded, part, cfg.data.pairs.bleu_tokenize)
        return Evaluation(
            self.headline,
            self.higher_is_better,
            m["val_loss"],
            m["targets"],
            {k: m[k] for k in ("val_loss", "exact_match", "bleu", "chrf")},
            "",
        )

    def sample(self, loaded: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
        from mllm.seq2seq.translate import translate_texts

        s = loaded.config.sample
        return translate_texts(
            loaded,
            s.prompts if prompts is None else prompts,
            options.get("method"),
            beam_width=option(options, s, "beam_width"),
            temperature=option(options, s, "temperature"),
            seed=option(options, s, "seed"),
        )

    def run_samples(self, loaded: Any, cfg: Any) -> Samples:
        from mllm.seq2seq.evaluation import usable_prompts

        prompts, left_out = usable_prompts(loaded, cfg.sample.prompts)
        notes = [
            f"sample prompt {p!r}: the source vocabulary lacks "
            f"{' '.join(repr(t) for t in missing[:20]) or 'every token'}; left out"
            for p, missing in left_out.items()
        ]
        out = {
            m: [f"{p} -> {t}" for p, t in zip(prompts, self.sample(loaded, prompts, {"method": m}) if prompts else [])]
            for m in cfg.sample.methods
        }
        return Samples(prompts, out, notes)

    def exports(self, m: Any) -> dict[str, str]:
        return {"onnx": "seq2seq_onnx:" + ("export_rnn" if m.arch == "seq2seq-rnn" else "export_transformer")}

    def served_params(self, s: Any) -> list[tuple[str, str, Any]]:
        return [
            ("method", "string", s.methods[0]),
            ("beam_width", "long", s.beam_width),
            ("temperature", "double", s.temperature),
            ("seed", "long", s.seed),
        ]

    def describe(self, e: Evaluation) -> str:
        m = e.metrics
        return (
            f"chrF {m['chrf']:.2f}, exact match {100 * m['exact_match']:.2f}%, BLEU {m['bleu']:.2f}, "
            f"val loss {e.loss:.4f}"
        )

    def describe_data(self, data: Any) -> str:
        s = data.splits
        return (
            f"{data.tokens.n_chunks:,} pairs, vocabularies: source {data.source_side.vocab.size}, target "
            f"{data.vocab.size}; target tokens: train {s.train.n_tokens:,} / val {s.val.n_tokens:,}"
            + (f" / test {s.test.n_tokens:,}" if s.test else "")
        )


def _side(vocab_url: str | None, tokenizer_url: str | None, side: str) -> tuple[Vocab, Tokenizer]:
    from mllm.seq2seq.pairs import check_vocab

    prefix = "src_" if side == "source" else ""
    if not vocab_url or not tokenizer_url:
        raise UserError(
            f"a seq2seq run needs paths.{prefix}vocab and paths.{prefix}tokenizer: the {side} side's "
            "files that the pairs stage wrote"
        )
    storage.require(vocab_url, f"{side} vocabulary (paths.{prefix}vocab)")
    storage.require(tokenizer_url, f"{side} tokenizer (paths.{prefix}tokenizer)")
    vocab = check_vocab(Vocab.load(vocab_url), side)
    return vocab, tokenizer_from_json(storage.read_text(tokenizer_url), tokenizer_url)
