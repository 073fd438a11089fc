"""The documentation holds together: docs/configuration.md is what the settings render, every setting says what it
does, and every relative link and anchor in README.md and docs/*.md leads somewhere."""

from __future__ import annotations

import ast
import itertools
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token

from stoker.cli import main
from stoker.core.callbacks import signature_header
from stoker.docs import SETTINGS_CLASSES, configuration_page, env_var
from stoker.settings import ApiSettings, WorkerSettings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: A link with a scheme (https:, mailto:) leaves the repository: not checked here.
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def test_the_configuration_page_is_the_one_the_settings_render() -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == configuration_page(), "docs/configuration.md is stale: run `make docs`"


def test_stoker_docs_config_prints_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["docs", "config"]) == 0
    assert capsys.readouterr().out == configuration_page()


def test_every_setting_has_a_description_and_a_row_of_its_own() -> None:
    page = configuration_page()
    for cls in SETTINGS_CLASSES:
        for name, field in cls.model_fields.items():
            assert field.description, f"{cls.__name__}.{name} has no Field(description=...)"
        assert f"\n## {cls.__name__}\n" in page
    assert "| `PROMETHEUS_MULTIPROC_DIR` |" in page  # a field's own alias is its variable
    field = WorkerSettings.model_fields["prometheus_multiproc_dir"]
    assert env_var(WorkerSettings, "prometheus_multiproc_dir", field) == "PROMETHEUS_MULTIPROC_DIR"


def test_a_default_a_class_replaces_is_shown_beside_the_inherited_one() -> None:
    rows = [line for line in configuration_page().splitlines() if line.startswith("| `STOKER_STORE_TIMEOUT_S` |")]
    assert ApiSettings.model_fields["store_timeout_s"].default == 3.0
    assert len(rows) == 2  # CommonSettings' own and the API's
    assert "| `3.0` (CommonSettings: `10.0`) |" in rows[1]
    assert "| `float` (> 0) |" in rows[0]
    assert "| `~/.cache/stoker` |" in configuration_page()  # not the home folder of whoever rendered it


# -- links ------------------------------------------------------------------------------------------------------
def _inline_text(token: Token) -> str:
    """A heading's text as GitHub slugs it: its words and code spans, without markup."""
    return "".join(child.content for child in token.children or [] if child.type in ("text", "code_inline"))


def slug(text: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, `-` and spaces kept),
    spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in a page; a repeated heading gets `-1`, `-2`, … as on GitHub."""
    tokens = MarkdownIt("commonmark").enable("table").parse(markdown)
    seen: Counter[str] = Counter()
    found = set()
    for opening, inline in itertools.pairwise(tokens):
        if opening.type == "heading_open":
            base = slug(_inline_text(inline))
            found.add(f"{base}-{seen[base]}" if seen[base] else base)
            seen[base] += 1
    return found


def links(markdown: str) -> list[str]:
    """Every link and image target in a page (code blocks and code spans are not links)."""
    targets = []
    for token in MarkdownIt("commonmark").enable("table").parse(markdown):
        for child in token.children or []:
            target = child.attrGet("href") if child.type == "link_open" else child.attrGet("src")
            if child.type in ("link_open", "image") and isinstance(target, str):
                targets.append(target)
    return targets


def broken_links(page: Path) -> list[str]:
    """The relative links of a page whose file does not exist, or whose `#anchor` no heading of it makes."""
    broken = []
    for target in links(page.read_text()):
        if EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading makes #{anchor}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert links(page.read_text()), f"{page.name} links nowhere: is it found from the README?"
    assert broken_links(page) == []


def test_every_page_of_docs_is_linked_from_the_readme() -> None:
    readme = {(ROOT / target).resolve() for target in links((ROOT / "README.md").read_text())}
    assert {page.resolve() for page in PAGES[1:]} <= readme


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## The `stoker up` stack\n\n## Same\n\n## Same\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#the-stoker-up-stack) [ok](other.md#same-1) [ok](#page) [ok](https://example.com)\n"
        "[gone](missing.md) [no anchor](other.md#nowhere) [no local anchor](#elsewhere)\n\n"
        "```\n[not a link](nowhere.md)\n```\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading makes #nowhere",
        "#elsewhere: no heading makes #elsewhere",
    ]


# -- the README and the code it shows ----------------------------------------------------------------------------
def python_blocks(markdown: str) -> list[str]:
    """The ```python blocks of a page."""
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [t.content for t in tokens if t.type == "fence" and t.info.strip() == "python"]


def test_the_readme_is_a_front_page_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 10 * 1024
    assert re.search(r"^make up +#", readme, re.MULTILINE)
    assert re.search(r"^make test +#", readme, re.MULTILINE)
    assert "make up" in (ROOT / "Makefile").read_text().splitlines()[0]  # the Makefile's own header says the same


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_python_snippet_compiles_and_sends_an_ascii_api_key(page: Path) -> None:
    for block in python_blocks(page.read_text()):
        tree = ast.parse(block)
        for keyword in (node for node in ast.walk(tree) if isinstance(node, ast.keyword) and node.arg == "api_key"):
            # An HTTP header is latin-1 at best: the OpenAI client raises UnicodeEncodeError on a key like "stk_…".
            assert isinstance(keyword.value, ast.Constant)
            assert str(keyword.value.value).isascii(), keyword.value.value


def test_the_receivers_check_in_the_api_page_accepts_stokers_signatures() -> None:
    (block,) = [b for b in python_blocks((ROOT / "docs" / "api.md").read_text()) if "def genuine" in b]
    namespace: dict[str, Any] = {}
    exec(block, namespace)
    genuine = namespace["genuine"]
    body, now = b'{"id": "3f1c", "status": "succeeded"}', int(time.time())
    headers = {
        "X-Stoker-Timestamp": str(now),
        "X-Stoker-Signature": signature_header(["whsec_new", "whsec_old"], now, body),
    }
    assert genuine("whsec_new", headers, body)
    assert genuine("whsec_old", headers, body)  # during a rotation's grace either secret verifies
    assert not genuine("whsec_other", headers, body)
    assert not genuine("whsec_new", headers, body + b" ")
    assert not genuine("whsec_new", {**headers, "X-Stoker-Timestamp": str(now - 3600)}, body)
