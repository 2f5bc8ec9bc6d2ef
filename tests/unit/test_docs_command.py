"""`hearth docs` prints where hearth's docs are (here the checkout's docs/), a page's path, or the pages there are."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from hearth.services.cli import app

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_hearth_docs_prints_the_folder_and_a_pages_path():
    assert CliRunner().invoke(app, ["docs"]).output.strip() == str(DOCS)
    for page in ("configuration", "metrics.md"):
        result = CliRunner().invoke(app, ["docs", page])
        assert result.exit_code == 0 and Path(result.output.strip()) == DOCS / f"{page.removesuffix('.md')}.md"


def test_a_page_that_is_not_there_or_a_path_is_refused_listing_the_pages():
    for page in ("nope", "../README", "/etc/passwd", "img"):
        result = CliRunner().invoke(app, ["docs", page])
        assert result.exit_code == 2 and "configuration, " in result.output and result.output.count("\n") == 1, page
