"""`stoker submit` as a user meets it: the API named by --api or STOKER_API_URL, one clear line when none answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.cli import main
from tests.media import text_image
from workers.broker import free_port


@pytest.fixture
def picture(tmp_path: Path) -> Path:
    path = tmp_path / "invoice.png"
    path.write_bytes(text_image("INVOICE 1"))
    return path


@pytest.mark.parametrize("by", ["--api", "--url", "STOKER_API_URL"])
def test_an_api_that_does_not_answer_is_one_line_naming_it(
    by: str, picture: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    argv = ["submit", str(picture), "--prompt", "What is the invoice number?"]
    if by == "STOKER_API_URL":
        monkeypatch.setenv(by, nowhere)
    else:
        argv += [by, nowhere]
    with pytest.raises(SystemExit) as ended:
        main(argv)
    message = str(ended.value.code)
    assert message.startswith(f"no stoker API answers at {nowhere} (ConnectError")
    assert "--api URL or STOKER_API_URL" in message
    assert "\n" not in message
