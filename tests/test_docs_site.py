"""The docs site and the README: MkDocs builds the site with no warning (every link, anchor and page checked), and
the README is a landing page whose relative links resolve and whose test command is the one CI runs."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading; GitHub gives the same for these headings."""
    text = re.sub(r"[`*]", "", heading)
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text).strip().lower())


def _broken_links(markdown: Path) -> list[str]:
    """The relative links of a Markdown file that name no file, or no heading of the file they name."""
    text = re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (markdown.parent / path).resolve() if path else markdown
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", linked.read_text(), flags=re.S), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    return broken


def test_the_readmes_relative_links_resolve(tmp_path):
    assert _broken_links(README) == []
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("# There\n\n## A section\n")
    page.write_text("[ok](there.md#a-section) [file](missing.md) [anchor](there.md#no-such-section)")
    assert _broken_links(page) == ["missing.md", "there.md#no-such-section"]


def test_the_readme_is_a_landing_page_whose_test_command_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    commands = [line for line in text.split("```bash", 1)[1].split("```", 1)[0].splitlines()
                if line and not line.startswith("#")]
    assert commands[0].endswith("trainmon demo")
    ci_test_command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert commands[1].endswith(ci_test_command), (commands[1], ci_test_command)
    assert not re.search(r"\b\d{4}-\d{2}-\d{2}\b", text), "a dated figure"
    assert not re.search(r"\d[\d,]* tests\b", text), "a test count"
    assert (ROOT / re.search(r"!\[[^]]*\]\(([^)]+\.png)\)", text).group(1)).is_file()


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], capture_output=True, text=True, timeout=300)


def test_the_docs_site_builds_with_no_warning(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    built = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0 and "WARNING" not in built.stderr, built.stderr
    for page in ("index.html", "design/index.html", "reference/config/index.html", "guides/watch/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_a_broken_link_fails_the_docs_build(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is in the test extra: pip install -e '.[test]'")
    copy = tmp_path / "repo"
    shutil.copytree(DOCS, copy / "docs")
    shutil.copy(ROOT / "mkdocs.yml", copy / "mkdocs.yml")
    design = copy / "docs" / "design.md"
    design.write_text(design.read_text() + "\nSee [the guide](guides/training-script.md#no-such-section).\n")
    built = _build(copy / "mkdocs.yml", tmp_path / "site")
    assert built.returncode != 0 and "no-such-section" in built.stderr, built.stderr
