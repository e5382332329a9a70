"""The package's shape, as docs/architecture.md states it: module-level imports form no cycle, the
layers import only downward, and no file or class grows past the size a reader can hold."""

from __future__ import annotations

import ast
import os

import zengine

ROOT = os.path.dirname(os.path.abspath(zengine.__file__))
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
# Who may import whom at module level (a package is named by its folder under zengine/).
FORBIDDEN = {
    "offload": {"zero", "engine", "activation"},  # zero/ builds on offload/, never the reverse
    "device": {"zero", "engine", "offload", "checkpoint", "activation"},  # offload/ builds on it
    "distributed": {"zero", "engine", "offload", "checkpoint", "device", "activation"},
    "precision": {"zero", "engine", "offload"},
    "ops": {"zero", "engine", "offload", "distributed", "device"},
    "config": {"zero", "engine", "offload", "elasticity", "device", "activation"},
    "activation": {"zero", "engine", "offload", "checkpoint"},  # the engine applies its settings
    "zero": {"engine"},  # the engine drives zero/; zero/ calls back only what it is given
}
# DeepSpeed's public names (docs/API.md): thin faces over the layers, for users. No module inside a
# package imports one at module level; the package imports the implementation the face re-exports.
FACES = {
    "api",
    "comm",
    "accelerator",
    "checkpointing",
    "compat",
    "elasticity",
    "utils",
    "runtime",
    "moe",
}
# Faces whose implementation lives in a layer (zengine/device/, zengine/activation/): names only.
REEXPORTING_FACES = ("accelerator", "checkpointing")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _module_level_imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """zengine modules imported at module level (not inside functions, not under TYPE_CHECKING)."""
    tree = ast.parse(open(path).read())
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try)):
                visit(
                    node.body
                    + node.orelse
                    + getattr(node, "finalbody", [])
                    + [n for h in getattr(node, "handlers", []) for n in h.body]
                )
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("zengine"))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
                if not base.startswith("zengine"):
                    continue
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in modules else base)

    visit(tree.body)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _module_level_imports(name, path, modules) for name, path in modules.items()}


def _with_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: edges to them too."""
    out = {}
    for name, deps in graph.items():
        full = set(deps)
        for dep in deps:
            parts = dep.split(".")
            full.update(
                ".".join(parts[:i]) for i in range(2, len(parts)) if ".".join(parts[:i]) in graph
            )
        out[name] = full - {name}
    return out


def test_no_module_level_import_cycle():
    graph = _with_parents(_graph())
    state, stack, cycles = {}, [], []

    def walk(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                if not node.startswith(dep + "."):  # a package's __init__ importing its own modules
                    cycles.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                walk(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            walk(node)
    assert not cycles, "module-level import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_layers_import_downward():
    wrong = []
    for name, deps in _graph().items():
        layer = name.split(".")[1] if name.count(".") else ""
        for dep in deps:
            target = dep.split(".")[1] if dep.count(".") else ""
            if target in FORBIDDEN.get(layer, ()):
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the layering (docs/architecture.md):\n" + "\n".join(
        sorted(wrong)
    )


def test_packages_do_not_import_the_faces():
    modules = _modules()
    wrong = []
    for name, deps in _graph().items():
        parts = name.split(".")
        in_package = len(parts) > 2 or modules[name].endswith("__init__.py")
        if len(parts) < 2 or parts[1] in FACES or not in_package:
            continue  # zengine/__init__, the top-level modules and the faces themselves
        faces = [dep for dep in deps if dep.count(".") and dep.split(".")[1] in FACES]
        wrong += [f"{name} imports {face}" for face in faces]
    assert not wrong, (
        "package modules importing a DeepSpeed face instead of its layer:\n"
        + "\n".join(sorted(wrong))
    )


def test_reexporting_faces_define_nothing():
    defined = []
    for face in REEXPORTING_FACES:
        tree = ast.parse(open(os.path.join(ROOT, face + ".py")).read())
        defined += [
            f"zengine.{face}.{node.name}"
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
    assert not defined, "defined in a face instead of its layer: " + ", ".join(defined)


def test_files_and_classes_stay_readable():
    big = []
    for name, path in _modules().items():
        source = open(path).read()
        lines = source.count("\n")
        if lines > MAX_FILE_LINES:
            big.append(f"{name}: {lines} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.ClassDef)
                and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES
            ):
                big.append(
                    f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines (at most {MAX_CLASS_LINES})"
                )
    assert not big, "\n".join(big)
