"""The layers and rooms: cli -> flows -> tasks -> mllm, no circle between modules, mllm runs
without Prefect or MLflow, and an import inside a function only where a reason is written down."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mllm", "tasks", "flows")

# Modules that import project modules inside functions, and why (measured where it is time).
# Everywhere else an import is at the top of its module.
LAZY = {
    "flows/cli/console.py": "the console script sets up the environment before the commands, and Prefect "
    "with them, are imported: Prefect reads DO_NOT_TRACK and its settings when imported",
    "flows/cli/pipeline.py": "its commands import Prefect's flows and mllm's models (torch) when they run: "
    "--help answers in under a second instead of 2.5 s",
    "flows/cli/runs.py": "MLflow (1.5 s) only for the command that reads runs",
    "flows/cli/exporting.py": "MLflow, torch and the export libraries only when an export runs",
    "flows/cli/servers.py": "Prefect's client only for the command that drives a server",
    "flows/cli/search.py": "Optuna and Prefect's flows only when a search runs",
    "flows/cli/sweep.py": "Prefect's flows only when a sweep runs: --help answers without them",
    "flows/cli/terminal.py": "flows.pipeline (Prefect, several seconds) on a command's first flow",
    "flows/launch.py": "Prefect and MLflow off the CLI's fast paths (the preflight checks)",
    "flows/settings.py": "the other layers' settings only to write the docs' table",
    "flows/history/runs.py": "torch only to sample from a run",
    "mllm/resolve.py": "mllm.families.base brings torch (2.4 s), which listing recipes has no use for",
    "mllm/families/lm.py": "the registry imports every family to find one: a family's models and data load when it runs",
    "mllm/families/embeddings.py": "as mllm/lm: gensim's evaluation sets load when the family runs",
    "mllm/families/seq2seq.py": "as mllm/lm: sacrebleu and num2words load when the family runs",
    "mllm/families/sequences.py": "as mllm/lm",
    "mllm/data/text.py": "tiktoken on a BPE tokenizer's first encode; its source is part of the tokenize key",
    "mllm/data/splits.py": "its source is part of the split stage's key, so it stays as written",
    "tasks/data/pairs.py": "mllm.seq2seq brings torch, which the text stages' worker processes do not need",
    "tasks/tracking/served_model.py": "the registry imports it for its file; torch loads with a model",
}


def _modules() -> dict[str, Path]:
    found = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (at the top or inside a function)."""

    def resolve(target: str) -> str | None:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return target or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            for t in targets:
                if (hit := resolve(t)) and hit != name:
                    edges[name].add(hit)
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other round a circle (Tarjan's strongly
    connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                group.append(w)
            on_stack.discard(v)
            if group:
                found.append(sorted([v, *group]))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_no_circle_between_the_projects_modules() -> None:
    assert circles(_edges(_modules())) == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def _imported(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def _under(folder: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): _imported(p) for p in (ROOT / folder).rglob("*.py")}


def _breaking(imports: dict[str, set[str]], banned: tuple[str, ...]) -> list[str]:
    return sorted(
        f"{path}: {m}"
        for path, mods in imports.items()
        for m in mods
        if any(m == b or m.startswith(b + ".") for b in banned)
    )


def test_imports_point_down_only() -> None:
    # cli -> flows -> tasks -> mllm
    assert _breaking(_under("mllm"), ("prefect", "mlflow", "tasks", "flows")) == []
    assert _breaking(_under("tasks"), ("flows",)) == []
    below_cli = {p: m for p, m in _under("flows").items() if not p.startswith("flows/cli/")}
    assert _breaking(below_cli, ("flows.cli",)) == []


def test_the_tracking_layer_imports_no_stage() -> None:
    # tasks/tracking writes to MLflow what the stages made; it never runs a stage.
    assert _breaking(_under("tasks/tracking"), ("tasks.data", "tasks.model")) == []


def test_importing_every_mllm_module_loads_neither_prefect_nor_mlflow() -> None:
    modules = sorted(m for m in _modules() if m.startswith("mllm.") and not m.endswith("__main__"))
    code = (
        f"import sys\nfor m in {modules!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'tasks', 'flows'))\n"
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_imports_inside_functions_only_where_a_reason_is_written() -> None:
    found = set()
    for path in _modules().values():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                mod = (
                    node.module
                    if isinstance(node, ast.ImportFrom)
                    else node.names[0].name
                    if isinstance(node, ast.Import)
                    else None
                )
                if mod and mod.split(".")[0] in PACKAGES:
                    found.add(str(path.relative_to(ROOT)))
    assert found - set(LAZY) == set(), "import these at the top, or say why not in LAZY"
    assert set(LAZY) - found == set(), "these import at the top now: take them out of LAZY"


def test_the_data_tasks_hold_no_tokenizer_parquet_or_split_logic() -> None:
    # The data work lives in mllm.data; tasks/data only makes it a stage.
    for path in (ROOT / "tasks" / "data").glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = _imported(path)
        assert not {
            m for m in imported if m.split(".")[0] in ("pyarrow", "numpy", "tokenizers", "codecs", "tempfile")
        }, path
        assert not {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} & {"np", "pa", "pq", "pc"}, path


def test_a_built_distribution_holds_every_package() -> None:
    # `pip install .` (the image does it) ships only the packages pyproject names: a subpackage
    # left out imports in an editable install and fails in the container.
    import tomllib

    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(str(ROOT), include=include))
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")
    }
    assert on_disk and on_disk <= shipped, on_disk - shipped
    assert {
        "mllm.lm",
        "mllm.data",
        "mllm.runtime",
        "tasks.data",
        "tasks.tracking",
        "flows.cli",
        "flows.stack",
        "flows.history",
    } <= shipped
