"""The house rules that hold for the whole tree: ruff is clean and formatted, classes and files stay small, no line
assigns three names, the layers of docs/architecture.md hold
(import-linter), no import cycles, the kernels import nothing of ours but the flags, and the global server
arguments have one setter and are read only by model code."""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean():
    done = run([sys.executable, "-m", "ruff", "check", "."])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_ruff_format_is_clean():
    done = run([sys.executable, "-m", "ruff", "format", "--check", "."])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_import_linter_contracts_are_kept():
    done = run([str(BIN / "lint-imports"), "--no-cache"])  # its cache can outlive an edit
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def test_every_library_module_imports():
    """A module renamed or moved leaves no import of its old name behind: import-linter and grimp pass over an
    import of a module that does not exist, and most modules are imported only by tests that start servers."""
    code = (
        "import importlib, pkgutil, sglang_lite\n"
        "for m in pkgutil.walk_packages(sglang_lite.__path__, 'sglang_lite.'):\n"
        "    if not m.name.endswith('.__main__'):\n"
        "        importlib.import_module(m.name)\n"
    )
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("sglang_lite", exclude_type_checking_imports=False, cache_dir=None)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    counter = itertools.count()

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        for other in edges.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = stack[stack.index(node) :]
            del stack[stack.index(node) :]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_cycle_between_modules_or_packages(graph):
    modules = {m for m in graph.modules if m.startswith("sglang_lite")}
    module_edges = {
        m: {t for t in graph.find_modules_directly_imported_by(m) if t in modules} for m in modules
    }
    assert cycles(module_edges) == []
    package_edges: dict[str, set[str]] = {}
    for module, targets in module_edges.items():
        for target in targets:
            a, b = package_of(module), package_of(target)
            if a != b and "sglang_lite" not in (a, b):
                package_edges.setdefault(a, set()).add(b)
    assert cycles(package_edges) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_engine_and_server_do_not_import_each_other(graph):
    for source, target in (
        ("sglang_lite.engine", "sglang_lite.server"),
        ("sglang_lite.server", "sglang_lite.engine"),
    ):
        assert not graph.chain_exists(source, target, as_packages=True), (
            f"{source} reaches {target}"
        )


def imported_names(path: Path) -> list[tuple[str, int]]:
    """(name, line) of everything a file imports, function-level imports included; relative ones start with '.'."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def test_kernels_import_only_torch_triton_einops_and_the_flags():
    allowed = set(sys.stdlib_module_names) | {"__future__", "torch", "triton", "einops"}
    bad = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for name, line in imported_names(path):
            ours = (
                name.startswith(".")
                or name == "sglang_lite.envs"
                or name.startswith("sglang_lite.envs.")
            )
            if not ours and name.split(".")[0] not in allowed:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert bad == []


def calls_to(name: str) -> list[str]:
    """Files of the library that call or import ``name``."""
    files = []
    for path in sorted((ROOT / "sglang_lite").rglob("*.py")):
        if path.name == "server_args.py":
            continue
        tree = ast.parse(path.read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        if name in names:
            files.append(path.relative_to(ROOT / "sglang_lite").as_posix())
    return files


def test_global_server_args_have_one_setter_and_are_read_by_model_code_only():
    assert calls_to("set_global_server_args") == ["runtime/scheduler_process.py"]
    readers = calls_to("get_global_server_args") + calls_to("server_args_or_default")
    assert readers and all(f.startswith("models/") for f in readers), readers


MAX_CLASS_METHODS = 25
MAX_CLASS_LINES = 350
MAX_FILE_LINES = 450


def library_files() -> list[Path]:
    return sorted((ROOT / "sglang_lite").rglob("*.py"))


def test_classes_and_files_stay_small():
    big = []
    for path in library_files():
        text = path.read_text()
        name = path.relative_to(ROOT)
        if text.count("\n") > MAX_FILE_LINES:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef):
                continue
            methods = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)
            lines = node.end_lineno - node.lineno + 1
            if methods > MAX_CLASS_METHODS or lines > MAX_CLASS_LINES:
                big.append(f"{name}: class {node.name}, {methods} methods, {lines} lines")
    assert big == []


def names_assigned(node: ast.Assign) -> int:
    """Names a statement packs onto one line: chained targets (``a = b = c = 0``) or a tuple of values into
    a tuple of names (``a, b, c = 1, 2, 3``). Unpacking one value (a heap entry, a function's result) is not
    packing."""
    if len(node.targets) > 1:
        return sum(len(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else 1 for t in node.targets)
    (target,) = node.targets
    packed = isinstance(target, (ast.Tuple, ast.List)) and isinstance(
        node.value, (ast.Tuple, ast.List)
    )
    return len(target.elts) if packed else 1


def test_no_statement_assigns_three_names_or_more():
    packed = []
    for path in library_files() + sorted((ROOT / "kernels").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and names_assigned(node) >= 3:
                packed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert packed == []


def test_the_size_rules_see_what_they_count():
    tree = ast.parse("a, b, c = 1, 2, 3\nx = y = z = 0\np, q = 1, 2\nu, v, w = f()\n")
    assert [names_assigned(n) for n in tree.body] == [3, 3, 2, 1]


def test_the_simulator_runs_without_torch():
    code = (
        "import sys; import sglang_lite.sim.cluster, sglang_lite.sim.compare, sglang_lite.sim.fit; "
        "print('torch' in sys.modules)"
    )
    done = run([sys.executable, "-c", code])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_front_ends_import_nothing_from_the_scheduler(graph):
    for front in ("sglang_lite.engine", "sglang_lite.server"):
        modules = {m for m in graph.modules if m == front or m.startswith(front + ".")}
        bad = [
            f"{m} -> {t}"
            for m in sorted(modules)
            for t in graph.find_modules_directly_imported_by(m)
            if t.startswith("sglang_lite.scheduler")
        ]
        assert bad == []
