"""The package's import structure: every module imports on its own, the static import graph
of ``vllm_lowbit_kv`` has no cycle, and nothing in it imports the benchmarks, the tests or
the serving launcher (arrows point from those to the library, never back)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_lowbit_kv"
#: top-level packages of this repository the library must not import
OUTSIDE = ("bench", "tests", "serving")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _resolve(importer: str, is_package: bool, level: int, target: str | None) -> str:
    """Absolute name of a (possibly relative) import target."""
    if level == 0:
        return target or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _type_checking_only(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return True
    return False


def imports_of(name: str) -> set[str]:
    """Every module name ``name`` imports, at module level or inside functions (a lazy
    import is still an arrow), except under ``if TYPE_CHECKING``."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = _resolve(name, path.name == "__init__.py", node.level, node.module)
            found.add(mod)
            # "from pkg import sub" imports the submodule pkg.sub when there is one
            found.update(f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in MODULES)
    return found


def internal_graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        edges = set()
        for target in imports_of(name):
            # importing a.b.c runs a and a.b first; only the deepest module of ours counts
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                edges.add(target)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (cycle := visit(n)):
            return cycle
    return None


def test_static_import_graph_is_acyclic():
    assert find_cycle(internal_graph()) is None, " -> ".join(find_cycle(internal_graph()))


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_library_does_not_import_bench_tests_or_serving():
    bad = {name: sorted(t for t in imports_of(name) if t.split(".")[0] in OUTSIDE)
           for name in MODULES}
    assert {k: v for k, v in bad.items() if v} == {}


#: imports each module named on its command line in a process forked from one that has
#: imported only torch (third-party, and imported by nearly every module: the 5 s of importing
#: it once per module are most of this check's time), as many at a time as there are cores;
#: prints each module's exit code, its traceback in DIR/NAME.err
_IMPORT_EACH = r"""
import importlib, os, sys, traceback
import torch  # noqa: F401
out, names, running = sys.argv[1], sys.argv[2:], {}


def reap():
    pid, status = os.wait()
    print(running.pop(pid), os.waitstatus_to_exitcode(status), flush=True)


for name in names:
    if len(running) >= (os.cpu_count() or 1):
        reap()
    pid = os.fork()
    if pid == 0:
        with open(os.path.join(out, name + ".err"), "w") as err:
            try:
                importlib.import_module(name)
            except BaseException:
                traceback.print_exc(file=err)
                err.flush()
                os._exit(1)
        os._exit(0)
    running[pid] = name
while running:
    reap()
"""


@pytest.fixture(scope="module")
def imported_alone(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """Each module's exit code and traceback, imported in a fresh process of its own."""
    out = tmp_path_factory.mktemp("imports")
    r = subprocess.run([sys.executable, "-c", _IMPORT_EACH, str(out), *sorted(MODULES)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    codes = dict(line.split() for line in r.stdout.splitlines())
    return {name: (int(code), (out / f"{name}.err").read_text()) for name, code in codes.items()}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_imports_alone(name, imported_alone):
    """Each module in a fresh interpreter: no import-order dependence hidden by the others."""
    if name.startswith(f"{PACKAGE}.ops.triton"):
        pytest.importorskip("triton")
    code, traceback = imported_alone[name]
    assert code == 0, traceback[-3000:]
