"""What a many-file corpus is made of, as the download stage records it: which files are read
(hidden files and writers' markers left out, and named), and which share their bytes with
another (read once, and named)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from prefect import flow

from flows.artifacts.pipeline import files_line
from mllm.data import files
from tasks.data.download import corpus_changes, download_files, record_corpus
from tasks.model import Prepared


def _write(folder: Path, names: dict[str, str]) -> None:
    for name, text in names.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_names_with_an_underscore_are_read_and_only_hidden_files_and_writers_markers_are_left_out(
    tmp_path: Path,
) -> None:
    src = tmp_path / "lib"
    _write(
        src,
        {
            "os.py": "import sys\n",
            "__init__.py": "x = 1\n",
            "pkg/__init__.py": "y = 2\n",
            "_collections_abc.py": "z = 3\n",
            "__pycache__/os.cpython-311.pyc": "bytecode",
            # Hadoop, Spark, Parquet and Databricks bookkeeping; dot files.
            "_SUCCESS": "",
            "_committed_8341": "{}",
            "_started_8341": "",
            "_metadata": "summary",
            "_temporary/0/part-0.txt": "unfinished",
            "_delta_log/0000.json": "{}",
            ".DS_Store": "x",
            ".git/HEAD": "ref",
            "pkg/.hidden.py": "h",
        },
    )
    found, skipped = files.list_files([str(src)])
    assert sorted(Path(f.url).relative_to(src).as_posix() for f in found) == [
        "__init__.py",
        "__pycache__/os.cpython-311.pyc",
        "_collections_abc.py",
        "os.py",
        "pkg/__init__.py",
    ]
    assert sorted(Path(s).relative_to(src).as_posix() for s in skipped) == [
        ".DS_Store",
        ".git/HEAD",
        "_SUCCESS",
        "_committed_8341",
        "_delta_log/0000.json",
        "_metadata",
        "_started_8341",
        "_temporary/0/part-0.txt",
        "pkg/.hidden.py",
    ]
    # A glob that names such files is taken at its word.
    found, skipped = files.list_files([str(src / "**" / "__init__.py")])
    assert sorted(Path(f.url).relative_to(src).as_posix() for f in found) == ["__init__.py", "pkg/__init__.py"]
    found, _ = files.list_files([str(src / "_SUCCESS"), str(src / "**" / ".hidden.py")])
    assert sorted(Path(f.url).name for f in found) == [".hidden.py", "_SUCCESS"]


@pytest.mark.integration  # runs Prefect tasks on the session's server
def test_the_manifest_names_the_files_left_out_and_every_duplicate_beside_the_one_kept(tmp_path: Path, caplog) -> None:
    src, root = tmp_path / "books", str(tmp_path / "storage")
    _write(
        src,
        {
            "a.txt": "the same words\n" * 50,
            "b.txt": "the same words\n" * 50,
            "c/a.txt": "the same words\n" * 50,
            "d.txt": "other words\n" * 50,
            "_SUCCESS": "",
        },
    )
    found, hidden = files.list_files([str(src)])
    records = download_files.fn(found, "text", "fail", root)
    with caplog.at_level(logging.INFO):
        raw = flow(name="record-corpus-test")(lambda: record_corpus(records, [str(src)], None, root, hidden))()
    said = [r.getMessage() for r in caplog.records if "same bytes" in r.getMessage()]
    assert said == [
        (
            f"2 files hold the same bytes as another, read once: {src / 'b.txt'} = {src / 'a.txt'}, "
            f"{src / 'c' / 'a.txt'} = {src / 'a.txt'} (every name in the corpus manifest {raw.manifest})"
        )
    ], said

    manifest = json.loads(Path(raw.manifest).read_text())
    assert sorted(Path(f["source"]).name for f in manifest["files"]) == ["a.txt", "d.txt"]
    assert manifest["duplicates"] == {str(src / "a.txt"): [str(src / "b.txt"), str(src / "c" / "a.txt")]}
    assert manifest["skipped"] == [{"source": str(src / "_SUCCESS"), "reason": "a hidden or marker file"}]
    assert (raw.files, raw.duplicates, raw.skipped) == (2, 2, [f"{src / '_SUCCESS'}: a hidden or marker file"])

    # What goes to MLflow as corpus.* and into the run's summary counts both.
    data = Prepared.model_construct(
        raw_manifest=raw.manifest,
        raw_previous=None,
        raw_skipped=raw.skipped,
        raw_duplicates=raw.duplicates,
        tokens=type("T", (), {"files_tokenized": 2})(),
    )
    changes = corpus_changes(data, root)
    assert (changes["files"], changes["skipped"], changes["duplicates"]) == (2, 1, 2)
    assert files_line(changes).endswith("; 2 the same bytes as another, read once; 1 left out")


def test_a_corpus_that_loses_characters_to_the_tokenizer_says_how_many_and_which(tmp_path: Path) -> None:
    from mllm.config import TokenizerConfig
    from mllm.data import packs
    from mllm.data.text import build_tokenizer
    from tasks.data import Tokens
    from tasks.data.tokenize import Loss, dropped_line

    prose, code = tmp_path / "prose.txt", tmp_path / "code.txt"
    prose.write_text("It was the best of times, it was the worst of times. " * 40)
    code.write_text('def main(args):\n    return {"x": args[0]}\n' * 40)
    (tmp_path / "pack").mkdir()
    tok = build_tokenizer(TokenizerConfig(kind="char", normalize=True))
    packed = packs.tokenize_pack([("p", str(prose)), ("c", str(code))], tok, str(tmp_path / "pack"), False, 4096)
    by = {p.sha256: p for p in packed}
    assert (by["p"].chars, by["p"].lost) == (len(prose.read_text()), {})
    assert by["c"].chars == len(code.read_text()) and by["c"].lost["\n"] == 80 and by["c"].lost["("] == 40

    def tokens(files) -> Tokens:
        loss = Loss()
        for p in files:
            loss.add({"chars": p.chars, "lost": p.lost})
        return Tokens(
            key="k",
            url="u",
            tokenizer="t",
            n_tokens=sum(p.tokens for p in files),
            n_chunks=1,
            raw_sha256="r",
            **loss.fields(),
        )

    assert dropped_line(tokens([by["p"]])) is None
    both = tokens(packed)
    share = 1 - both.n_tokens / both.chars
    assert both.dropped_share() == pytest.approx(share) and share > 0.1
    line = dropped_line(both)
    assert line.startswith(
        f"the tokenizer's normalisation dropped {share:.1%} of the corpus's characters "
        "(most: runs of whitespace 4.2%, '\"' 2.1%, ':' 2.1%, '(' 1.1%"
    )
    assert "data.tokenizer.normalize=false" in line and "\n" not in line
    # A file tokenized before the loss was measured leaves the corpus's unknown, never understated.
    assert Loss().fields() == {} and tokens([by["c"], packs.PackedFile("old", 1, 5, 1)]).dropped_share() is None
