"""With API keys on (`stoker up --auth`), the Flower `stoker up` starts asks for its basic auth: its UI's task table
shows every tenant's task arguments and results."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from stoker.settings import StackSettings
from workers.broker import free_port
from workers.procs import stop, wait_for
from workers.stack import flower_command, flower_credentials

#: The query Flower's own task page sends for its table (DataTables' server-side protocol).
TABLE_QUERY = {
    "draw": "1",
    "start": "0",
    "length": "10",
    "search[value]": "",
    "order[0][column]": "0",
    "order[0][dir]": "asc",
    "columns[0][data]": "name",
}


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_with_api_keys_on_flower_s_task_table_asks_for_credentials(tmp_path: Path) -> None:
    settings = StackSettings(auth=True, flower_basic_auth=None, flower_port=free_port())
    settings.flower_basic_auth = flower_credentials(settings)  # as `stoker up --auth` does with none set
    assert settings.flower_basic_auth is not None
    user, _, password = settings.flower_basic_auth.partition(":")
    argv, env = flower_command(settings, dict(os.environ))
    base = f"http://{settings.host}:{settings.flower_port}"
    with (tmp_path / "flower.log").open("wb") as log:
        flower = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: _answers(f"{base}/healthcheck"), 60, "Flower", [flower])
        table = f"{base}/tasks/datatable"
        assert httpx.get(table, params=TABLE_QUERY, timeout=10).status_code == 401
        assert httpx.get(table, params=TABLE_QUERY, auth=(user, "wrong"), timeout=10).status_code == 401
        assert httpx.get(f"{base}/api/tasks", timeout=10).status_code == 401
        allowed = httpx.get(table, params=TABLE_QUERY, auth=(user, password), timeout=10)
        assert allowed.status_code == 200, allowed.text
        assert "data" in allowed.json()
    finally:
        stop(flower, grace_s=10)
