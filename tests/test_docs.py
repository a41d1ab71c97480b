"""The documentation: the site (mkdocs.yml, pages in docs/, the API reference mkdocstrings renders
from the docstrings) builds with ``mkdocs build --strict`` -- a broken link, a missing anchor or a
docstring the reference cannot render fails -- and the README stays a short front page whose
relative links all point to files of this repository."""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_README_LINES = 260
DOC_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


needs_doc_tools = pytest.mark.skipif(
    not all(_installed(m) for m in DOC_TOOLS),
    reason="needs MkDocs, Material for MkDocs and mkdocstrings[python] (bash tools/install.sh installs them)")


@needs_doc_tools
def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
    # the API reference was rendered from the docstrings, not left empty
    reference = (tmp_path / "site" / "api" / "strategies" / "index.html").read_text()
    assert "SparseStrategy" in reference and "doc-heading" in reference


def test_the_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, (f"README.md has {lines} lines (at most {MAX_README_LINES}): "
                                       "move the details into a page of docs/")


# [text](target) and ![alt](target), outside fenced code blocks; <...> autolinks are not relative
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _relative_links(text: str):
    in_fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        for target in _LINK.findall(line):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http:, https:, mailto: ... and anchors within the README
            yield number, target


def test_every_relative_link_of_the_readme_points_to_a_file():
    links = list(_relative_links(README.read_text()))
    assert links, "the README links into docs/"
    missing = [(number, target) for number, target in links
               if not (REPO / target.split("#", 1)[0]).exists()]
    assert not missing, f"README.md links to files that do not exist (line, target): {missing}"


def test_the_link_check_sees_a_broken_link():
    found = list(_relative_links("see [a page](docs/nope.md#x) and ![fig](docs/a.png)\n"
                                 "```\n[not a link](inside/a/fence.md)\n```\n[web](https://example.org) [here](#top)\n"))
    assert found == [(1, "docs/nope.md#x"), (1, "docs/a.png")]


USER_PAGES = sorted((REPO / "docs").glob("*.md")) + [README]
HEX = re.compile(r"(?<![\w/.#-])([0-9a-f]{7,40})(?![\w/.-])")
#: words about how the project is made, not about using it
PROCESS_WORDS = ("the issue's", "this session", "the session", " lent ")


def _commits(tokens: set) -> set:
    """The tokens that name a commit of this repository (all of them where git cannot tell)."""
    found = set()
    for token in tokens:
        done = subprocess.run(["git", "cat-file", "-e", f"{token}^{{commit}}"], cwd=REPO, capture_output=True)
        if done.returncode == 0 or (done.returncode != 1 and b"Not a valid" not in done.stderr):
            found.add(token)
    return found


def test_user_pages_hold_no_commit_hashes_or_process_words():
    """The pages say what is, with the command that reproduces each figure; what was measured at
    which commit stays in git and the CHANGELOG."""
    problems = []
    for page in USER_PAGES:
        text = page.read_text()
        tokens = {t for t in HEX.findall(text) if re.search(r"\d", t) and re.search(r"[a-f]", t)}
        for token in sorted(_commits(tokens)):
            problems.append(f"{page.relative_to(REPO)}: commit {token}")
        lowered = text.lower()
        problems += [f"{page.relative_to(REPO)}: {word.strip()!r}" for word in PROCESS_WORDS if word in lowered]
    assert not problems, "\n".join(problems)


def _doc_commands():
    """Every command of record in the pages' code blocks (``# = `` lines included), its
    continuation lines joined, comments dropped: (page, command words)."""
    import shlex

    found = []
    for page in USER_PAGES:
        blocks = re.findall(r"^[ \t]*```([\w-]*)[ \t]*\n(.*?)^[ \t]*```", page.read_text(), flags=re.S | re.M)
        for language, block in blocks:
            if language not in ("", "bash", "sh", "console", "shell"):
                continue  # output, a hostfile, Python
            lines, joined = block.splitlines(), []
            for line in lines:
                line = re.sub(r"^\s*#\s*=\s*", "", line)  # "# = command": the command a step runs
                if joined and joined[-1].endswith("\\"):
                    joined[-1] = joined[-1][:-1] + " " + line.strip()
                else:
                    joined.append(line.strip())
            for line in joined:
                if not re.match(r"(tfsparse-run |tfsparse |python (tools|keras_examples)/|bash tools/|make )\S", line):
                    continue
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:  # an open quote: a JSON list spread over lines
                    words = shlex.split(line.split("'")[0], comments=True)
                words = ["4" if re.fullmatch(r"\$\{?\w+\}?", w) else w for w in words]  # $SLURM_NTASKS
                found.append((page.relative_to(REPO), words))
    return found


def test_the_commands_in_the_pages_still_run():
    """What a page tells the reader to type still exists and parses: ``tfsparse-run``'s flags (and
    the script it starts), the tools' and examples' scripts (``--help``), ``measure_docs.sh``'s
    steps, the Makefile's targets."""
    from tfsparse import run

    commands = _doc_commands()
    assert len(commands) > 20
    steps = subprocess.run(["bash", "tools/measure_docs.sh", "--list"], cwd=REPO, capture_output=True, text=True,
                           timeout=60).stdout
    targets = set(re.findall(r"^([a-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    scripts, problems = set(), []
    for page, words in commands:
        if words[0] == "tfsparse-run":
            try:
                own, _, program = run.split_argv(words[1:])
                run.make_parser().parse_args(own)
            except (ValueError, SystemExit) as e:
                problems.append(f"{page}: {' '.join(words)}: {e}")
                continue
            words = program
        if words[:1] == ["tfsparse"]:
            if words[1:2] not in (["warmup"], ["--version"]):
                problems.append(f"{page}: {' '.join(words)}: no such tfsparse command")
        elif words[:1] == ["bash"] and words[1] == "tools/measure_docs.sh":
            if words[2:] and f"{words[2]}:" not in steps:
                problems.append(f"{page}: measure_docs.sh has no step {words[2]!r}")
        elif words[:1] == ["bash"]:
            if not (REPO / words[1]).is_file():
                problems.append(f"{page}: no script {words[1]}")
        elif words[:1] == ["make"]:
            if words[1] not in targets:
                problems.append(f"{page}: the Makefile has no target {words[1]!r}")
        elif words[:1] == ["python"] and len(words) > 1 and words[1].startswith(("tools/", "keras_examples/")):
            if not (REPO / words[1]).is_file():
                problems.append(f"{page}: no script {words[1]}")
            else:
                scripts.add(words[1])
    for script in sorted(scripts):
        done = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if done.returncode != 0:
            problems.append(f"{script} --help failed: {done.stderr[-500:]}")
    assert not problems, "\n".join(problems)


def _public_api():
    """(name, object) of the API users call: ``tfsparse``'s and ``tfsparse.keras``' exports, the
    public callbacks of ``tfsparse.keras.callbacks``, ``tfsparse.data``'s functions and classes,
    and what the Horovod modules provide
    (``horovod.tensorflow``'s, ``horovod.tensorflow.keras``' and its callbacks' names)."""
    import inspect

    import tfsparse
    import tfsparse.data as data
    import tfsparse.horovod.tensorflow as hvd
    import tfsparse.horovod.tensorflow.keras as hvd_keras
    import tfsparse.horovod.tensorflow.keras.callbacks as hvd_callbacks
    import tfsparse.keras
    import tfsparse.keras.callbacks as callbacks

    found = [(f"tfsparse.{n}", getattr(tfsparse, n)) for n in tfsparse.__all__]
    found += [(f"tfsparse.keras.{n}", getattr(tfsparse.keras, n)) for n in tfsparse.keras.__all__]
    found += [(f"tfsparse.keras.callbacks.{n}", o) for n, o in vars(callbacks).items()
              if not n.startswith("_") and (inspect.isclass(o) or inspect.isfunction(o))
              and o.__module__ == callbacks.__name__]
    found += [(f"tfsparse.data.{n}", o) for n, o in vars(data).items() if not n.startswith("_")
              and (inspect.isclass(o) or inspect.isfunction(o)) and o.__module__ == data.__name__]
    for module in (hvd, hvd_keras, hvd_callbacks):
        found += [(f"{module.__name__}.{n}", getattr(module, n)) for n in module._PROVIDED]
    found += [("tfsparse.horovod.tensorflow.keras.HorovodOptimizer", hvd_keras.HorovodOptimizer)]
    return [(n, o) for n, o in found if inspect.isclass(o) or inspect.isfunction(o)]


def _parameters(obj) -> list:
    import inspect

    target = obj.__init__ if inspect.isclass(obj) else obj
    if inspect.isclass(obj) and "__init__" not in {k for c in obj.__mro__ if c.__module__.startswith("tfsparse")
                                                    for k in vars(c)}:
        return []  # a constructor of TensorFlow's, Keras' or Python's
    return [p for p in inspect.signature(target).parameters if p != "self"]


def test_the_public_api_documents_its_arguments_and_results():
    """Every object of the public API has a docstring whose first line is a summary; one that
    takes arguments lists them under ``Args:`` (mkdocstrings renders them as a table); a
    function that returns something says what under ``Returns:`` (a dataclass lists its fields
    under ``Attributes:``)."""
    import dataclasses
    import inspect

    api = _public_api()
    assert len(api) >= 25, [n for n, _ in api]
    missing = []
    for name, obj in api:
        doc = inspect.getdoc(obj) or ""
        if not doc.strip() or not doc.splitlines()[0].strip():
            missing.append(f"{name}: no summary line")
            continue
        fields = dataclasses.is_dataclass(obj) and "Attributes:" in doc  # a dataclass: its fields
        if _parameters(obj) and not fields:
            listed = doc.split("Args:", 1)[1] if "Args:" in doc else ""
            unnamed = [p for p in _parameters(obj) if not re.search(rf"^\s+\**{p}:", listed, re.M)]
            if unnamed:
                missing.append(f"{name}: Args: lacks {', '.join(unnamed)}")
        if inspect.isfunction(obj) and inspect.signature(obj).return_annotation not in (None, "None") \
                and "Returns:" not in doc:
            missing.append(f"{name}: no Returns:")
    assert not missing, "\n".join(missing)


# a paper's measurements (gtopk-ssgd-shi2019 §V-C), quoted where the α-β model is defined
_CITING_MODULES = ("tfsparse.collectives.alphabeta",)


def _docstrings(path: Path, module: str):
    """(qualified name, docstring) of a module and its public classes, functions and methods."""
    import ast

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                yield f"{prefix}.{child.name}", ast.get_docstring(child) or ""
                yield from walk(child, f"{prefix}.{child.name}")

    tree = ast.parse(path.read_text())
    yield module, ast.get_docstring(tree) or ""
    yield from walk(tree, module)


def test_public_docstrings_carry_no_measured_times():
    """Measurements live in the benchmark records and the pages that cite them, not in the
    docstrings the API reference renders (they go stale, and tie the text to one machine).
    Literal text (````50us````, doctest lines) is a setting, not a measurement; so are most
    seconds and bit rates in prose (a timeout of 10 s, a 1 Gbit/s link), which this test leaves
    to review."""
    timed = re.compile(r"\d(\.\d+)? ?(ms|us|µs)\b")
    found = []
    for path in sorted((REPO / "tfsparse").rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        if any(p.startswith("_") and p != "__init__" for p in parts):
            continue  # private modules: not rendered
        module = ".".join(p for p in parts if p != "__init__")
        if module.startswith(_CITING_MODULES):
            continue
        for name, doc in _docstrings(path, module):
            prose = "\n".join(line for line in re.sub(r"``.*?``", "", doc, flags=re.S).splitlines()
                               if not line.lstrip().startswith(">>>"))
            hit = timed.search(prose)
            if hit:
                found.append(f"{name}: {hit.group(0)}")
    assert not found, "\n".join(found)
