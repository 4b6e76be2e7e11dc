"""The word-embedding family (CBOW) as every stage sees it (its `Family`): config sections,
batches, evaluation, samples. Its model lives in `mllm/embeddings/`."""

from __future__ import annotations

from typing import Any

from mllm import UserError, storage
from mllm.config import CbowConfig
from mllm.embeddings.wordsim import HEADLINE
from mllm.families.base import Evaluation, Family, Samples, option, register

WORDSIM353_PAIRS = 353
FEW_PAIRS = 30  # below this many scored pairs a Spearman correlation moves by tenths between runs


@register
class WordEmbeddings(Family):
    name = "word embeddings"
    sections = (CbowConfig,)
    headline = HEADLINE
    higher_is_better = True
    methods = ()  # a sample is a word's neighbours, whatever the method
    extra = "embeddings"  # gensim: its evaluation sets

    def check(self, cfg: Any) -> None:
        if cfg.data.tokenizer.kind != "basic_english":
            raise ValueError("model.arch cbow learns from paragraphs: set data.tokenizer.kind=basic_english")
        if cfg.train.sampling != "epoch":
            raise ValueError("model.arch cbow draws every centre word once an epoch: set train.sampling=epoch")

    def size(self, m: Any) -> str:
        return f"{m.n_embd} wide"

    def build_model(self, m: Any):
        if m.vocab_size <= 0:
            raise UserError("model.vocab_size is 0: set it to the vocabulary's size before building the model")
        from mllm.embeddings.cbow import CBOW

        return CBOW(m)

    def load_inputs(self, cfg: Any) -> tuple:
        p = cfg.paths
        for name in ("train_offsets", "val_offsets"):
            if getattr(p, name) is None:
                raise UserError(
                    f"a CBOW run needs paths.{name}: the paragraph offsets the split stage wrote beside the ids"
                )
        return super().load_inputs(cfg)

    def train_batches(self, cfg: Any, train: Any, rank: int, world_size: int):
        from mllm.embeddings.cbow import CbowBatches

        t = cfg.train
        return CbowBatches.from_config(cfg.model, *train, t.batch_size, t.seed, rank, world_size)

    def val_batches(self, cfg: Any, val: Any) -> list[tuple]:
        from mllm.embeddings.cbow import CbowBatches

        t = cfg.train
        return CbowBatches.from_config(cfg.model, *val, t.batch_size, t.seed).eval_batches(
            t.eval_batches * t.batch_size, seed=t.seed
        )

    def evaluate(self, loaded: Any, cfg: Any, part: Any, train_part: Any, out: str) -> Evaluation:
        from mllm.embeddings import evaluation

        result = evaluation.evaluate(loaded, part, cfg, storage.join(out, "embeddings"))
        m = result["metrics"]
        report = evaluation.report(cfg, loaded.url, loaded.step, result)
        files = [f"embeddings/{name}" for name in ("vectors.parquet", "vectors.w2v.txt", "pca.png")]
        notes = list(result["notes"])
        pairs = round(m["wordsim353_coverage"] * WORDSIM353_PAIRS)
        if pairs < FEW_PAIRS:
            notes.append(
                f"WordSim-353 covers only {pairs} of its {WORDSIM353_PAIRS} pairs in this vocabulary "
                f"({100 * m['wordsim353_coverage']:.1f}%): the headline, and so the champion decision, "
                "rests on too few pairs to mean much; train on more text or lower data.vocab.min_freq"
            )
        return Evaluation(
            self.headline, self.higher_is_better, m["val_loss"], result["n_samples"], dict(m), report, files, notes
        )

    def sample(self, loaded: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
        from mllm.embeddings.evaluation import neighbours_of

        k = option(options, loaded.config.sample, "neighbours")
        prompts = [" ".join(loaded.config.sample.probes)] if prompts is None else prompts
        out = []
        for prompt in prompts:
            words = loaded.tokenizer.split(prompt)  # as the corpus was: "War" is the corpus's "war"
            if not words:
                raise UserError(
                    'the prompt holds no word: give the words whose neighbours to list, e.g. --prompt "war mother"'
                )
            out.append("\n".join(neighbours_of(loaded, words, k)))
        return out

    def run_samples(self, loaded: Any, cfg: Any) -> Samples:
        from mllm.embeddings.evaluation import neighbours_of, vectors

        s = cfg.sample
        known = [w for w in s.probes if w in vectors(loaded)]
        notes = [
            f"probe word {w!r} is not in the vocabulary: left out of the neighbours"
            for w in sorted(set(s.probes) - set(known))
        ]
        return Samples(known, {"neighbours": neighbours_of(loaded, known, s.neighbours)}, notes)

    def exports(self, m: Any) -> dict[str, str]:
        return {"onnx": "onnx:export_cbow"}

    def served_params(self, s: Any) -> list[tuple[str, str, Any]]:
        return [("neighbours", "long", s.neighbours)]

    def describe(self, e: Evaluation) -> str:
        m = e.metrics
        return (
            f"WordSim-353 Spearman {m['wordsim353_spearman']:.4f} (coverage {m['wordsim353_coverage']:.2f}), "
            f"SimLex-999 {m['simlex999_spearman']:.4f}, analogies {m['analogy_accuracy']:.4f}, "
            f"held-out loss {e.loss:.4f}"
        )
