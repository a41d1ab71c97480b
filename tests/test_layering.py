"""Imports point downward only: every tfsparse module imports (at module level or lazily inside
a function) only modules of its own layer or of the layers below it."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tfsparse"

# bottom to top; a module may import anything in its own layer or below
LAYERS = [
    {"_checks", "_registry", "_version", "traffic", "buffers", "files", "banner"},
    {"_tf_private", "ops", "state", "schedules", "space"},
    {"wire"},
    {"collectives"},
    {"compressors", "memory", "runtime", "data"},
    {"aggregators"},
    {"plan", "selection", "timing", "auto", "hierarchy"},
    {"settings", "bucket", "compensation"},
    {"exchange", "exchange_auto", "exchange_build", "exchange_state"},
    {"pipelined", "checkpoint"},
    {"tf_glue"},
    {"strategies", "keras", "run", "network", "cluster", "cli"},
    {"horovod"},  # Horovod's API over the Keras layer (tfsparse.horovod.tensorflow.keras)
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def top_of(module: str) -> str | None:
    """``tfsparse.x.y`` -> ``x`` (the package's first-level part), else None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "tfsparse" and len(parts) > 1 else None


def imports_of(path: Path):
    rel = path.relative_to(PKG.parent).with_suffix("")
    here = list(rel.parts)
    if here[-1] == "__init__":
        here = here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here[:len(here) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import a, b
                    for alias in node.names:
                        yield f"{mod}.{alias.name}"
                    continue
                yield mod
            else:
                yield node.module


MODULES = sorted(p for p in PKG.rglob("*.py") if p.name != "__init__.py" or p.parent != PKG)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PKG)))
def test_imports_point_downward(path):
    own = top_of(".".join(("tfsparse",) + path.relative_to(PKG).with_suffix("").parts))
    assert own in LEVEL, f"{path}: add its layer to LAYERS"
    for target in imports_of(path):
        other = top_of(target)
        if other is None or other == own:
            continue
        assert other in LEVEL, f"{path} imports {target}: unknown layer"
        assert LEVEL[other] <= LEVEL[own], f"{path.relative_to(PKG)} ({own}) imports {target} ({other}), a layer above"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict:
    """Each tfsparse module's tfsparse imports (module level or lazy), as the modules they name
    (``from .a import b`` names ``a`` unless ``a.b`` is a module); a package's own
    ``__init__`` left out of its submodules' edges (importing ``x.y`` runs ``x`` first anyway)."""
    names = {_module_name(p) for p in PKG.rglob("*.py")}

    def module(target: str) -> str | None:
        parts = target.split(".")
        return next((".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in names), None)

    graph = {}
    for path in PKG.rglob("*.py"):
        me = _module_name(path)
        graph[me] = {m for t in imports_of(path) if t and t.startswith("tfsparse")
                     for m in [module(t)] if m and m != me and not me.startswith(m + ".")}
    return graph


def circles(graph: dict) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
                on.discard(part[-1])
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_inside_a_layer():
    """The layers allow imports within a layer; no set of modules may import each other in a
    circle (lazy imports included), which a lazy import would otherwise hide."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    assert circles(import_graph()) == []


def test_private_tensorflow_and_keras_only_in_tf_private():
    """``tensorflow.python`` and ``keras.src`` (private) are imported by ``_tf_private`` alone;
    every other module uses the public API or a named function of that module."""
    for path in MODULES:
        if path.name == "_tf_private.py":
            continue
        private = [t for t in imports_of(path) if t and t.startswith(("tensorflow.python", "keras.src"))]
        assert private == [], f"{path.relative_to(PKG)} imports {private}; put it behind a function in _tf_private.py"


@pytest.mark.parametrize("statement", ["import tfsparse", "from tfsparse import collectives, aggregators, exchange"])
def test_import_tfsparse_stays_cheap(statement):
    """``import tfsparse`` and the numpy-level parts import neither TensorFlow nor Keras (seconds)."""
    import subprocess
    import sys

    code = f"import sys\n{statement}\nprint(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


@pytest.mark.parametrize("statement", ["import tfsparse.keras", "tfsparse.SparseStrategy"])
def test_keras_classes_register_at_import_of_tfsparse_keras(statement):
    """tfsparse's Keras classes register with Keras' serialization at import of tfsparse.keras
    (``@keras.saving.register_keras_serializable``), which the strategy imports too;
    ``import tfsparse`` alone registers nothing and installs no import hook."""
    import subprocess
    import sys

    code = ("import sys\nimport tfsparse\n"
            "print(any(type(f).__module__.startswith('tfsparse') for f in sys.meta_path))\nimport keras\n"
            "print(keras.saving.get_registered_object('tfsparse>DistributedOptimizer'))\n"
            f"{statement}\n"
            "cls = keras.saving.get_registered_object('tfsparse>DistributedOptimizer')\n"
            "print(cls.__module__ + '.' + cls.__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-3:] == ["False", "None", "tfsparse.keras.optimizer.DistributedOptimizer"]


def test_modules_and_classes_stay_small():
    """Modules by concern (the kernels by family, the engine's build, state and auto apart): no
    module of the package over 800 lines, no class over 300."""
    too_long = []
    for path in sorted(PKG.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PKG.parent))
        if text.count("\n") > 800:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 300:
                too_long.append(f"{name}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
