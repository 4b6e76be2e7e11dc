"""The sequence experiments' family as every stage sees it (its `Family`): config sections,
generated data, batches, accuracy, next elements. Its models live in `mllm/sequences/`."""

from __future__ import annotations

from typing import Any

import torch

from mllm import UserError, storage
from mllm.config import SequenceModelConfig, TokenizerConfig
from mllm.data.text import build_tokenizer
from mllm.families.base import Evaluation, Family, register


@register
class SequenceExperiments(Family):
    name = "sequence experiments"
    sections = (SequenceModelConfig,)
    data = "generated"
    headline = "accuracy"
    higher_is_better = True
    methods = ("greedy",)

    def exports(self, m: Any) -> dict[str, str]:
        return {"onnx": "onnx:export_recurrent"}

    def size(self, m: Any) -> str:
        return f"{m.n_layer}x{m.hidden_size}" + (" from scratch" if m.from_scratch else "")

    def tokens(self, data: Any) -> str:
        return f"numbers < {data.sequences.numbers}"

    def build_model(self, m: Any):
        if m.vocab_size <= 0:
            raise UserError("model.vocab_size is 0: set it to the vocabulary's size before building the model")
        from mllm.sequences.model import SequenceRNN

        return SequenceRNN(m)

    def make_data(self, data: Any, out: str) -> dict[str, Any]:
        from mllm.sequences.data import make_sequences, save_split, split_sequences, vocabulary

        s = data.sequences
        x, y = make_sequences(s.task, s.length, s.numbers, s.count, s.seed)
        train, val = split_sequences(s.task, len(x), data.split.val_fraction, data.split.seed)
        parts = {}
        for name, rows in (("train", train), ("val", val)):
            save_split(storage.join(out, f"{name}.npz"), x[rows], y[rows])
            parts[name] = {"file": f"{name}.npz", "sequences": len(rows), "n_tokens": int(y[rows].size)}
        vocabulary(s.numbers).save(storage.join(out, "vocab.json"))
        storage.write_text(storage.join(out, "tokenizer.json"), build_tokenizer(_tokenizer()).to_json())
        what = f"{s.task}, length {s.length}, numbers below {s.numbers}"
        what += f", {s.count} random sequences, seed {s.seed}" if s.task == "remember-first-random" else ""
        return {"source": f"generated: {what}", "sequences": len(x), "n_tokens": int(y.size), **parts}

    def load_inputs(self, cfg: Any) -> tuple:
        from mllm.data.text import tokenizer_from_json
        from mllm.data.vocab import Vocab
        from mllm.sequences.data import load_split

        p = cfg.paths
        storage.require(p.vocab, "vocabulary (paths.vocab)")
        vocab = Vocab.load(p.vocab)
        tokenizer = (
            tokenizer_from_json(storage.read_text(p.tokenizer), p.tokenizer)
            if p.tokenizer
            else build_tokenizer(_tokenizer())
        )
        size = cfg.model.vocab_size or len(vocab)
        splits = {}
        for what, url in (("train", p.train_ids), ("validation", p.val_ids)):
            x, y = load_split(url)
            if max(int(x.max()), int(y.max())) >= size:
                raise UserError(
                    f"{what} sequences at {url} hold ids beyond the vocabulary's {len(vocab)}: prepare the data again"
                )
            splits[what] = (x, y)
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": size})})
        return cfg, vocab, tokenizer, splits["train"], splits["validation"], {}

    def train_batches(self, cfg: Any, train: Any, rank: int, world_size: int):
        from mllm.sequences.data import SequenceBatches

        return SequenceBatches(train, cfg.train.batch_size, cfg.train.seed, rank, world_size)

    def val_batches(self, cfg: Any, val: Any) -> list[tuple]:
        from mllm.sequences.data import all_batches

        return all_batches(val, cfg.train.batch_size)[: cfg.train.eval_batches]

    def evaluate(self, loaded: Any, cfg: Any, part: Any, train_part: Any, out: str) -> Evaluation:
        from mllm.sequences.data import load_split

        val = _scores(loaded.model, load_split(part.ids))
        train = _scores(loaded.model, load_split(train_part.ids))
        s = cfg.data.sequences
        metrics = {
            "val_loss": val["loss"],
            "accuracy": val["accuracy"],
            "last_accuracy": val["last_accuracy"],
            "train_accuracy": train["accuracy"],
        }
        held = (
            "every sequence (the consecutive tasks have only these; the seed measured on them)"
            if s.task != "remember-first-random"
            else f"{val['sequences']} held-out random sequences"
        )
        report = "\n".join(
            [
                f"# Evaluation of {cfg.recipe} ({cfg.model.arch}{', from scratch' if cfg.model.from_scratch else ''})",
                "",
                f"Checkpoint `{loaded.url}` after {loaded.step} steps: task {s.task}, length {s.length}, numbers below "
                f"{s.numbers}. Scored on {held}.",
                "",
                "| measure | value |",
                "|---|---|",
                f"| accuracy, every position (headline) | {100 * val['accuracy']:.2f}% |",
                f"| accuracy, last position | {100 * val['last_accuracy']:.2f}% |",
                f"| accuracy on the training split | {100 * train['accuracy']:.2f}% |",
                f"| loss (nats per position) | {val['loss']:.4f} |",
                "",
            ]
        )
        return Evaluation(self.headline, self.higher_is_better, val["loss"], val["targets"], metrics, report)

    def sample(self, loaded: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
        prompts = loaded.config.sample.prompts if prompts is None else prompts
        return [_next_element(loaded, p) for p in prompts]

    def describe(self, e: Evaluation) -> str:
        m = e.metrics
        return (
            f"accuracy {100 * m['accuracy']:.2f}% (last position {100 * m['last_accuracy']:.2f}%, training "
            f"split {100 * m['train_accuracy']:.2f}%), val loss {e.loss:.4f}"
        )

    def describe_data(self, data: Any) -> str:
        s = data.splits
        return (
            f"{data.source}: {data.tokens.n_chunks:,} sequences, vocabulary {data.vocab.size}, positions: train "
            f"{s.train.n_tokens:,} / val {s.val.n_tokens:,}"
        )


def _tokenizer() -> TokenizerConfig:
    return TokenizerConfig(kind="word", normalize=False)


@torch.no_grad()
def _scores(model, split) -> dict[str, float]:
    model.eval()
    device = next(model.parameters()).device
    x, y = (torch.from_numpy(a).to(device) for a in split)
    logits, loss, _ = model(x, y)
    hit = logits.argmax(-1) == y
    return {
        "loss": loss.item(),
        "accuracy": hit.float().mean().item(),
        "last_accuracy": hit[:, -1].float().mean().item(),
        "targets": int(y.numel()),
        "sequences": len(y),
    }


@torch.no_grad()
def _next_element(loaded, prompt: str) -> str:
    tokens = loaded.tokenizer.split(prompt)
    if not tokens:
        raise UserError('the prompt is empty: give numbers separated by spaces, e.g. --prompt "7 8 9 10"')
    if missing := loaded.vocab.missing(tokens):
        raise UserError(
            f"the prompt holds {', '.join(repr(t) for t in missing[:10])}, not numbers below "
            f'{len(loaded.vocab) - 1}: give numbers separated by spaces, e.g. "7 8 9 10"'
        )
    model = loaded.model.eval()
    x = torch.tensor([loaded.vocab.encode(tokens)], device=next(model.parameters()).device)
    logits, _, _ = model(x)
    return loaded.vocab.itos[int(logits[0, -1].argmax())]
