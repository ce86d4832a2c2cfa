"""The README is a front page and the rest of the documentation lives in
docs/, benchmarks/README.md and CHANGELOG.md: every relative link among them
reaches a file, the README stays under about 1,500 words, each row of its
table names bench cases that exist, and every design note docs/design.md
lists by title is a note in the tree."""
import os
import re

from mpcore.bench import cases, runner

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
README = os.path.join(ROOT, "README.md")
README_WORDS = 1500
_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def doc_files():
    """The project's documentation pages, as paths."""
    out = [README, os.path.join(ROOT, "CHANGELOG.md"), os.path.join(ROOT, "benchmarks", "README.md")]
    docs = os.path.join(ROOT, "docs")
    out += [os.path.join(docs, n) for n in sorted(os.listdir(docs)) if n.endswith(".md")]
    return out


def test_every_relative_link_reaches_a_file():
    broken = []
    for path in doc_files():
        for target in _LINK.findall(_read(path)):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not broken, "links to no file: " + ", ".join(broken)


def test_the_readme_is_a_front_page():
    words = len(_read(README).split())
    assert words <= README_WORDS, f"README.md has {words} words (a front page keeps under {README_WORDS})"
    # Its links reach the topic pages.
    for page in ("tensors-and-queues", "processes", "data-loading", "distributed", "launcher", "design"):
        assert f"](docs/{page}.md)" in _read(README), page


def test_each_row_of_the_readme_table_names_bench_cases():
    # The last column of the README's table is the `mpcore bench --only`
    # argument that reruns the row: each of its names must be a case.
    text = _read(README)
    header = "| case | torch | mpcore | ratio | `mpcore bench --only` |"
    assert header in text
    rows = text.split(header, 1)[1].split("\n\n", 1)[0].strip().splitlines()[1:]
    assert len(rows) >= 10
    for row in rows:
        only = row.rstrip(" |").rsplit("|", 1)[1].strip().strip("`")
        for name in only.split(","):
            assert name in cases.CASES, f"README row {row[:40]!r}: no bench case {name!r}"
        assert runner.select(only), only


def test_the_design_notes_listed_are_notes_in_the_tree():
    listed = set()
    section = _read(os.path.join(ROOT, "docs", "design.md")).split("## The design notes", 1)[1]
    section = section.split("\n## ", 1)[0]
    for line in re.findall(r"^\*\*[^*]+:\*\* (.*?)\.$", section, re.M | re.S):
        listed |= {t.strip().strip("`") for t in " ".join(line.split()).split(";")}
    assert len(listed) > 50
    tree = set()
    for top in ("csrc", os.path.join("pkg", "mpcore"), "benchmarks"):
        for d, _, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                if n.endswith((".c", ".h", ".py")):
                    tree |= set(re.findall(r"NOTE \[ (.+?) \]", _read(os.path.join(d, n))))
    assert not listed - tree, f"docs/design.md lists notes the tree does not have: {sorted(listed - tree)}"
