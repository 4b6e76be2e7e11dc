"""The layers: flows -> tasks -> mllm, and mllm runs without Prefect or MLflow."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_importing_every_mllm_module_loads_neither_prefect_nor_mlflow() -> None:
    modules = sorted(p.stem for p in (ROOT / "mllm").glob("*.py") if p.stem != "__init__")
    code = (f"import sys, mllm\nfor m in {modules!r}: __import__('mllm.' + m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'tasks', 'flows'))\n"
            "print(','.join(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def _imports(folder: str) -> set[str]:
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_imports_point_down_only() -> None:
    assert not _imports("mllm") & {"prefect", "mlflow", "tasks", "flows"}
    assert "flows" not in _imports("tasks")


def test_the_data_tasks_hold_no_tokenizer_parquet_or_split_logic() -> None:
    # The data work lives in mllm (corpus, tokens, splits); tasks/data.py only makes it a stage.
    tree = ast.parse((ROOT / "tasks" / "data.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
    assert not {m for m in imported if m.split(".")[0] in ("pyarrow", "numpy", "tokenizers", "codecs", "tempfile")}
    assert not {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & {"np", "pa", "pq", "pc"}


def test_a_built_distribution_holds_every_package() -> None:
    # `pip install .` (the image does it) ships only the packages pyproject names: a family's
    # subpackage left out imports in an editable install and fails in the container.
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(ROOT), include=include))
    on_disk = {".".join(p.parent.relative_to(ROOT).parts) for top in ("mllm", "tasks", "flows")
               for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk and on_disk <= shipped, on_disk - shipped
    assert {"mllm.lm", "mllm.embeddings", "mllm.seq2seq", "mllm.sequences"} <= shipped
