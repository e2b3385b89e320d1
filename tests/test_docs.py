"""The documentation: every ```python block of docs/**/*.md and README.md runs, and the Sphinx build has no warning."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
# Blocks fenced exactly ```python run; ```{code-block} python blocks are shown but not run (see docs/index.md)
BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
README = DOCS.parent / "README.md"
PAGES = [*sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts), README]


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text(encoding="utf-8"))


def test_pages_have_examples():
    pages_with_code = {p.relative_to(DOCS).as_posix() for p in PAGES if p != README and python_blocks(p)}
    expected = {
        "guide/quickstart.md",
        "guide/applications.md",
        "guide/report.md",
        "modules/influence_ppo.md",
        "guide/install.md",
    }
    assert expected <= pages_with_code


def page_id(page: Path) -> str:
    return page.relative_to(DOCS.parent).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=page_id)
def test_code_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "__docs__"}
    for i, block in enumerate(python_blocks(page)):
        try:
            exec(compile(block, f"{page.name}[block {i}]", "exec"), namespace)
        except Exception as error:
            raise AssertionError(f"{page_id(page)} block {i} failed:\n{block}") from error


def test_block_extraction_convention():
    text = "```python\nx = 1\n```\n\n```{code-block} python\ny = 2\n```\n```bash\nls\n```\n"
    assert BLOCK.findall(text) == ["x = 1\n"]


def test_sphinx_build_has_no_warning(tmp_path):
    pytest.importorskip("sphinx", reason="install the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("myst_parser", reason="install the docs extra: pip install -e '.[docs]'")
    pytest.importorskip("sphinx_rtd_theme", reason="install the docs extra: pip install -e '.[docs]'")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(tmp_path / "html")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "html" / "modules" / "influence_ppo.html").exists()
