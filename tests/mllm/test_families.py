"""Model families: one interface per family, no family named outside its own modules, a
checkpoint of every family answers `python -m mllm.sample`, and the sequence experiments."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import prewarmed
import pytest
import torch

from mllm import UserError
from mllm.config import SECTIONS, RunConfig, archs
from mllm.data.text import build_tokenizer
from mllm.data.vocab import UNK, Vocab
from mllm.families.base import FAMILY_MODULES, build_model, families, family_of
from mllm.resolve import resolve, validate
from mllm.runtime.checkpoint import load_checkpoint, save_checkpoint
from mllm.sample import answer

ROOT = Path(__file__).resolve().parents[2]
# Where a family may be named: its own package of models and its module in mllm/families, the
# config union and the registry of families.
FAMILY_PACKAGES = {Path("mllm", m.rpartition(".")[2]) for m in FAMILY_MODULES}
ALLOWED = {
    Path("mllm/config/__init__.py"),
    Path("mllm/config/model.py"),
    Path("mllm/families/base.py"),
    *(Path(*m.split(".")).with_suffix(".py") for m in FAMILY_MODULES),
}


def _shared_modules() -> list[Path]:
    out = []
    for folder in ("flows", "tasks", "mllm"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if rel in ALLOWED or any(p in rel.parents for p in FAMILY_PACKAGES):
                continue
            out.append(rel)
    return out


def test_no_module_outside_a_family_names_a_family() -> None:
    sections = {s.__name__ for s in SECTIONS.values()}
    arch_names = set(archs())
    found = []
    for rel in _shared_modules():
        source = (ROOT / rel).read_text()
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in sections:
                found.append(f"{rel}:{node.lineno}: {node.id}")
            elif isinstance(node, ast.alias) and node.name in sections:
                found.append(f"{rel}: imports {node.name}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in arch_names:
                found.append(f"{rel}:{node.lineno}: the arch {node.value!r}")
            elif isinstance(node, ast.Compare) and "arch" in ast.unparse(node.left).split(".")[-1:]:
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        for line_no, line in enumerate(source.splitlines(), 1):
            if re.search(r"bits_per_byte\b.*\bis (not )?None|\bis (not )?None.*bits_per_byte", line):
                found.append(f"{rel}:{line_no}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_rule_catches_a_family_branch(tmp_path: Path) -> None:
    # The scan above must see the kinds of branch that the refactoring removed.
    branch = 'if cfg.model.arch == "cbow":\n    pass\nisinstance(cfg.model, Seq2SeqConfig)\n'
    tree = ast.parse(branch)
    compares = [n for n in ast.walk(tree) if isinstance(n, ast.Compare)]
    names = [n.id for n in ast.walk(tree) if isinstance(n, ast.Name)]
    assert "arch" in ast.unparse(compares[0].left).split(".")[-1:] and "Seq2SeqConfig" in names


def test_every_section_has_one_family_and_every_family_its_headline() -> None:
    found = families()
    assert {f.name for f in found} == {
        "language model",
        "word embeddings",
        "sequence-to-sequence",
        "sequence experiments",
    }
    for section in SECTIONS.values():
        fam = family_of(section.model_construct())
        assert section in fam.sections
    for fam in found:
        assert fam.headline and isinstance(fam.higher_is_better, bool) and fam.data in ("corpus", "pairs", "generated")


# --- a checkpoint of every family ---------------------------------------------------------


def _vocab(tokens: list[str], specials: tuple[str, ...] = ()) -> Vocab:
    return Vocab([UNK, *specials, *dict.fromkeys(t for t in tokens if t not in (UNK, *specials))])


def _checkpoint(recipe: str, folder: Path) -> str:
    """An untrained checkpoint of a shipped recipe's model, with the vocabularies it needs."""
    cfg = resolve(recipe)
    text = "the war and the peace said the prince to the princess"
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    extra = {}
    if family_of(cfg).data == "pairs":
        from mllm.seq2seq.model import SPECIALS

        tgt_tok = build_tokenizer(cfg.data.pairs.target_tokenizer)
        vocab = _vocab(tgt_tok.split("einundzwanzig zwei drei"), SPECIALS)
        src = _vocab(tokenizer.split("twenty-one two three"), SPECIALS)
        extra = {"src_vocab": src.to_json(), "src_tokenizer": tokenizer.to_json()}
        model = cfg.model.model_copy(update={"src_vocab_size": len(src), "tgt_vocab_size": len(vocab)})
        tokenizer = tgt_tok
    elif family_of(cfg).data == "generated":
        from mllm.sequences.data import vocabulary

        vocab = vocabulary(cfg.data.sequences.numbers)
        model = cfg.model.model_copy(update={"vocab_size": len(vocab)})
        tokenizer = build_tokenizer(cfg.data.tokenizer.model_copy(update={"kind": "word", "normalize": False}))
    else:
        vocab = _vocab(tokenizer.split(text))
        model = cfg.model.model_copy(update={"vocab_size": len(vocab)})
    cfg = cfg.model_copy(update={"model": model})
    torch.manual_seed(0)
    url = str(folder / f"{recipe}.pt")
    save_checkpoint(
        url,
        {
            "model": build_model(model).state_dict(),
            "step": 0,
            "config": cfg.to_dict(),
            "vocab": vocab.to_json(),
            "vocab_digest": vocab.digest,
            "tokenizer": tokenizer.to_json(),
            **extra,
        },
    )
    return url


@pytest.mark.parametrize(
    "recipe,prompt",
    [("smoke", "the "), ("cbow-smoke", "war peace"), ("seq2seq-smoke", "twenty-one"), ("sequences-smoke", "7 8 9")],
)
def test_python_m_mllm_sample_answers_on_a_checkpoint_of_every_family(recipe: str, prompt: str, tmp_path: Path):
    url = _checkpoint(recipe, tmp_path)
    out = prewarmed.run("mllm.sample", ["--checkpoint", url, "--prompt", prompt], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() and "Traceback" not in out.stderr
    # The same answer from the entry point the CLI and the served model call.
    assert out.stdout.strip() == "\n".join(answer(load_checkpoint(url), [prompt])).strip()


def test_a_sample_option_the_family_has_no_use_for_is_refused_in_one_line(tmp_path: Path) -> None:
    url = _checkpoint("seq2seq-smoke", tmp_path)
    out = prewarmed.run("mllm.sample", ["--checkpoint", url, "--prompt", "two", "--method", "top-p"], timeout=120)
    assert out.returncode == 2 and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1
    assert "greedy, beam, temperature" in out.stderr


def test_word_embeddings_refuse_an_empty_prompt(tmp_path: Path) -> None:
    loaded = load_checkpoint(_checkpoint("cbow-smoke", tmp_path))
    with pytest.raises(UserError, match="holds no word"):
        answer(loaded, [""])


# --- the sequence experiments -------------------------------------------------------------


def test_the_three_tasks_make_the_seeds_data() -> None:
    from mllm.sequences.data import make_sequences, split_sequences

    x, y = make_sequences("count", 5, 12, 0, 0)
    assert x.shape == (7, 5) and x[3].tolist() == [3, 4, 5, 6, 7] and y[3].tolist() == [4, 5, 6, 7, 8]
    assert y.max() == 11  # the last successor is still a number below 12
    x, y = make_sequences("remember-first", 5, 12, 0, 0)
    assert (y == x[:, :1]).all()
    x, y = make_sequences("remember-first-random", 8, 128, 500, 3)
    assert x.shape == (500, 8) and (y == x[:, :1]).all()
    # The first element cannot be worked out from the last and the position: they are independent.
    assert abs(np.corrcoef(x[:, 0], x[:, -1])[0, 1]) < 0.15
    train, val = split_sequences("remember-first-random", 500, 0.1, 0)
    assert len(val) == 50 and not set(train) & set(val)
    every = split_sequences("count", 7, 0.1, 0)
    assert every[0].tolist() == every[1].tolist() == list(range(7))  # trained and scored on all, as the seed


def test_a_sequence_config_must_fit(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="data.sequences: .*length 128 leaves no sequence of consecutive numbers"):
        resolve("count-rnn", overrides=["data.sequences.length=128"])
    with pytest.raises(UserError, match="add a data.sequences section"):
        validate({"model": {"family": "sequences", "arch": "rnn"}, "sample": {"methods": ["greedy"]}}, "test")
    with pytest.raises(UserError, match="data.sequences is data for another family"):
        resolve("smoke", overrides=["data.sequences.task=count"])


@pytest.mark.parametrize("from_scratch", [False, True])
def test_a_counting_rnn_learns_to_count_and_samples_the_next_number(from_scratch: bool, tmp_path: Path) -> None:
    from mllm.train import train

    cfg = resolve("count-rnn", overrides=[f"model.from_scratch={str(from_scratch).lower()}"])
    made = family_of(cfg).make_data(cfg.data, str(tmp_path))
    assert made["sequences"] == 118
    paths = {
        "train_ids": str(tmp_path / "train.npz"),
        "val_ids": str(tmp_path / "val.npz"),
        "vocab": str(tmp_path / "vocab.json"),
        "tokenizer": str(tmp_path / "tokenizer.json"),
        "checkpoint_dir": str(tmp_path / "ck"),
    }
    job = RunConfig.model_validate({**cfg.to_dict(), "paths": paths})
    result = train(job)
    loaded = load_checkpoint(result.checkpoint)
    assert answer(loaded, ["7 8 9 10", "100 101"]) == ["11", "102"]
    e = family_of(loaded).evaluate(loaded, cfg, _Part(paths["val_ids"]), _Part(paths["train_ids"]), str(tmp_path))
    assert e.headline == "accuracy" and e.higher_is_better and e.value > 0.99
    assert e.metrics["train_accuracy"] > 0.99 and "accuracy, every position" in e.report
    with pytest.raises(UserError, match="not numbers below 128"):
        answer(loaded, ["seven eight"])


class _Part:
    def __init__(self, url: str):
        self.ids = self.parquet = url
