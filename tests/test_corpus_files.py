"""What a many-file corpus is made of, as the download stage records it: which files are read
(hidden files and writers' markers left out, and named), and which share their bytes with
another (read once, and named)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from flows.pipeline import files_line
from mllm.data import files
from tasks.data.download import corpus_changes, download_files, record_corpus
from tasks.model import Prepared


def _write(folder: Path, names: dict[str, str]) -> None:
    for name, text in names.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)


def test_names_with_an_underscore_are_read_and_only_hidden_files_and_writers_markers_are_left_out(tmp_path: Path) -> None:
    src = tmp_path / "lib"
    _write(src, {"os.py": "import sys\n", "__init__.py": "x = 1\n", "pkg/__init__.py": "y = 2\n",
                 "_collections_abc.py": "z = 3\n", "__pycache__/os.cpython-311.pyc": "bytecode",
                 # Hadoop, Spark, Parquet and Databricks bookkeeping; dot files.
                 "_SUCCESS": "", "_committed_8341": "{}", "_started_8341": "", "_metadata": "summary",
                 "_temporary/0/part-0.txt": "unfinished", "_delta_log/0000.json": "{}", ".DS_Store": "x",
                 ".git/HEAD": "ref", "pkg/.hidden.py": "h"})
    found, skipped = files.list_files([str(src)])
    assert sorted(Path(f.url).relative_to(src).as_posix() for f in found) == [
        "__init__.py", "__pycache__/os.cpython-311.pyc", "_collections_abc.py", "os.py", "pkg/__init__.py"]
    assert sorted(Path(s).relative_to(src).as_posix() for s in skipped) == [
        ".DS_Store", ".git/HEAD", "_SUCCESS", "_committed_8341", "_delta_log/0000.json", "_metadata",
        "_started_8341", "_temporary/0/part-0.txt", "pkg/.hidden.py"]
    # A glob that names such files is taken at its word.
    found, skipped = files.list_files([str(src / "**" / "__init__.py")])
    assert sorted(Path(f.url).relative_to(src).as_posix() for f in found) == ["__init__.py", "pkg/__init__.py"]
    found, _ = files.list_files([str(src / "_SUCCESS"), str(src / "**" / ".hidden.py")])
    assert sorted(Path(f.url).name for f in found) == [".hidden.py", "_SUCCESS"]


@pytest.mark.usefixtures("prefect_server")
def test_the_manifest_names_the_files_left_out_and_every_duplicate_beside_the_one_kept(tmp_path: Path, caplog) -> None:
    src, root = tmp_path / "books", str(tmp_path / "storage")
    _write(src, {"a.txt": "the same words\n" * 50, "b.txt": "the same words\n" * 50, "c/a.txt": "the same words\n" * 50,
                 "d.txt": "other words\n" * 50, "_SUCCESS": ""})
    found, hidden = files.list_files([str(src)])
    records = download_files.fn(found, "text", "fail", root)
    with caplog.at_level(logging.INFO):
        raw = record_corpus(records, [str(src)], None, root, hidden)
    said = [r.getMessage() for r in caplog.records if "same bytes" in r.getMessage()]
    assert said == [(f"2 files hold the same bytes as another, read once: {src / 'b.txt'} = {src / 'a.txt'}, "
                     f"{src / 'c' / 'a.txt'} = {src / 'a.txt'} (every name in the corpus manifest {raw.manifest})")], said

    manifest = json.loads(Path(raw.manifest).read_text())
    assert sorted(Path(f["source"]).name for f in manifest["files"]) == ["a.txt", "d.txt"]
    assert manifest["duplicates"] == {str(src / "a.txt"): [str(src / "b.txt"), str(src / "c" / "a.txt")]}
    assert manifest["skipped"] == [{"source": str(src / "_SUCCESS"), "reason": "a hidden or marker file"}]
    assert (raw.files, raw.duplicates, raw.skipped) == (2, 2, [f"{src / '_SUCCESS'}: a hidden or marker file"])

    # What goes to MLflow as corpus.* and into the run's summary counts both.
    data = Prepared.model_construct(raw_manifest=raw.manifest, raw_previous=None, raw_skipped=raw.skipped,
                                    raw_duplicates=raw.duplicates,
                                    tokens=type("T", (), {"files_tokenized": 2})())
    changes = corpus_changes(data, root)
    assert (changes["files"], changes["skipped"], changes["duplicates"]) == (2, 1, 2)
    assert files_line(changes).endswith("; 2 the same bytes as another, read once; 1 left out")
