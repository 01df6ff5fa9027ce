"""The documentation builds with warnings as errors, and every code example in it runs.

What counts as a code example, and how each kind is run:

* ``.. code-block:: python`` blocks (reST) and ```` ```python ```` fences (Markdown): executed in order, one
  namespace per page, in this process, as a reader would paste them.
* ``>>>`` examples in the pages: run with doctest, their output compared.
* ``>>>`` examples in the package's docstrings (shown in the API reference): run with doctest.
* Scripts under ``docs/examples/`` (the pages include them with ``literalinclude``): run as subprocesses
  with a timeout, 2 CPU processes each, and checked for a line of their output. Every script there must be
  listed in ``EXAMPLES``.
* Shell commands in the pages that run one of the project's Python files: the file exists and has every
  ``--flag`` the command uses.

Also checked: the intersphinx inventories shipped in ``docs/_inventories`` are what their generator writes
and name objects that exist; the dealing diagram shows what the wrapper deals; the compatibility page names
the versions the Makefile and the package test.
"""
from __future__ import annotations

import doctest
import importlib
import importlib.util
import os
import pkgutil
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
from distributed_helpers import run_python, tools_python
from packaging.version import Version

import lightning_ddp_ext

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
EXAMPLES_DIR = DOCS / "examples"

SHARDED_AVAILABLE = all(importlib.util.find_spec(name) for name in ("lightning_ddp_ext.sharded", "fairscale"))
SHARDED_SKIP = "lightning_ddp_ext.sharded or fairscale is not installed (pip install -e '.[sharded]')"

# Script -> a line its output must contain. Each runs 2 CPU processes on tiny data.
EXAMPLES: Dict[str, str] = {
    "quickstart.py": "rank 0 trained on 12 batches, rank 1 on 12",
    "custom_hooks.py": "4 optimizer steps, 4 gradient all-reduce rounds",
    "stock_lightning.py": "unseeded index sampler   ddp_custom_sampler_fork  RuntimeError",
    "evaluation.py": "eval_mode='exact': recall@1",
    "plain_torch.py": "gathered (60, 1) outputs",
    "sharded.py": "checkpoint: 8 parameter tensors",
}
NEEDS_SHARDED = {"sharded.py", "guides/sharded.rst"}
SCRIPT_TIMEOUT_S = 150


def pages() -> List[Path]:
    skip = {"_build", "examples", "_inventories", "_scripts"}
    return sorted(
        path
        for path in DOCS.rglob("*")
        if path.suffix in (".rst", ".md") and not skip.intersection(path.relative_to(DOCS).parts)
    )


def page_id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def python_blocks(path: Path) -> Iterator[Tuple[int, str]]:
    """``(first line number, code)`` of every Python code block of a page."""
    lines = path.read_text().splitlines()
    if path.suffix == ".md":
        fence = re.compile(r"^(\s*)(```+|~~~+)\s*(?:\{code-block\}\s*)?(python|py|python3)\s*$")
        i = 0
        while i < len(lines):
            match = fence.match(lines[i])
            i += 1
            if not match:
                continue
            start, body = i, []
            while i < len(lines) and not lines[i].strip().startswith(match.group(2)):
                if not re.match(r"^\s*:\w[\w-]*:", lines[i]) or body:  # MyST directive options
                    body.append(lines[i])
                i += 1
            i += 1
            yield start + 1, textwrap.dedent("\n".join(body))
        return
    directive = re.compile(r"^(\s*)\.\. (?:code-block|code|sourcecode)::\s*(?:python|py|python3)\s*$")
    i = 0
    while i < len(lines):
        match = directive.match(lines[i])
        i += 1
        if not match:
            continue
        base = len(match.group(1))
        while i < len(lines) and lines[i].strip().startswith(":") and _indent(lines[i]) > base:  # options
            i += 1
        start, body = i, []
        while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > base):
            body.append(lines[i])
            i += 1
        yield start + 1, textwrap.dedent("\n".join(body)).strip("\n") + "\n"


def _skip_if_needs_sharded(name: str) -> None:
    if name in NEEDS_SHARDED and not SHARDED_AVAILABLE:
        pytest.skip(SHARDED_SKIP)


# ---------------------------------------------------------------------------------------------- the build
def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    missing = [name for name in ("sphinx", "myst_parser") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed: the docs extra is needed (pip install -e '.[docs]')")
    result = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path / "html")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"sphinx-build failed:\n{result.stdout}\n{result.stderr}"
    assert (tmp_path / "html" / "index.html").exists()
    api = (tmp_path / "html" / "api" / "strategy.html").read_text()
    assert "configure_ddp" in api and "https://lightning.ai/docs/pytorch/stable/" in api  # autodoc + intersphinx


# ---------------------------------------------------------------------------------------------- examples in pages
@pytest.mark.timeout(180)
@pytest.mark.parametrize("page", [p for p in pages() if any(python_blocks(p))], ids=page_id)
def test_python_blocks_run(page: Path) -> None:
    _skip_if_needs_sharded(page_id(page))
    namespace: Dict[str, object] = {"__name__": f"docs.{page.stem}"}
    for line, code in python_blocks(page):
        # Leading newlines make tracebacks point at the page's own line numbers.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)


@pytest.mark.parametrize("page", [p for p in pages() if ">>>" in p.read_text()], ids=page_id)
def test_doctest_examples_in_pages(page: Path) -> None:
    _skip_if_needs_sharded(page_id(page))
    test = doctest.DocTestParser().get_doctest(page.read_text(), {}, page_id(page), str(page), 0)
    assert test.examples, "the page has '>>>' but no doctest example was found"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: List[str] = []
    result = runner.run(test, out=report.append)
    assert result.failed == 0, "".join(report)


#: The package's modules whose docstrings hold examples (test_every_module_with_examples_is_listed keeps it whole).
PACKAGE_MODULES = [
    "lightning_ddp_ext._pickling",
    "lightning_ddp_ext.samplers",
    "lightning_ddp_ext.dataloader",
    "lightning_ddp_ext.strategy",
    "lightning_ddp_ext.sharded",
]


def _docstring_tests(name: str) -> List[doctest.DocTest]:
    return doctest.DocTestFinder(exclude_empty=True).find(importlib.import_module(name), name)


@pytest.mark.parametrize("name", PACKAGE_MODULES)
def test_docstring_examples(name: str) -> None:
    if name == "lightning_ddp_ext.sharded" and not SHARDED_AVAILABLE:
        pytest.skip(SHARDED_SKIP)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: List[str] = []
    for test in _docstring_tests(name):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{name} has no docstring examples left: drop it from PACKAGE_MODULES"
    assert runner.failures == 0, "".join(report)


def test_every_module_with_examples_is_listed() -> None:
    """A docstring example in a module missing from PACKAGE_MODULES would never run."""
    modules = pkgutil.iter_modules(lightning_ddp_ext.__path__)
    names = ["lightning_ddp_ext"] + [f"lightning_ddp_ext.{module.name}" for module in modules]
    if not SHARDED_AVAILABLE:
        names.remove("lightning_ddp_ext.sharded")
    with_examples = {name for name in names if any(test.examples for test in _docstring_tests(name))}
    assert with_examples <= set(PACKAGE_MODULES), sorted(with_examples - set(PACKAGE_MODULES))


# ---------------------------------------------------------------------------------------------- example scripts
def test_every_example_script_is_run_and_shown() -> None:
    scripts = {path.name for path in EXAMPLES_DIR.glob("*.py")}
    assert scripts == set(EXAMPLES), "list every docs/examples script in EXAMPLES (and only those)"
    text = "\n".join(page.read_text() for page in pages())
    for script in scripts:
        assert f"examples/{script}" in text, f"no page shows or links docs/examples/{script}"


def _run_script(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``path`` in its own process group; kill the whole group on timeout and fail if it leaves any behind."""
    process = subprocess.Popen(
        [sys.executable, str(path)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=SCRIPT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{path.name} ran longer than {SCRIPT_TIMEOUT_S} s:\n{output[-4000:]}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # children of the script (the other rank) must be gone too
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        os.killpg(process.pid, signal.SIGKILL)
        pytest.fail(f"{path.name} left processes behind")
    return subprocess.CompletedProcess(process.args, process.returncode, output, "")


@pytest.mark.timeout(SCRIPT_TIMEOUT_S + 30)
@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_script(script: str, tmp_path: Path) -> None:
    _skip_if_needs_sharded(script)
    result = _run_script(EXAMPLES_DIR / script, tmp_path)
    assert result.returncode == 0, f"{script} exited with {result.returncode}:\n{result.stdout[-6000:]}"
    assert EXAMPLES[script] in result.stdout, result.stdout[-6000:]


# ---------------------------------------------------------------------------------------------- shell commands
def shell_commands() -> Iterator[Tuple[str, str]]:
    """``(page, command)`` for every line of a shell block that runs one of the project's Python files."""
    for page in pages():
        for line in page.read_text().splitlines():
            match = re.match(r"^\s*python3? ((?:docs|benchmarks|examples)/\S+\.py)(.*)$", line)
            if match:
                yield page_id(page), line.strip()


@pytest.mark.parametrize("page,command", list(shell_commands()))
def test_shell_commands_name_existing_scripts_and_flags(page: str, command: str) -> None:
    script, *arguments = command.split("#")[0].split()[1:]
    path = ROOT / script
    assert path.exists(), f"{page}: {script} does not exist"
    source = path.read_text()
    for flag in (argument.split("=")[0] for argument in arguments if argument.startswith("--")):
        assert f'"{flag}"' in source, f"{page}: {script} has no {flag} option"


# ---------------------------------------------------------------------------------------------- supporting files
def _load(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _resolve(name: str) -> object:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attribute in parts[cut:]:
            obj = getattr(obj, attribute)
        return obj
    raise ImportError(name)


def test_intersphinx_inventories_are_current_and_name_real_objects() -> None:
    generator = _load(DOCS / "_inventories" / "generate.py")
    for filename, (project, version, entries) in generator.PROJECTS.items():  # type: ignore[attr-defined]
        written = (DOCS / "_inventories" / filename).read_bytes()
        assert written == generator.inventory_bytes(project, version, entries), (  # type: ignore[attr-defined]
            f"docs/_inventories/{filename} is stale: run python docs/_inventories/generate.py"
        )
        for name, _, _ in entries:
            _resolve(name)  # raises if torch or Lightning no longer has it


def test_compatibility_page_names_the_tested_versions() -> None:
    page = (DOCS / "compatibility.rst").read_text()
    makefile = (ROOT / "Makefile").read_text()
    lowest = re.search(r"^LIGHTNING_LOWEST \?= lightning==(\S+)", makefile, re.M)
    torch_lowest = re.search(r"^TORCH_LOWEST \?= torch==(\S+)", makefile, re.M)
    torch_pin = re.search(r"^TORCH \?= torch==(\S+)", makefile, re.M)
    assert lowest and torch_lowest and torch_pin
    from lightning_ddp_ext import _compat

    highest = _compat.LIGHTNING_CHECKED[1].lstrip("<=")
    for version in (lowest.group(1), torch_lowest.group(1), torch_pin.group(1), highest):
        assert version in page, f"the compatibility page does not mention {version}"
    setup_cfg = (ROOT / "setup.cfg").read_text()
    for requirement in re.findall(r"^\s+((?:torch|lightning)[<>=!,.*\d]+)\s*$", setup_cfg, re.M):
        assert requirement in page, f"the compatibility page does not state {requirement} from setup.cfg"
    # make test-lowest tests the declared floors, not versions above them
    for name, pinned in (("lightning", lowest.group(1)), ("torch", torch_lowest.group(1))):
        floor = re.search(rf"^\s+{name}>=([\d.]+)", setup_cfg, re.M)
        assert floor and Version(pinned).release[:2] == Version(floor.group(1)).release[:2], (name, pinned)


def test_dealing_diagram_is_current(tmp_path: Path) -> None:
    """docs/_static/dealing.png shows what the wrapper deals today (the rows are stored in the PNG), and the
    script still draws it."""
    python, script = tools_python("matplotlib"), str(DOCS / "_scripts" / "dealing_diagram.py")
    run_python(script, "--check", timeout=SCRIPT_TIMEOUT_S, python=python)  # fails naming the fix when stale
    run_python(script, str(tmp_path / "dealing.png"), timeout=SCRIPT_TIMEOUT_S, python=python)
    assert (tmp_path / "dealing.png").stat().st_size > 10_000
