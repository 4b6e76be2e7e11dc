"""Every module, file and test that the docs, README, pyproject.toml and the code's own docstrings and
comments name exists: a name left behind by a move sends a reader to nothing."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mllm", "tasks", "flows")
ROOMS = (*PACKAGES, "tests", "benchmarks", "infra", "docs")

# `mllm.data.text.build_tokenizer`, `flows.cli.main:app`: a dotted name under one of the packages.
DOTTED = re.compile(r"(?<![\w./-])((?:mllm|tasks|flows)(?:\.[A-Za-z_]\w*)+)(?::(\w+))?")
# `mllm/data/text.py`, `tests/flows/test_search.py::test_x`, `infra/pools/`: a path in the repository.
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOMS) + r")/[\w./-]*[\w/])(?:::(\w+))?")


# What is made, not shipped: benchmarks' outputs, a worker's env file.
MADE = ("benchmarks/out", "infra/.env")


def _prose(path: Path) -> str:
    """A Python file's comments and docstrings (a name in its code is checked by importing it);
    any other file whole."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    kept = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(text).readline)
        if t.type == tokenize.COMMENT or (t.type == tokenize.STRING and t.string.lstrip("rbfu").startswith('"""'))
    ]
    return "\n".join(kept)


def _texts() -> list[tuple[str, str]]:
    files = [
        ROOT / "README.md",
        ROOT / "pyproject.toml",
        ROOT / "Makefile",
        *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "infra").rglob("*.md")),
    ]
    for room in (*PACKAGES, "benchmarks"):
        files += sorted((ROOT / room).rglob("*.py"))
    return [(str(f.relative_to(ROOT)), _prose(f)) for f in files]


def _defines(module: Path, name: str) -> bool:
    text = module.read_text()
    return (
        re.search(
            rf"^\s*(?:async\s+def|def|class)\s+{name}\b|^\s*{name}\s*[:=]|^\s*(?:from\s+\S+\s+)?import\b.*\b{name}\b",
            text,
            re.M,
        )
        is not None
    )


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _dotted_missing(name: str, attribute: str | None) -> bool:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):  # the longest prefix that is a module
        module = _module_file(parts[:n])
        if module is None:
            continue
        rest = parts[n:] + ([attribute] if attribute else [])
        if not rest or rest[0].startswith("__"):
            return False
        if (module.parent / rest[0]).is_dir() or module.with_name(rest[0] + ".py").is_file():
            return False
        return not _defines(module, rest[0])
    return True


def _path_missing(path: str, test: str | None, where: str = "") -> bool:
    target = ROOT / path.rstrip("/.")
    if any(c in path for c in "*{<") or re.search(r"[A-Z]{3,}", path) or path.startswith(MADE):
        return False  # a pattern, a placeholder (NAME.yaml) or a file made by a run
    if not target.exists() and where.endswith(".md"):
        target = (ROOT / where).parent / path.rstrip("/.")  # a link, relative to its page (docs/benchmarks/)
    if not target.exists():
        return True
    return bool(test) and target.is_file() and not _defines(target, test)


def test_every_module_and_file_named_in_the_docs_and_the_code_exists() -> None:
    missing = []
    for where, text in _texts():
        for m in DOTTED.finditer(text):
            if _dotted_missing(m.group(1), m.group(2)):
                missing.append(f"{where}: {m.group(0)}")
        for m in PATH.finditer(text):
            if re.match(r"[\w.-]*[*{<]", text[m.end() :]):
                continue  # a pattern (mllm/recipes/seq2seq-numbers-*.yaml)
            if _path_missing(m.group(1), m.group(2), where):
                missing.append(f"{where}: {m.group(0)}")
    assert not missing, "names of nothing:\n" + "\n".join(sorted(set(missing)))
