"""The shape of the code, kept: no module reads another object's private state, the text speaks of
the project alone, and no core module outgrows what a reader takes in at once."""

import ast
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
CODE = [ROOT / "pagedjax", ROOT / "scripts"]
# NamedTuple's public API, and jaxlib's host cost analysis of a compiled GPU module (pagedjax.aot:
# jaxlib offers no public way to run it without a GPU)
ALLOWED = {"_replace", "_asdict", "_fields", "_make"}
ALLOWED_AT = {("pagedjax/aot.py", "xla_client._xla")}
CORE = ["pagedjax/engine.py", "pagedjax/llm.py", "pagedjax/runner.py", "pagedjax/model/llama.py",
        "pagedjax/scheduler", "pagedjax/attention"]


def python_files():
    for base in CODE:
        yield from sorted(base.rglob("*.py"))


def test_no_module_reads_another_objects_private_attributes():
    reaches = []
    for f in python_files():
        rel = f.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if node.attr in ALLOWED or (rel, ast.unparse(node)) in ALLOWED_AT:
                    continue
                reaches.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pagedjax"):
                reaches += [f"{rel}:{node.lineno}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    assert not reaches, "\n".join(reaches)


def test_the_text_points_at_nothing_outside_the_repository():
    # files a reader of the repository does not have, and issue numbers of a tracker it does not see
    pattern = r"shared/|PLATFORM\.md|DESIGN\.md|STYLE\.md|background text|issue [0-9]+|issue #"
    out = subprocess.run(["git", "grep", "-n", "-i", "-E", pattern, "--", ".", ":!tests/test_structure.py"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1 and not out.stdout, out.stdout


def test_core_modules_stay_small():
    sizes = {}
    for entry in CORE:
        path = ROOT / entry
        for f in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            sizes[f.relative_to(ROOT).as_posix()] = len(f.read_text().splitlines())
    too_big = {f: n for f, n in sizes.items() if n > 450}
    assert not too_big, too_big


def test_the_architecture_page_names_files_that_exist():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    for path in set(re.findall(r"`(pagedjax/[\w/]+\.py)", text)):
        assert (ROOT / path).is_file(), path
