"""The kernel reference (docs/kernels.md) names every public callable of numkern's public
modules where a reader looks it up, and the README links to it.

"Public": for a module with ``__all__``, the callables it lists; otherwise the callables
defined in the module whose names have no leading underscore (classes included; module
constants and imported names are not). "Named where a reader looks it up": a code span
that starts with the name, bare or qualified by the end of its module path
(``rms_norm``, ``norm.rms_norm``, ``numkern.norm.rms_norm``), in a heading, a table row,
or at the start of a list item (``- `isa.has(feature)` tests one feature.``). A mention
in running prose does not count. ``numkern.testing``'s helpers and its reference ops
(``numkern.testing.reference``) are documented in docs/testing.md, which kernels.md links
to; the same rule holds there.
"""

import importlib
import inspect
import os
import re
import types

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
# every Markdown page: the README and the docs pages it links to
PAGES = ["README.md", *sorted(f"docs/{f}" for f in os.listdir(DOCS) if f.endswith(".md"))]
README_MAX_LINES = 200

# (module, reference page): every public module a kernel user imports from
MODULES = [
    ("numkern", "kernels.md"),
    ("numkern.moe", "kernels.md"),
    ("numkern.quant", "kernels.md"),
    ("numkern.attention", "kernels.md"),
    ("numkern.norm", "kernels.md"),
    ("numkern.rope", "kernels.md"),
    ("numkern.gdn", "kernels.md"),
    ("numkern.gdn.conv", "kernels.md"),
    ("numkern.gdn.gating", "kernels.md"),
    ("numkern.gdn.norm", "kernels.md"),
    ("numkern.gdn.rule", "kernels.md"),
    ("numkern.decoder", "kernels.md"),
    ("numkern.warmup", "kernels.md"),
    ("numkern.isa", "kernels.md"),
    ("numkern.simd", "kernels.md"),
    ("numkern.collective", "kernels.md"),
    ("numkern.torch_ops", "kernels.md"),
    ("numkern.testing.vllm", "kernels.md"),
    ("numkern.testing", "testing.md"),
    ("numkern.testing.reference", "testing.md"),
]

# the lines a reader scans for a definition: headings, table rows, list items (the span
# must open the item)
_HEADING = re.compile(r"^#{1,6}\s")
_TABLE_ROW = re.compile(r"^\s*\|")
_ITEM_START = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+`([^`]+)`")
_SPAN = re.compile(r"`([^`]+)`")


def public_callables(module_name):
    """The public callables of ``module_name`` as described in the module docstring."""
    mod = importlib.import_module(module_name)
    if hasattr(mod, "__all__"):
        names = list(mod.__all__)
    else:
        names = [
            n
            for n, v in vars(mod).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module_name
        ]
    return sorted(
        n
        for n in names
        if callable(getattr(mod, n)) and not isinstance(getattr(mod, n), types.ModuleType)
    )


def definition_spans(text):
    """The code spans of the headings, table rows and list-item openings of ``text``."""
    spans = []
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        if _HEADING.match(line) or _TABLE_ROW.match(line):
            spans += _SPAN.findall(line)
        elif m := _ITEM_START.match(line):
            spans.append(m.group(1))
    return spans


def names_it(span, module_name, name):
    """Whether ``span`` starts with ``name``, bare or qualified by a tail of the module's
    dotted path, and the identifier ends there."""
    parts = module_name.split(".")
    prefixes = [""] + [".".join(parts[i:]) + "." for i in range(len(parts))]
    return any(re.match(re.escape(p + name) + r"(?![\w])", span.strip()) for p in prefixes)


def test_rule_bites():
    """The matching rule: a qualified or bare opening name counts, a longer identifier
    or a mention in the middle of a span does not, prose does not."""
    assert names_it("isa.has(feature)", "numkern.isa", "has")
    assert names_it("numkern.gdn.rule.Layout", "numkern.gdn.rule", "Layout")
    assert names_it("rms_norm(out, input, weight, epsilon) -> None", "numkern.norm", "rms_norm")
    assert not names_it("rms_norm_gated(x)", "numkern.norm", "rms_norm")
    assert not names_it("foo.has(feature)", "numkern.isa", "has")
    assert not names_it("cache_view(kv_cache, isa) -> CacheView", "numkern.attention", "CacheView")
    text = "\n".join(
        [
            "Prose naming `prose_only()`.",
            "- `listed(x)`: a list item opening with it",
            "- see `not_opening()`",
            "| `in_table` | x |",
            "### 1.2 `in_heading(x) -> y`",
            "```python",
            "# `in_fence()`",
            "```",
        ]
    )
    assert definition_spans(text) == ["listed(x)", "in_table", "in_heading(x) -> y"]


@pytest.mark.parametrize("module_name,page", MODULES)
def test_reference_names_every_public_callable(module_name, page):
    names = public_callables(module_name)
    assert names, f"{module_name}: no public callables found (is the module list stale?)"
    path = os.path.join(DOCS, page)
    assert os.path.exists(path), f"docs/{page} is missing ({module_name} is documented there)"
    with open(path, encoding="utf-8") as f:
        spans = definition_spans(f.read())
    missing = [n for n in names if not any(names_it(s, module_name, n) for s in spans)]
    assert not missing, (
        f"docs/{page} does not name these public callables of {module_name} in a heading, "
        f"a table row or at the start of a list item: {missing}"
    )


def _links(path):
    """The relative links of a Markdown file: ``(target, anchor)`` pairs."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    links = re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text)
    return [(t, a) for t, a in links if "://" not in t and not t.startswith("mailto:")]


def slugs(text):
    """The anchors GitHub gives the headings of ``text``: lower case, punctuation but
    ``-`` and ``_`` dropped, spaces as ``-``; a repeated one gets ``-1``, ``-2``, ..."""
    seen, out = {}, set()
    in_fence = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_slugs():
    text = "# A b\n## 2.9 `numkern.jit` and (x)\n```\n# not a heading\n```\n# A b\n"
    assert slugs(text) == {"a-b", "29-numkernjit-and-x", "a-b-1"}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_resolve(page):
    """Every relative link names a file that exists, and an anchor into a Markdown file
    names one of its headings."""
    path = os.path.join(ROOT, page)
    broken = []
    for target, anchor in _links(path):
        dest = os.path.join(os.path.dirname(path), target) if target else path
        if not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md"):
            with open(dest, encoding="utf-8") as f:
                if anchor not in slugs(f.read()):
                    broken.append(f"{target}#{anchor}")
    assert not broken, f"{page}: links to missing files or headings {broken}"


def test_reference_is_linked():
    assert "docs/kernels.md" in [t for t, _ in _links(os.path.join(ROOT, "README.md"))]
    assert "testing.md" in [t for t, _ in _links(os.path.join(DOCS, "kernels.md"))]


def test_public_callables_sees_defined_and_listed_names():
    """The collection itself: a module without __all__ yields its own functions and
    classes only, one with __all__ its listed callables and no submodules."""
    from numkern import norm

    assert public_callables("numkern.norm") == ["fused_add_rms_norm", "rms_norm"]
    assert inspect.ismodule(norm)  # listed in numkern.__all__, yet not a callable
    assert "norm" not in public_callables("numkern")
    assert "jit" in public_callables("numkern")
    assert "vfma" not in public_callables("numkern.moe")  # imported from simd, not defined


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def _section(text, heading):
    """The text under ``## heading`` up to the next ``## ``."""
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def test_readme_leads_with_what_a_newcomer_needs():
    """README.md's sections, in order: the two commands, what runs where, the measured
    speed, the map of the repository, then how to add an op; it stays short (the
    reference lives in docs/, each page linked from it); the suite's internals live in
    docs/testing.md."""
    text = _readme()
    heads = re.findall(r"^## (.+)$", text, re.M)
    lead = [
        "Two commands on a fresh machine",
        "What runs where",
        "Speed",
        "Map of the repository",
        "Adding an op",
    ]
    assert heads[: len(lead)] == lead, heads
    assert len(text.splitlines()) <= README_MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines (at most {README_MAX_LINES}): move "
        "reference material into a docs/ page and link it"
    )
    assert "docs/testing.md#6-running-the-suite" in text
    first = _section(text, "Two commands on a fresh machine")
    for internal in ("--dist loadfile` (", "narrower_mask", "NUMKERN_FUZZ_EXAMPLES"):
        assert internal not in first, f"README's first section explains {internal!r}"


def test_readme_links_every_docs_page():
    """Every docs page is reachable from the README by a link of its own."""
    linked = {os.path.normpath(t) for t, _ in _links(os.path.join(ROOT, "README.md"))}
    pages = {os.path.normpath(p) for p in PAGES if p != "README.md"}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def _folders():
    """The folders the map covers: ``.ci/``, every top-level folder but hidden ones,
    caches and build outputs, and the subpackages of numkern/ and engine/."""
    out = [".ci/"] if os.path.isdir(os.path.join(ROOT, ".ci")) else []
    for name in sorted(os.listdir(ROOT)):
        if (
            not os.path.isdir(os.path.join(ROOT, name))
            or name.startswith((".", "_"))
            or name.endswith(".egg-info")
            or name in ("build", "dist", "venv")
        ):
            continue
        out.append(f"{name}/")
        if name in ("numkern", "engine"):
            for sub in sorted(os.listdir(os.path.join(ROOT, name))):
                if os.path.isfile(os.path.join(ROOT, name, sub, "__init__.py")):
                    out.append(f"{name}/{sub}/")
    return out


def test_map_has_one_line_per_folder():
    """The README's map of the repository: one list item per folder (the top-level ones,
    .ci/, and the subpackages of numkern/ and engine/), opening with the folder's name as
    a code span, each item on one line; no item names a folder that is not there."""
    items = [
        line
        for line in _section(_readme(), "Map of the repository").splitlines()
        if line.startswith("- ")
    ]
    named = [m.group(1) for line in items if (m := re.match(r"- `([^`]+/)`", line))]
    assert len(named) == len(items), f"map items that do not open with `folder/`: {items}"
    assert len(set(named)) == len(named), f"a folder listed twice: {named}"
    folders = _folders()
    assert not set(folders) - set(named), f"folders the map leaves out: {set(folders) - set(named)}"
    gone = [f for f in named if not os.path.isdir(os.path.join(ROOT, f))]
    assert not gone, f"the map names folders that do not exist: {gone}"


def test_adding_an_op_has_five_steps_on_real_files():
    """ "Adding an op": five numbered steps, and the files it cites exist (also checked for
    the whole page by test_cited_files_exist)."""
    text = _section(_readme(), "Adding an op")
    steps = re.findall(r"^(\d+)\. ", text, re.M)
    assert steps == ["1", "2", "3", "4", "5"], steps
    for path in ("numkern/norm.py", "numkern/isa.py", "tests/test_norm.py", "docs/kernels.md"):
        assert path in text, f"Adding an op no longer cites {path}"


# "§N" / "§N.M" in kernels.md, and "kernels.md §N" anywhere in the docs: a section of
# kernels.md (testing.md's bare "§N" are its own sections)
_SECTION_REF = re.compile(r"(kernels\.md\s+)?§\s?([A-Z]?\d+(?:\.\d+)*)")


def _numbered(text):
    return set(re.findall(r"^#{2,4}\s+(?:Appendix\s+)?([A-Z]?\d*(?:\.\d+)*)\.?\s", text, re.M))


@pytest.mark.parametrize("page", PAGES)
def test_section_references_resolve(page):
    with open(os.path.join(DOCS, "kernels.md"), encoding="utf-8") as f:
        kernels = _numbered(f.read())
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    own = _numbered(text)
    broken = []
    for m in _SECTION_REF.finditer(text):
        to_kernels = bool(m.group(1)) or page != "docs/testing.md"
        if m.group(2) not in (kernels if to_kernels else own):
            broken.append(m.group(0))
    assert not broken, f"{page}: section references to no section: {broken}"
    assert "DESIGN §" not in text.replace('"DESIGN §N"', "")


@pytest.mark.parametrize("page", PAGES)
def test_cited_files_exist(page):
    """A repository file a page names (``numkern/gemm.py``, ``tests/test_norm.py``, ...)
    exists: a file moved or split leaves no stale pointer."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    cited = re.findall(r"\b((?:numkern|engine|bench|tests|examples|docs)/[\w/.-]*\.\w+)", text)
    missing = sorted(
        {c for c in cited if not c.startswith("bench/results/")}
        - {c for c in cited if os.path.exists(os.path.join(ROOT, c))}
    )
    assert not missing, f"{page} cites files that do not exist: {missing}"


# a repository file named in code (a comment or docstring): the folder, then a name with
# one of these extensions (``tests/ranks.run_ranks``, a module's attribute, is not a file)
_CODE_CITE = re.compile(
    r"\b((?:numkern|engine|bench|tests|examples|docs)/[\w/.-]*\.(?:py|md|json|ipynb|toml))\b"
)


def test_files_cited_in_code_exist():
    """The files the code's comments and docstrings name exist (a moved or renamed page,
    module or notebook leaves no stale pointer behind), and none names a notes file that
    is not in the repository."""
    missing = []
    for folder in ("numkern", "engine", "bench", "tests"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "results")]
            for name in filenames:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                rel = os.path.relpath(path, ROOT)
                for cited in set(_CODE_CITE.findall(text)):
                    if not cited.startswith("bench/results/"):
                        if not os.path.exists(os.path.join(ROOT, cited)):
                            missing.append(f"{rel}: {cited}")
                if (
                    re.search(r"\bNUMBA_NOTES\b|\bDESIGN\.md\b", text)
                    and rel != "tests/test_docs.py"
                ):
                    missing.append(f"{rel}: a notes file not in the repository")
    assert not missing, f"code cites files that do not exist: {sorted(missing)}"
