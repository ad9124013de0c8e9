"""The shape of the code that keeps it readable: small modules, a thin checkpoint façade, no import circles.

These read the source as text (nothing is imported or run), so a change that grows a module past the
limit or closes an import circle fails here, naming the file or the circle."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
MAX_MODULE_LINES = 500
MAX_MANAGER_LINES = 300


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The tierio modules ``name`` imports when it is imported (module-level statements only:
    an import inside a function or under ``if TYPE_CHECKING`` runs later or never)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def test_no_module_is_over_the_limit():
    long = {str(p.relative_to(SRC)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by what they hold): {long}"


def test_the_checkpoint_manager_is_a_thin_facade():
    tree = ast.parse((SRC / "tierio/ckpt/manager.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointManager")
    lines = cls.end_lineno - cls.lineno + 1
    assert lines < MAX_MANAGER_LINES, (
        f"CheckpointManager is {lines} lines: it holds the training-loop API only; the work belongs to "
        "the phases (ckpt/saving, promotion, restore, steps)")


def test_no_phase_module_imports_the_manager():
    modules = _modules()
    phases = [m for m in modules if m.startswith(("tierio.ckpt.saving", "tierio.ckpt.promotion",
                                                  "tierio.ckpt.restore", "tierio.ckpt.steps"))]
    assert phases
    bad = [m for m in phases if "tierio.ckpt.manager" in _imports(m, modules[m], modules)]
    assert not bad, f"phase modules importing the manager (wire them by callbacks instead): {bad}"


def test_no_import_circle():
    modules = _modules()
    edges = {m: _imports(m, p, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in modules:
        if m not in index:
            visit(m)
    assert not circles, f"import circles (move the shared part down a layer): {circles}"


def test_the_circle_check_sees_a_circle(tmp_path):
    # The check above must be able to fail: two modules importing each other are found.
    pkg = tmp_path / "tierio"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from tierio.b import x\n")
    (pkg / "b.py").write_text("from tierio import a\nx = 1\n")
    modules = {"tierio": pkg / "__init__.py", "tierio.a": pkg / "a.py", "tierio.b": pkg / "b.py"}
    assert _imports("tierio.a", modules["tierio.a"], modules) == {"tierio.b"}
    assert _imports("tierio.b", modules["tierio.b"], modules) == {"tierio.a"}
