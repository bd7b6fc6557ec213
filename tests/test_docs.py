"""The documentation: the site builds strict, the README stays an overview, docs/layout.md lists every module of the
package, and every repository path that the code's comments and docstrings, the config files and the docs name
exists (so a moved module leaves no stale pointer behind)."""

from __future__ import annotations

import ast
import io
import itertools
import os
import re
import subprocess
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LAYOUT = ROOT / "docs" / "layout.md"
README_MAX_LINES = 400

# A repository path: one of the top-level folders the project's text refers to, then path characters. `{a,b}` lists
# are expanded; `<...>` placeholders and `*` globs are not paths and are skipped.
PATH = re.compile(r"(?<![\w./-])(?:ortflow|conf|recipes|docs|tests|examples|\.ci|hydra_plugins)/[\w./{},*<>-]*")
# Named on purpose although not in the repository, with the reason.
NOT_IN_THE_REPOSITORY = {
    "ortflow/conf": "the wheel's copy of conf/ (pyproject.toml's force-include)",
}
# Where paths are looked for: (glob, whether only comments and docstrings count).
SOURCES = (
    ("ortflow/**/*.py", True),
    ("tests/**/*.py", True),
    ("hydra_plugins/**/*.py", True),
    ("conf/**/*.yaml", False),
    ("recipes/*.yaml", False),
    ("Makefile", False),
    (".ci/run", False),
    ("pyproject.toml", False),
    ("README.md", False),
    ("docs/*.md", False),
    ("mkdocs.yml", False),
)


def test_site_builds_strict(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link or anchor, a page missing from the nav, a missing snippet file fail."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    result = subprocess.run(
        [*command, "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=600,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"


def test_readme_is_an_overview() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_readme_anchors_into_the_docs_exist() -> None:
    problems = []
    for page, anchor in re.findall(r"\]\((docs/[\w.-]+\.md)#([\w-]+)\)", README.read_text()):
        if anchor not in _anchors(ROOT / page):
            problems.append(f"README.md -> {page}#{anchor}")
    assert not problems, "links to headings that do not exist:\n" + "\n".join(problems)


def test_layout_lists_every_module() -> None:
    named = {_strip(m.group(0)) for m in PATH.finditer(LAYOUT.read_text())}
    modules = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "ortflow").rglob("*.py"))
    packages = sorted({m.rsplit("/", 1)[0] + "/" for m in modules})
    missing = [m for m in modules if not m.endswith("/__init__.py") and m not in named]
    missing += [p for p in packages if p not in named and f"{p}__init__.py" not in named]
    gone = sorted(n for n in named if n.startswith("ortflow/") and not (ROOT / n).exists())
    assert not missing, f"{LAYOUT.relative_to(ROOT)} does not list (one line each, with its role):\n" + "\n".join(
        sorted(missing)
    )
    assert not gone, f"{LAYOUT.relative_to(ROOT)} lists paths that no longer exist:\n" + "\n".join(gone)


def test_every_path_named_exists() -> None:
    stale = [
        f"{file.relative_to(ROOT)}:{line} -> {path}"
        for file, prose_only in _files()
        for line, text in (_prose(file) if prose_only else enumerate(file.read_text().splitlines(), 1))
        for path in _paths(text)
        if path not in NOT_IN_THE_REPOSITORY and not (ROOT / path).exists()
    ]
    assert not stale, "paths that do not exist (point them to where the thing is now):\n" + "\n".join(stale)


def _files() -> Iterator[tuple[Path, bool]]:
    seen: set[Path] = set()
    for pattern, prose_only in SOURCES:
        for file in sorted(ROOT.glob(pattern)):
            if file.is_file() and "__pycache__" not in file.parts and file.resolve() not in seen:
                seen.add(file.resolve())
                yield file, prose_only


def _prose(file: Path) -> list[tuple[int, str]]:
    """A Python file's comments and docstrings (every string statement), line by line, in order."""
    source = file.read_text()
    lines = source.splitlines()
    prose = [
        (line, lines[line - 1])
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
        for line in range(node.lineno, (node.end_lineno or node.lineno) + 1)
    ]
    prose += [
        (token.start[0], token.string)
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    ]
    return sorted(prose)


def _paths(text: str) -> Iterator[str]:
    for match in PATH.finditer(text):
        for path in _expand(_strip(match.group(0))):
            if not re.search(r"[*<>{}]", path):
                yield path


def _strip(token: str) -> str:
    return token.rstrip(".,;:")


def _expand(token: str) -> list[str]:
    """`ortflow/step/{loss,optim}.py` -> both paths; a `{name}` without a comma is a placeholder and stays as it is."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not match:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return list(itertools.chain.from_iterable(_expand(head + alt + tail) for alt in match.group(1).split(",")))


def _anchors(page: Path) -> set[str]:
    """The ids mkdocs gives a page's headings (toc's slugify of the heading's text)."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} (.*)", line)):
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
            anchors.add(slugify(text, "-"))
    return anchors
