"""Model families: one object per kind of model, found by `model.arch`, that says everything the
stages, the loop and the CLI need to know about its models (docs/families.md)."""

from __future__ import annotations

import importlib
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from mllm import UserError
from mllm.runtime.inputs import load_token_inputs

# The packages that hold a family each; importing one registers it.
FAMILY_MODULES = ("mllm.families.lm", "mllm.families.embeddings", "mllm.families.seq2seq", "mllm.families.sequences")

DataKind = Literal["corpus", "pairs", "generated"]


@dataclass
class Evaluation:
    """A family's evaluation of one checkpoint on one split, in the shape every family shares."""

    headline: str  # the metric that decides the champion; metrics[headline] is its value
    higher_is_better: bool
    loss: float  # held-out loss (nats per target)
    count: int  # targets scored
    metrics: dict[str, float]  # every measure, logged to MLflow as final_<name>
    report: str  # markdown
    files: list[str] = field(default_factory=list)  # pictures and exports written under the output folder
    notes: list[str] = field(default_factory=list)  # warnings a person should read

    @property
    def value(self) -> float:
        return self.metrics[self.headline]


@dataclass
class Samples:
    """A family's samples for the recipe's own prompts: lines per method, and what was left out."""

    prompts: list[str]
    by_method: dict[str, list[str]]
    notes: list[str] = field(default_factory=list)


class Family:
    """The interface; each family overrides what differs (see module doc)."""

    name: ClassVar[str]
    sections: ClassVar[tuple[type, ...]]  # its `model:` config sections (members of the union)
    data: ClassVar[DataKind] = "corpus"
    headline: ClassVar[str]
    higher_is_better: ClassVar[bool]
    # Samples: the methods and sample options it understands (the rest of `sample` it ignores).
    methods: ClassVar[tuple[str, ...]] = ("greedy",)
    extra: ClassVar[str | None] = None  # the pip extra it needs beyond the base install, if any

    @property
    def a_model(self) -> str:
        """The family's model in a phrase: "a language model", "a word embeddings model"."""
        return f"a {self.name}" if self.name.endswith("model") else f"a {self.name} model"

    @property
    def archs(self) -> tuple[str, ...]:
        return tuple(a for s in self.sections for a in typing.get_args(s.model_fields["arch"].annotation))

    # configuration
    def check(self, cfg: Any) -> None:
        """Raise ValueError when the run's other sections do not fit this family's model."""
        if bad := [m for m in cfg.sample.methods if m not in self.methods]:
            raise ValueError(f"sample.methods {', '.join(bad)}: {self.a_model} samples with {', '.join(self.methods)}")

    def takes_muon(self, model: Any) -> bool:
        """Whether train.optimizer muon fits this model: Muon orthogonalises the updates of hidden
        weight matrices, which a transformer's blocks are made of."""
        return False

    def check_source(self, cfg: Any) -> None:
        """Check a local source (already read through as text) for what this family needs of it,
        before any stage runs."""

    def size(self, model: Any) -> str:
        """The model's size in a few words (the recipes table)."""
        raise NotImplementedError

    def tokens(self, data: Any) -> str:
        """What its tokens are, in a word or two (the recipes table)."""
        return data.tokenizer.kind

    # training
    def build_model(self, model: Any) -> torch.nn.Module:
        raise NotImplementedError

    def load_inputs(self, cfg: Any) -> tuple:
        """(cfg with vocabulary sizes set, vocab, tokenizer, train data, validation data, what a
        checkpoint must carry besides): the files the config's paths section names, checked."""
        return load_token_inputs(cfg)

    def train_batches(self, cfg: Any, train: Any, rank: int, world_size: int):
        raise NotImplementedError

    def val_batches(self, cfg: Any, val: Any) -> list[tuple]:
        raise NotImplementedError

    # evaluation and samples
    def evaluate(self, loaded: Any, cfg: Any, part: Any, train_part: Any, out: str) -> Evaluation:
        """Score `loaded` on a split (`part`: its files, as the split stage wrote them); pictures
        and exports go under `out`."""
        raise NotImplementedError

    def rescore(self, loaded: Any, cfg: Any, part: Any, vocab_url: str) -> Evaluation | None:
        """Another run's checkpoint (the champion's) scored on this run's split, whose tokens
        came from the vocabulary at `vocab_url`; None when the headline does not depend on the
        split (then the champion's own value stands)."""
        return None

    def sample(self, loaded: Any, prompts: list[str] | None, options: dict[str, Any]) -> list[str]:
        """An answer per prompt (None: the run's own prompts). `options` are the sample options
        given (method, max_new_tokens, temperature, top_k, top_p, beam_width, seed, neighbours,
        use_cache); those not given take the run's own `sample` section."""
        raise NotImplementedError

    def run_samples(self, loaded: Any, cfg: Any) -> Samples:
        """The recipe's own samples: every prompt with every method of its `sample` section."""
        prompts = list(cfg.sample.prompts)
        return Samples(prompts, {m: self.sample(loaded, prompts, {"method": m}) for m in cfg.sample.methods})

    def exports(self, model: Any) -> dict[str, str]:
        """The formats this model section exports to (mllm.export): format -> "module:function"
        of mllm.export that writes it. None by default."""
        return {}

    def served_params(self, s: Any) -> list[tuple[str, str, Any]]:
        """The served model's parameters: (name, MLflow type, default from the run's `sample`)."""
        return [("method", "string", s.methods[0]), ("seed", "long", s.seed)]

    def describe(self, e: Evaluation) -> str:
        """An evaluation in one line."""
        return (
            f"{e.headline} {e.value:.4f} ({'higher' if e.higher_is_better else 'lower'} is better), "
            f"val loss {e.loss:.4f}"
        )

    def describe_data(self, data: Any) -> str:
        """What the data stages made, in one line (`prepare`)."""
        s = data.splits
        return (
            f"{data.tokens.n_tokens:,} tokens, vocabulary {data.vocab.size}, train {s.train.n_tokens:,} / "
            f"val {s.val.n_tokens:,}" + (f" / test {s.test.n_tokens:,}" if s.test else "")
        )

    def make_data(self, data: Any, out: str) -> dict[str, Any]:
        """A generated family's data (data == "generated") from the `data` section, written
        under `out`: {"source", "sequences", "n_tokens", "train" and "val": {"file", "n_tokens"}},
        with vocab.json and tokenizer.json beside."""
        raise NotImplementedError


# Keyed by the section's class name, not the class: MLflow loads a registered model's own copy of
# this package beside an imported one, and a section of either copy must find its family.
_REGISTRY: dict[str, Family] = {}


def register(cls: type[Family]) -> type[Family]:
    family = cls()
    for section in family.sections:
        _REGISTRY[section.__name__] = family
    return cls


def _load() -> None:
    # Every time: importing one family's module (mllm.lm.gpt, say) registers that family alone.
    for module in FAMILY_MODULES:
        importlib.import_module(module)


def family_of(obj: Any) -> Family:
    """The family of a model section, or of the model section of a run config or a loaded
    checkpoint."""
    _load()
    for attr in ("config", "model"):  # Loaded -> RunConfig -> model section
        inner = getattr(obj, attr, None)
        if inner is not None and not isinstance(inner, torch.nn.Module):
            obj = inner
    try:
        return _REGISTRY[type(obj).__name__]
    except KeyError:
        raise UserError(f"no model family takes a {type(obj).__name__}: it needs a model section") from None


def families() -> list[Family]:
    _load()
    return list(dict.fromkeys(_REGISTRY.values()))


def option(options: dict[str, Any], sample_cfg: Any, name: str) -> Any:
    """A sample option as given, else the run's own."""
    value = options.get(name)
    return getattr(sample_cfg, name) if value is None else value


def samples_text(prompts: list[str], texts: list[str]) -> str:
    """One sampling method's samples as a file: each prompt, then its text."""
    return "\n\n".join(f"--- prompt {p!r}\n{t}" for p, t in zip(prompts, texts)) + "\n"


def ids_in_vocab(ids: np.ndarray, ours: list[str], theirs: Any) -> np.ndarray:
    """Token ids made with the vocabulary `ours` (its itos) re-encoded in vocabulary `theirs` (a
    Vocab): a token it lacks becomes its <unk>."""
    if theirs.itos == ours:
        return ids
    return theirs.encode_array(ours)[np.asarray(ids, dtype=np.int64)]


def build_model(cfg: Any) -> torch.nn.Module:
    """A model section's model, built by its family."""
    return family_of(cfg).build_model(cfg)


def check_run(cfg: Any) -> None:
    """Raise ValueError when a run's data and sample sections do not fit its model's family."""
    family = family_of(cfg.model)
    for section, kind in (("pairs", "pairs"), ("sequences", "generated")):
        if getattr(cfg.data, section) is not None and family.data != kind:
            raise ValueError(
                f"data.{section} is data for another family than the {family.name} "
                f"(model.arch {cfg.model.arch}): remove it"
            )
    if family.data == "generated" and cfg.data.sequences is None:
        raise ValueError(
            f"the {family.name} family makes its data: add a data.sequences section (see recipe count-rnn)"
        )
    if cfg.train.optimizer == "muon" and not family.takes_muon(cfg.model):
        raise ValueError(
            f"train.optimizer muon is for the GPT's hidden matrices, not model.arch {cfg.model.arch}: use adamw or adam"
        )
    family.check(cfg)


def load_inputs(cfg: Any) -> tuple:
    """The config with its vocabulary sizes set, the vocabulary and tokenizer, the train and
    validation data, and what else a checkpoint must carry to be used alone: as the family of
    the config's model reads them."""
    if cfg.paths is None:
        raise UserError("the config has no paths section: add paths with train_ids, val_ids, vocab and checkpoint_dir")
    return family_of(cfg).load_inputs(cfg)
