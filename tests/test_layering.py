"""Imports point downward only: every tfsparse module imports (at module level or lazily inside
a function) only modules of its own layer or of the layers below it."""
import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "tfsparse"

# bottom to top; a module may import anything in its own layer or below
LAYERS = [
    {"_checks"},
    {"_tf_private", "ops", "state", "schedules", "space"},
    {"wire"},
    {"collectives"},
    {"compressors", "memory", "runtime", "data"},
    {"aggregators"},
    {"plan", "selection"},
    {"exchange"},
    {"strategies", "keras", "run", "network", "_keras_registration"},
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


@pytest.mark.parametrize("statement", ["import tfsparse", "from tfsparse import collectives, aggregators, exchange"])
def test_import_tfsparse_stays_cheap(statement):
    """``import tfsparse`` and the numpy-level parts import neither TensorFlow nor Keras (seconds);
    tfsparse's Keras classes register themselves once Keras is imported."""
    import subprocess
    import sys

    code = f"import sys\n{statement}\nprint(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_a_failed_keras_registration_warns_and_leaves_import_keras_working(tmp_path):
    """The registration runs inside the user's ``import keras``: if tfsparse.keras cannot be
    imported (here: a stand-in keras package without Keras' API) ``import keras`` still succeeds,
    with a RuntimeWarning that says what to do."""
    import subprocess
    import sys

    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("VALUE = 7\n")
    code = ("import sys, warnings\nsys.path.insert(0, sys.argv[1])\nimport tfsparse\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n    import keras\n"
            "print(keras.VALUE, 'tfsparse.keras' in sys.modules)\n"
            "print([str(w.message) for w in caught if w.category is RuntimeWarning])\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()[-2:]
    assert first == "7 False"
    assert "tfsparse could not register its Keras objects" in second and "import tfsparse.keras" in second
