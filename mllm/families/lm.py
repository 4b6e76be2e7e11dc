"""The language-model family as every stage sees it (its `Family`): config sections, batches,
evaluation, samples, champion rescoring. Its models live in `mllm/lm/`."""

from __future__ import annotations

from typing import Any

from mllm import UserError
from mllm.config import GPTConfig, RecurrentConfig
from mllm.data.vocab import Vocab
from mllm.families.base import Evaluation, Family, Samples, ids_in_vocab, option, register
from mllm.runtime.epochs import load_ids

OPTIONS = ("max_new_tokens", "temperature", "top_k", "top_p", "beam_width", "seed")
# One evaluation setting for every model, whatever it trained with: a recurrent model's score
# depends on how many streams the split is cut into, and the champion and a challenger must be
# scored alike (the same weights trained twice must score the same, to the last bit).
EVAL_STREAMS = 64


def _score(loaded: Any, cfg: Any, ids: Any, n_bytes: int | None) -> dict[str, float]:
    """The one scoring of a split, for a run's own model and for the champion it is judged against."""
    from mllm.lm.evaluate import evaluate

    return evaluate(
        loaded.model,
        ids,
        window=cfg.train.window,
        batch_size=EVAL_STREAMS,
        device=next(loaded.model.parameters()).device,
        n_bytes=n_bytes,
    )


@register
class LanguageModel(Family):
    name = "language model"
    sections = (RecurrentConfig, GPTConfig)
    headline = "val_bits_per_byte"
    higher_is_better = False
    methods = ("greedy", "temperature", "top-k", "top-p", "beam")

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        block = getattr(cfg.model, "block_size", None)
        if block is not None and cfg.train.window > block:
            raise ValueError(
                f"train.window ({cfg.train.window}) exceeds model.block_size ({block}): "
                "GPT has no position embedding beyond it"
            )

    def takes_muon(self, model: Any) -> bool:
        return isinstance(model, GPTConfig)

    def size(self, m: Any) -> str:
        if isinstance(m, GPTConfig):
            return f"{m.n_layer}x{m.n_head}x{m.n_embd}"
        return f"{m.n_layer}x{m.hidden_size}"

    def build_model(self, m: Any):
        if m.vocab_size <= 0:
            raise UserError("model.vocab_size is 0: set it to the vocabulary's size before building the model")
        if isinstance(m, GPTConfig):
            from mllm.lm.gpt import GPT

            return GPT(m)
        from mllm.lm.rnn import RecurrentLM

        return RecurrentLM(m)

    def train_batches(self, cfg: Any, train: Any, rank: int, world_size: int):
        from mllm.lm.windows import EpochWindows, RandomWindows

        ids, t = train[0], cfg.train
        if t.sampling == "epoch":
            return EpochWindows(ids, t.window, t.batch_size, t.stride, t.seed, rank, world_size)
        return RandomWindows(ids, t.window, t.batch_size, t.seed, rank, world_size)

    def val_batches(self, cfg: Any, val: Any) -> list[tuple]:
        from mllm.lm.windows import eval_starts, windows

        ids, t = val[0], cfg.train
        starts = eval_starts(ids, t.window, t.eval_batches * t.batch_size, t.seed)
        return [windows(ids, starts[i : i + t.batch_size], t.window) for i in range(0, len(starts), t.batch_size)]

    def evaluate(self, loaded: Any, cfg: Any, part: Any, train_part: Any, out: str) -> Evaluation:
        from mllm.lm.evaluate import ngram_baseline

        ids = load_ids(part.ids)
        s = _score(loaded, cfg, ids, part.n_bytes)
        train_ids = load_ids(train_part.ids)
        size = len(loaded.vocab)
        unigram = ngram_baseline(train_ids, ids, size, order=1)["bits_per_token"]
        bigram = ngram_baseline(train_ids, ids, size, order=2)["bits_per_token"]
        metrics = {
            "val_loss": s["loss"],
            "val_perplexity": s["perplexity"],
            "val_bits_per_token": s["bits_per_token"],
            "val_bits_per_byte": s["bits_per_byte"],
            "baseline_unigram_bits_per_token": unigram,
            "baseline_bigram_bits_per_token": bigram,
        }
        report = "\n".join(
            [
                f"# Evaluation of {cfg.recipe}",
                "",
                f"Checkpoint after {loaded.step} steps.",
                "",
                "| metric | model | unigram | bigram |",
                "|---|---|---|---|",
                f"| loss (nats/token) | {s['loss']:.4f} | | |",
                f"| perplexity | {s['perplexity']:.3f} | | |",
                f"| bits per token | {s['bits_per_token']:.4f} | {unigram:.4f} | {bigram:.4f} |",
                f"| bits per byte | {s['bits_per_byte']:.4f} | | |",
                "",
                f"{s['tokens']} tokens scored, each once.",
                "",
            ]
        )
        return Evaluation(self.headline, self.higher_is_better, s["loss"], int(s["tokens"]), metrics, report)

    def rescore(self, loaded: Any, cfg: Any, part: Any, vocab_url: str) -> Evaluation:
        # The split's tokens in the checkpoint's own vocabulary (a token it never saw becomes
        # <unk>), so a champion trained on other data is scored on exactly the same text; bits per
        # byte compare across vocabularies, loss only within one.
        ids = ids_in_vocab(load_ids(part.ids), Vocab.load(vocab_url).itos, loaded.vocab)
        s = _score(loaded, cfg, ids, part.n_bytes)
        metrics = {"val_loss": s["loss"], "val_bits_per_byte": s["bits_per_byte"]}
        return Evaluation(self.headline, self.higher_is_better, s["loss"], int(s["tokens"]), metrics, "")

    def sample(self, loaded: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
        from mllm.lm.generate import sample_text

        s = loaded.config.sample
        method = options.get("method") or s.methods[0]
        kw = {k: option(options, s, k) for k in OPTIONS}
        kw["use_cache"] = options.get("use_cache", True)
        return [sample_text(loaded, p, method, **kw) for p in (s.prompts if prompts is None else prompts)]

    def run_samples(self, loaded: Any, cfg: Any) -> Samples:
        from mllm.lm.generate import fit_prompt

        prompts, notes = [], []
        for prompt in cfg.sample.prompts:
            fitted, missing = fit_prompt(loaded, prompt)
            if missing:
                notes.append(
                    f"sample prompt {prompt!r}: the vocabulary lacks "
                    f"{' '.join(repr(t) for t in missing[:20])}; sampling from {fitted!r} instead"
                )
            prompts.append(fitted)
        out = {m: self.sample(loaded, prompts, {"method": m}) for m in cfg.sample.methods}
        return Samples(prompts, out, notes)

    def exports(self, m: Any) -> dict[str, str]:
        if isinstance(m, GPTConfig):
            return {"hf": "hf:export_gpt", "onnx": "onnx:export_gpt", "gguf": "gguf:export_gpt"}
        return {"onnx": "onnx:export_recurrent"}

    def served_params(self, s: Any) -> list[tuple[str, str, Any]]:
        return [
            ("method", "string", s.methods[0]),
            ("max_new_tokens", "long", s.max_new_tokens),
            ("temperature", "double", s.temperature),
            ("top_k", "long", s.top_k),
            ("top_p", "double", s.top_p),
            ("beam_width", "long", s.beam_width),
            ("seed", "long", s.seed),
        ]

    def describe(self, e: Evaluation) -> str:
        m = e.metrics
        return (
            f"val loss {e.loss:.4f} ({m['val_bits_per_token']:.3f} bits/token, {m['val_bits_per_byte']:.3f} "
            f"bits/byte; bigram baseline {m['baseline_bigram_bits_per_token']:.3f} bits/token)"
        )
