"""The data section of the config tree: source, tokenizer, vocabulary, split, and the made-up data of
the parallel-text and sequence families."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from mllm.config.section import Section


class TokenizerConfig(Section):
    # basic_english: torchtext's rules, one token list per paragraph (what CBOW trains on).
    kind: Literal["char", "word", "bpe", "basic_english"] = "char"
    # char: keep only [A-Za-z0-9 \-.;,\n?!], newline runs -> one space, space runs -> one space.
    # False keeps every character as it is (the "raw" mode).
    normalize: bool = True
    bpe_vocab_size: int = Field(2000, ge=64, le=1_000_000)
    strip_gutenberg: bool = True
    # A corpus of many files trains its BPE on a sample of this many bytes (whole files in digest
    # order): the tokenizer, and so every token, stays while the corpus grows outside the sample.
    train_bytes: int = Field(32_000_000, ge=1)


class VocabConfig(Section):
    min_freq: int = Field(1, ge=1)
    max_size: int | None = Field(None, ge=2)
    # <unk> is always present; these are added on request.
    specials: list[Literal["<pad>", "<bos>", "<eos>"]] = []
    # The order of the ids. frequency: most frequent first. token: in token order, so a corpus
    # that grows keeps its ids while no new token arrives (and a many-file corpus's split is
    # routed again for its new files only). auto: token for a corpus of many files, else frequency.
    order: Literal["auto", "frequency", "token"] = "auto"


class SplitConfig(Section):
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    test_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    # Contiguous: train is the first part of the text, then val, then test (no leakage between
    # neighbouring windows). Otherwise chunks of `shuffle_chunk` tokens are shuffled with `seed`.
    contiguous: bool = True
    shuffle_chunk: int = Field(4096, ge=1)
    seed: int = 1337
    # A corpus of many files: each span (a document, or a piece of about this many characters of
    # a longer one) goes to train, val or test by a digest of its content and the seed, so adding
    # files never moves a span. One file keeps the split above.
    span_bytes: int = Field(16_384, ge=64)

    @model_validator(mode="after")
    def _fractions(self) -> "SplitConfig":
        if self.val_fraction + self.test_fraction >= 1.0:
            raise ValueError("val_fraction + test_fraction must be below 1 (train needs some data)")
        return self


class NumbersConfig(Section):
    """The offline parallel corpus: `count` distinct numbers in [0, max_number] written out in
    English words, paired with the same number in `language` (num2words)."""

    count: int = Field(10_000, ge=2)
    max_number: int = Field(9_999, ge=1)
    seed: int = 0
    language: Literal["de", "fr"] = "de"

    @model_validator(mode="after")
    def _enough(self) -> "NumbersConfig":
        if self.count > self.max_number + 1:
            raise ValueError(f"count {self.count} exceeds the {self.max_number + 1} numbers in [0, max_number]")
        return self


class PairsConfig(Section):
    """Parallel text for the sequence-to-sequence family: `data.source` is a TSV file of pairs
    (source, target; more columns are ignored), or empty with `numbers` set. `data.tokenizer`
    cuts the source side, `target_tokenizer` the target side; `data.vocab` and `data.split`
    (val/test fraction and seed) apply as for a corpus."""

    numbers: NumbersConfig | None = None
    # False keeps every character: the char tokenizer's normalisation would drop German's umlauts.
    target_tokenizer: TokenizerConfig = TokenizerConfig(kind="char", normalize=False)
    shared_vocab: bool = False  # one vocabulary for both sides
    # sacrebleu's BLEU tokenization: 13a (words, the WMT default), or char for one-word targets
    # (a German number), where word 4-grams do not exist and word BLEU is 0 whatever the output.
    bleu_tokenize: Literal["13a", "char", "intl", "none"] = "13a"


class SequencesConfig(Section):
    """Generated sequences of the numbers 0..numbers-1 (the seeds' parts IV and V), no corpus:
    `count` predicts the next number of `length` consecutive ones at every position;
    `remember-first` reads the same inputs and must answer the first element at every position
    (the seed's figure); `remember-first-random` asks the same of `count` random sequences, where
    the first element cannot be worked out from the current one and its position. The consecutive
    tasks have only numbers - length distinct sequences: as in the seed, the model is trained and
    scored on all of them."""

    task: Literal["count", "remember-first", "remember-first-random"] = "count"
    length: int = Field(10, ge=2, le=4096)
    numbers: int = Field(128, ge=4, le=1_000_000)
    count: int = Field(2000, ge=2, description="remember-first-random: how many sequences to draw")
    seed: int = 0

    @model_validator(mode="after")
    def _room(self) -> "SequencesConfig":
        if self.task != "remember-first-random" and self.length >= self.numbers:
            raise ValueError(
                f"length {self.length} leaves no sequence of consecutive numbers below {self.numbers}: "
                "lower length or raise numbers"
            )
        return self


class DataConfig(Section):
    # A file, folder, object-store prefix or glob; several as a list.
    source: str | list[str] = ""
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    tokenizer: TokenizerConfig = TokenizerConfig()
    vocab: VocabConfig = VocabConfig()
    split: SplitConfig = SplitConfig()
    pairs: PairsConfig | None = None  # the seq2seq family: parallel text instead of a corpus
    sequences: SequencesConfig | None = None  # the sequence experiments: data made from this section
    # JSONL and Parquet files: the field that holds each record's text (other fields are ignored).
    text_field: str = "text"
    # A file of a many-file source that is not usable text: fail the run, or skip it (named in
    # the run's record). By default (skip-empty) an empty file of many is left out and counted (it
    # holds no text to lose: a package's __init__.py) and any other bad file fails the run; a
    # source of one file that is empty is always an error.
    bad_files: Literal["skip-empty", "fail", "skip"] = "skip-empty"
    # Where the per-file work of a many-file source runs: processes (one per core), threads, or
    # dask://HOST:PORT (a running Dask scheduler, through prefect-dask).
    task_runner: str = "processes"

    @model_validator(mode="after")
    def _runner(self) -> "DataConfig":
        r = self.task_runner
        if r not in ("processes", "threads") and not (r.startswith("dask://") and ":" in r[len("dask://") :]):
            raise ValueError(f"task_runner {r!r} is none of processes, threads or dask://HOST:PORT")
        return self

    @property
    def sources(self) -> list[str]:
        return [self.source] if isinstance(self.source, str) else list(self.source)
