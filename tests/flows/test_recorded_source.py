"""A run's recorded source, found again by `reproduce` from a folder of its own: relative paths
made absolute when the config is resolved, and a run recorded before that read from its tag."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.history.runs import recorded_source
from mllm import UserError
from mllm.resolve import resolve


def test_a_relative_source_resolves_to_an_absolute_path_and_a_url_stays(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "book.txt").write_text("text\n")
    monkeypatch.chdir(tmp_path / "data")
    assert resolve("smoke", source="book.txt").data.source == str(tmp_path / "data" / "book.txt")
    # The same config whichever way the path was typed: every key made from it (the data stages',
    # keyed by content digests, and the training's) is the same.
    assert resolve("smoke", source="book.txt") == resolve("smoke", source=str(tmp_path / "data" / "book.txt"))
    assert resolve("smoke", source=["../data/*.txt", "s3://b/x.txt"]).data.source == [
        str(tmp_path / "data" / "*.txt"),
        "s3://b/x.txt",
    ]
    assert resolve("smoke", overrides=["data.source=./book.txt"]).data.source == str(tmp_path / "data" / "book.txt")


def test_an_older_run_with_a_relative_source_is_reproduced_from_its_absolute_tag() -> None:
    cfg = {"data": {"source": "../shared/data/warandpeace.txt"}}
    recorded_source(cfg, {"data.source": "/home/u/shared/data/warandpeace.txt"}, "r1")
    assert cfg["data"]["source"] == "/home/u/shared/data/warandpeace.txt"
    absolute = {"data": {"source": "/x/book.txt"}}
    recorded_source(absolute, {"data.source": "/elsewhere.txt"}, "r1")
    assert absolute["data"]["source"] == "/x/book.txt"  # recorded absolute: as it is
    folder = {"data": {"source": ["books/", "s3://b/more/"]}}
    with pytest.raises(
        UserError,
        match=r"relative to the folder it ran in \(books/, s3://b/more/\).*"
        r"--set data.sha256=abc",
    ):
        recorded_source(folder, {"data.source": "books/ and 1 more", "data.raw_sha256": "abc"}, "r1")
