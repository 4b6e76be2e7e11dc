"""Empty files in a corpus of many (issue 64, item 14): left out and counted by default, named all
(or the first ten and a count) under data.bad_files=fail; a source of one empty file stays an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect import flow

from flows.artifacts.pipeline import files_line
from mllm import UserError
from mllm.config import DataConfig
from mllm.data import files, heads
from tasks.data.download import corpus_changes, download_source
from tasks.model import Prepared


def _corpus(folder: Path, empty: int) -> Path:
    folder.mkdir()
    (folder / "a.py").write_text("def main():\n    return 1\n" * 20)
    (folder / "b.py").write_text("import os\nprint(os.sep)\n" * 20)
    for i in range(empty):
        (folder / f"pkg{i:02d}").mkdir()
        (folder / f"pkg{i:02d}" / "__init__.py").write_text("")
    return folder


def test_empty_files_of_many_are_left_out_by_default_and_all_named_under_fail(tmp_path: Path) -> None:
    src = _corpus(tmp_path / "lib", empty=12)
    found, _ = files.list_files([str(src)])
    assert len(heads.empty_files(found, "skip-empty", [str(src)])) == 12
    assert len(heads.empty_files(found, "skip", [str(src)])) == 12
    with pytest.raises(UserError) as refused:
        heads.empty_files(found, "fail", [str(src)])
    message = str(refused.value)
    assert message.startswith(f"12 of the 14 files of {src} are empty: {src / 'pkg00' / '__init__.py'}, ")
    assert all(str(src / f"pkg{i:02d}" / "__init__.py") in message for i in range(10))
    assert "pkg10" not in message and "and 2 more" in message and "data.bad_files=fail" in message
    # Files of nothing but empty ones: nothing to train on, whatever the setting.
    for f in src.rglob("*.py"):
        if f.parent == src:
            f.unlink()
    found, _ = files.list_files([str(src)])
    with pytest.raises(UserError, match=f"all 12 files of {src} are empty"):
        heads.empty_files(found, "skip-empty", [str(src)])
    # One empty file is the source: left to the download stage, which refuses it.
    one = tmp_path / "one.txt"
    one.write_text("")
    assert heads.empty_files(files.list_files([str(one)])[0], "skip-empty", [str(one)]) == []


@pytest.mark.integration  # runs Prefect tasks on the session's server
def test_the_download_stage_records_the_empty_files_it_left_out(tmp_path: Path) -> None:
    src, root = _corpus(tmp_path / "lib", empty=3), str(tmp_path / "storage")
    d = DataConfig(source=str(src))
    assert d.bad_files == "skip-empty"
    raw = flow(name="download-empty-test")(lambda: download_source(d, root))()
    manifest = json.loads(Path(raw.manifest).read_text())
    assert sorted(Path(f["source"]).name for f in manifest["files"]) == ["a.py", "b.py"]
    assert sorted(s["source"] for s in manifest["skipped"]) == [
        str(src / f"pkg{i:02d}" / "__init__.py") for i in range(3)
    ]
    assert {s["reason"] for s in manifest["skipped"]} == {"an empty file"}
    data = Prepared.model_construct(
        raw_manifest=raw.manifest,
        raw_previous=None,
        raw_skipped=raw.skipped,
        raw_duplicates=raw.duplicates,
        tokens=type("T", (), {"files_tokenized": 2})(),
    )
    changes = corpus_changes(data, root)
    assert (changes["files"], changes["skipped"], changes["empty"]) == (2, 3, 3)
    assert files_line(changes).endswith("; 3 left out (3 empty)")
    with pytest.raises(UserError, match="3 of the 5 files of .* are empty"):
        flow(name="download-empty-fail-test")(
            lambda: download_source(DataConfig(source=str(src), bad_files="fail"), root)
        )()
