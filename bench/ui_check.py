"""Opens the MLflow UI on a finished ``tapp run`` in headless Chromium, saves screenshots and says what it saw.

    .venv/bin/python bench/ui_check.py [--tracking-uri URI] [--experiment tapp] [--out out/ui_check]
                                       [--view-key KEY] [--browser /usr/bin/chromium] [--strict]
                                       [--tapp-args "--model tiny_cnn --rounds 4"]

Without ``--tracking-uri`` it first runs ``tapp run --estimate-only`` (``--measure``: measured on the workers; with
``--tapp-args``) in a temporary folder
(its own MLflow SQLite store and Prefect home, a few minutes here) and checks that, opening the runs link that
``tapp run`` printed (its host rebased onto the MLflow server this script starts). With an ``http(s)`` URI it browses that server; with
any other store URI (``sqlite:///...``, ``postgresql://...``) it starts ``mlflow server`` on a free loopback port.

It looks at the experiment's newest parent run (a run with children and no parent) the way a new user would, in
a fresh browser profile:

1. the experiment's landing page (``#/experiments/ID``): MLflow 3.17 opens the GenAI overview unless the URL says
   ``workflowType=machine_learning``;
2. the runs list: the experiment's saved view (an experiment tag ``mlflow.sharedViewState.KEY``, opened with
   ``?viewStateShareKey=KEY``) when there is one, else the parent's children filtered, sorted by ``step_time_s``;
   are the ``method``, ``step_time_s`` and interval (``step_time_low_s``, ``step_time_high_s``) columns there, and
   who comes first;
2b. the same link reloaded, as a user who comes back (``02b-reload``): MLflow 3.17 writes the view's filter and
   sort into the address and then no longer applies the view, so the reloaded page shows its default columns
   (a LIMIT; the check looks for the step time and interval in the run names there instead); then, as the README
   says, a click on **Override saved view** and a reload: the columns must be back, and a bookmark of that address
   opened in a new tab of the same browser must show them too;
3. the parent run's page: does its description (``mlflow.note.content``) show the result table; and the report
   its description links to (``07-report``);
4. the chart view of the same runs: which metric the first chart plots, and whether its legend names every method;
5. the compare page of the method runs: which metric the parallel-coordinates plot starts with;
6. a table logged with ``log_table`` (listed in the run's ``mlflow.loggedArtifacts`` tag), in the artifact view.

Before the browser, the same questions are asked of the store itself (tags, description, logged tables), so the
script still says what is missing where no browser is installed (CI). A browser here means Debian's ``chromium``
(``apt-get install chromium``) driven by the ``playwright`` package (``pip install playwright``; its own browser
download is not needed). Without one the browser checks print as skipped; ``--require-browser`` makes that an
error.

Every line of the summary is ``OK``, ``MISSING`` (TAPP does not do it yet), ``LIMIT`` (MLflow cannot do it; the
line says why) or ``INFO``. Screenshots and ``summary.txt`` go to ``--out``. Exit status: 0, or 1 with ``--strict``
when something is MISSING, 2 when the store or experiment cannot be opened. Every process the script starts (the
``tapp run``, the MLflow server, the browser) is stopped on every way out, Ctrl-C and SIGTERM included.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STEP_METRIC = "step_time_s"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
CHART_METRIC = "step_time_ms"
INTERVAL_COLUMNS = ("metrics.`step_time_low_s`", "metrics.`step_time_high_s`")
WANTED_COLUMNS = ("tags.`method`", "tags.`model`", "tags.`cluster`", f"metrics.`{STEP_METRIC}`", *INTERVAL_COLUMNS)
SIGNIFICANT_DIGITS = 4
OVERRIDE_BUTTON = "Override saved view"
# Debian's chromium as root on this closed network: without the background-networking flags it stalls on
# connections the network refuses. Playwright adds a fresh --user-data-dir of its own.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
BROWSER_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# MLflow's assistant panel opens itself on a first visit and covers a third of every screenshot.
CLOSE_ASSISTANT = (
    "localStorage.setItem('mlflow.assistant.panelOpen_v1','false');"
    "localStorage.setItem('mlflow.assistant.fab.autoOpenedOnFirstLoad_v1','true');"
)
PAGE_TIMEOUT_S = 60.0


class CheckError(Exception):
    """The store or the experiment cannot be opened: exit status 2."""


@dataclass
class Report:
    """What was checked, one line each: (status, subject, detail); screenshots go to ``out``."""

    lines: list[tuple[str, str, str]] = field(default_factory=list)
    out: Path = Path("out/ui_check")

    def add(self, status: str, subject: str, detail: str) -> None:
        self.lines.append((status, subject, detail))
        print(f"{status:8}{subject}: {detail}", flush=True)

    def check(self, ok: bool, subject: str, good: str, bad: str) -> None:
        self.add("OK" if ok else "MISSING", subject, good if ok else bad)

    def text(self) -> str:
        return "\n".join(f"{status:8}{subject}: {detail}" for status, subject, detail in self.lines) + "\n"

    @property
    def missing(self) -> int:
        return sum(status == "MISSING" for status, _, _ in self.lines)


@dataclass
class Experiment:
    """The runs the checks look at."""

    experiment_id: str
    experiment_tags: dict[str, str]
    parent: Any  # mlflow.entities.Run
    children: list[Any]

    @property
    def methods(self) -> list[Any]:
        """The children that evaluated a method (``run_kind`` ``evaluation``, a ``method`` tag: not the runs that
        trained a method's plan), best step time first."""
        runs = [
            run
            for run in self.children
            if "method" in run.data.tags and run.data.tags.get("run_kind", "evaluation") == "evaluation"
        ]
        return sorted(runs, key=lambda run: run.data.metrics.get(STEP_METRIC, float("inf")))


# ---------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def process_group(command: list[str], log: Path, **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` in a session of its own; on the way out, end that whole group (children included)."""
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **popen,
        )
        try:
            yield process
        finally:
            stop_group(process)


def stop_group(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group, SIGKILL after 10 s; a group already gone is fine."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=wait_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # grandchildren that outlived their parent
            return
        except subprocess.TimeoutExpired:
            continue


def run_tapp(workdir: Path, timeout_s: float, extra: list[str]) -> tuple[str, str | None]:
    """``tapp run EXTRA`` in ``workdir`` with its own store and Prefect home; return the store's URI and
    the runs link it printed (None if it printed none)."""
    uri = f"sqlite:///{workdir / 'mlflow.db'}"
    environment = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PREFECT_HOME": str(workdir / "prefect-home")}
    environment.pop("PREFECT_API_URL", None)
    tapp = Path(sys.executable).with_name("tapp")
    command = [str(tapp)] if tapp.exists() else [sys.executable, "-m", "flows.cli"]
    print(f"running {' '.join(command)} run {' '.join(extra)} in {workdir} ...", flush=True)
    environment["COLUMNS"] = "400"  # its links on one line each
    with process_group([*command, "run", *extra], workdir / "tapp-run.log", cwd=workdir, env=environment) as process:
        try:
            status = process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as error:
            raise CheckError(
                f"tapp run did not finish in {timeout_s:.0f} s (log: {workdir / 'tapp-run.log'})"
            ) from error
    output = (workdir / "tapp-run.log").read_text(errors="replace")
    if status != 0:
        raise CheckError(f"tapp run failed with status {status}:\n{output[-2000:]}")
    printed = re.search(r"methods by step time:\s*(\S+)", output)
    return uri, printed.group(1) if printed else None


@contextlib.contextmanager
def mlflow_ui(tracking_uri: str, out: Path) -> Iterator[str]:
    """The UI's base URL: the server itself for an http(s) URI, else ``mlflow server`` started on the store."""
    if tracking_uri.startswith(("http://", "https://")):
        yield tracking_uri.rstrip("/")
        return
    port = free_port()
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow)] if mlflow.exists() else [sys.executable, "-m", "mlflow"]
    command += [
        "server",
        "--backend-store-uri",
        tracking_uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    base = f"http://127.0.0.1:{port}"
    # The server's job runner (ten huey consumers here) serves GenAI jobs, nothing a runs list needs.
    environment = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with process_group(command, out / "mlflow-server.log", env=environment) as server:
        deadline = time.monotonic() + 120.0
        while not answers(f"{base}/health"):
            if server.poll() is not None or time.monotonic() > deadline:
                raise CheckError(f"mlflow server did not come up on {base} (log: {out / 'mlflow-server.log'})")
            time.sleep(0.5)
        yield base


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)
    except OSError:
        return False


# ---------------------------------------------------------------- the store


def open_experiment(tracking_uri: str, name: str) -> Experiment:
    """The experiment's newest parent run (a run with children and no parent) and its children."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if tracking_uri.startswith("sqlite:///") and not Path(tracking_uri.removeprefix("sqlite:///")).exists():
        raise CheckError(f"no MLflow store at {tracking_uri} (MLflow would create an empty one)")
    client = MlflowClient(tracking_uri)
    try:
        experiment = client.get_experiment_by_name(name)
    except MlflowException as error:
        raise CheckError(f"cannot open the MLflow store {tracking_uri}: {error}") from error
    if experiment is None:
        raise CheckError(f"no experiment named {name!r} in {tracking_uri}")
    runs = client.search_runs([experiment.experiment_id], max_results=5000, order_by=["attributes.start_time DESC"])
    children_of: dict[str, list[Any]] = {}
    for run in runs:
        parent_id = run.data.tags.get("mlflow.parentRunId")
        if parent_id:
            children_of.setdefault(parent_id, []).append(run)
    parents = [run for run in runs if "mlflow.parentRunId" not in run.data.tags and run.info.run_id in children_of]
    if not parents:
        raise CheckError(f"experiment {name!r} has no parent run with children")
    parent = parents[0]
    return Experiment(experiment.experiment_id, dict(experiment.tags), parent, children_of[parent.info.run_id])


def saved_views(experiment: Experiment) -> dict[str, dict[str, Any]]:
    """The experiment's saved views: key -> {"name", "state"}; MLflow also reads a bare state as the tag value."""
    views: dict[str, dict[str, Any]] = {}
    for tag, value in experiment.experiment_tags.items():
        if not tag.startswith(VIEW_TAG_PREFIX):
            continue
        with contextlib.suppress(ValueError, TypeError):
            envelope = json.loads(value)
            if isinstance(envelope, dict) and isinstance(envelope.get("state"), str):
                views[tag[len(VIEW_TAG_PREFIX) :]] = {
                    "name": envelope.get("name", ""),
                    "state": json.loads(envelope["state"]),
                }
            elif isinstance(envelope, dict):
                views[tag[len(VIEW_TAG_PREFIX) :]] = {"name": "(no name)", "state": envelope}
    return views


def logged_tables(run: Any) -> list[str]:
    """Artifact paths the run logged with ``log_table`` (its ``mlflow.loggedArtifacts`` tag)."""
    with contextlib.suppress(ValueError, TypeError):
        entries = json.loads(run.data.tags.get("mlflow.loggedArtifacts", "[]"))
        return [entry["path"] for entry in entries if entry.get("type") == "table" and "path" in entry]
    return []


def has_markdown_table(text: str) -> bool:
    lines = [line.strip() for line in text.splitlines()]
    return any(line.startswith("|") for line in lines) and any(re.match(r"^\|\s*:?-{3,}", line) for line in lines)


def pick_view(experiment: Experiment, wanted: str | None) -> str | None:
    """The saved view to open: ``--view-key``, else the first (by key) sorted on the step time."""
    views = saved_views(experiment)
    if wanted is not None:
        return wanted if wanted in views else None
    for key in sorted(views, key=lambda key: (views[key]["name"] == "(no name)", key)):
        if STEP_METRIC in str(views[key]["state"].get("orderByKey", "")):
            return key
    return None


def check_store(experiment: Experiment, view_key: str | None, report: Report) -> None:
    """What the store says, before any browser: views, description, tables, source tags, metric order."""
    parent, methods = experiment.parent, experiment.methods
    report.add(
        "INFO",
        "parent run",
        f"{parent.info.run_name} ({parent.info.run_id}), {len(experiment.children)} "
        f"children, {len(methods)} with a `method` tag",
    )
    views = saved_views(experiment)
    if view_key is None:
        report.add(
            "MISSING",
            "saved view",
            f"no experiment tag {VIEW_TAG_PREFIX}KEY sorted on {STEP_METRIC} "
            f"(views: {sorted(views) or 'none'}); columns cannot be preselected otherwise",
        )
    else:
        state = views[view_key]["state"]
        columns = [column for column in WANTED_COLUMNS if column in state.get("selectedColumns", [])]
        report.check(
            len(columns) == len(WANTED_COLUMNS),
            "saved view",
            f"{view_key!r} ({views[view_key]['name']}) selects {', '.join(WANTED_COLUMNS)}",
            f"{view_key!r} selects only {columns or 'none'} of {list(WANTED_COLUMNS)}",
        )
    kind = experiment.experiment_tags.get("mlflow.experimentKind")
    report.add(
        "INFO",
        "experiment kind",
        f"mlflow.experimentKind={kind!r}; MLflow 3.17.2's UI ignores it and "
        "lands by the browser's stored workflowType (default genai), so links carry workflowType=",
    )
    note = parent.data.tags.get("mlflow.note.content", "")
    report.check(
        has_markdown_table(note),
        "description",
        "the parent's mlflow.note.content holds a Markdown table",
        "the parent's mlflow.note.content " + ("has no Markdown table" if note else "is empty"),
    )
    tables = [f"{run.info.run_name}:{path}" for run in [parent, *experiment.children] for path in logged_tables(run)]
    report.check(
        bool(tables),
        "logged table",
        f"log_table artifacts: {', '.join(tables)}",
        "no run logged a table (mlflow.loggedArtifacts), so the artifact view has none",
    )
    check_description_numbers(note, report)
    source = {tag: parent.data.tags.get(tag) for tag in ("mlflow.source.name", "mlflow.source.type", "mlflow.user")}
    report.check(
        all(source.values()),
        "source tags",
        f"{source}",
        f"unset on the parent: "
        f"{[tag for tag, value in source.items() if not value]} (the Source and Created by fields show -)",
    )
    flow_run = parent.data.tags.get("prefect.flow_run_id")
    report.check(
        bool(flow_run),
        "prefect tags",
        f"prefect.flow_run_id={flow_run}, prefect.flow_run_url={parent.data.tags.get('prefect.flow_run_url')}",
        "no prefect.flow_run_id tag on the parent",
    )
    check_metrics(experiment, report)
    check_params(experiment, report)


def check_description_numbers(note: str, report: Report) -> None:
    """The description's table shows rounded numbers (at most 4 significant digits)."""
    cells = [cell.strip() for line in note.splitlines() if line.startswith("| ") for cell in line.split("|")]
    numbers = [number for cell in cells for number in re.findall(r"\d+\.\d+", cell)]
    long = [cell for cell in numbers if len(cell.replace(".", "").lstrip("0")) > 4]
    report.check(
        bool(numbers) and not long,
        "rounded",
        f"the description's {len(numbers)} numbers have at most 4 significant digits",
        f"unrounded numbers in the description: {long[:5] or 'no numbers at all'}",
    )


NAMED_TIME = re.compile(r"\s\d+(\.\d+)?(e-\d+)?( \[[^]]+\])? s")
"""A method run's name: ``tapp 0.1948 [0.1946, 0.1994] s`` (measured) or ``tapp 0.0004815 s (estimated)``."""


def significant_digits(value: float) -> int:
    """Significant digits of ``value`` as ``repr`` writes it (``0.1948`` -> 4, ``0.19481234`` -> 8)."""
    mantissa = repr(float(value)).lower().split("e")[0].replace("-", "").replace(".", "")
    return len(mantissa.lstrip("0").rstrip("0")) or 1


def check_params(experiment: Experiment, report: Report) -> None:
    """The tapp method run names its planner; the parent and the search run count the same search rounds."""
    methods = {run.data.tags.get("method"): run for run in experiment.methods}
    tapp = methods.get("tapp")
    planner = tapp.data.params.get("planner") if tapp is not None else None
    report.check(planner == "tapp", "planner param", "the tapp run's planner is 'tapp'", f"tapp's planner: {planner!r}")
    search = [run for run in experiment.children if run.data.tags.get("stage") == "search"]
    rounds = (experiment.parent.data.params.get("search_rounds"), *(r.data.params.get("search_rounds") for r in search))
    report.check(
        len(set(rounds)) == 1 and len(rounds) == 2,
        "search rounds",
        f"parent and search run agree: search_rounds={rounds[0]}",
        f"search_rounds on the parent and the search run: {rounds}",
    )


def check_metrics(experiment: Experiment, report: Report) -> None:
    methods = experiment.methods
    if not methods:
        report.add("MISSING", "method runs", "no child run has a `method` tag")
        return
    first = list(methods[0].data.metrics)
    report.check(
        bool(first) and first[0] == STEP_METRIC,
        "metric order",
        f"{STEP_METRIC} is logged first (the compare page plots the first shared metric)",
        f"the first metric logged is {first[0] if first else None!r}; the compare page plots that one",
    )
    long = [
        f"{run.data.tags.get('method')}: {key}={run.data.metrics[key]!r}"
        for run in methods
        for key in (STEP_METRIC, "step_time_low_s", "step_time_high_s")
        if key in run.data.metrics and significant_digits(run.data.metrics[key]) > SIGNIFICANT_DIGITS
    ]
    report.check(
        not long,
        "rounding",
        f"{STEP_METRIC} and its interval are logged with at most {SIGNIFICANT_DIGITS} significant digits (the UI "
        "shows metric values as logged)",
        f"metrics the runs list shows raw with more than {SIGNIFICANT_DIGITS} significant digits: {long[:4]}",
    )
    colours = {run.data.tags.get("method"): run.data.tags.get("mlflow.runColor") for run in methods}
    report.check(
        all(colours.values()) and len(set(colours.values())) == len(colours),
        "run colours",
        f"every method run has its own colour (mlflow.runColor): {colours}",
        f"method runs' colours (mlflow.runColor) missing or shared: {colours}",
    )
    unnamed = [run.info.run_name for run in methods if not NAMED_TIME.search(run.info.run_name or "")]
    report.check(
        not unnamed,
        "run names",
        "every method run's name carries its step time (what MLflow's default columns and chart legends show)",
        f"method runs whose name carries no step time: {unnamed}",
    )
    expands = any(run.data.tags.get("mlflow.runType") == "evaluation" for run in experiment.children)
    report.add(
        "INFO",
        "children",
        "a child has mlflow.runType=evaluation: the UI expands the parent on a first visit"
        if expands
        else "collapsed on a first visit in start-time order (the UI keeps runsExpanded "
        "out of saved views); sorted by a metric, the list is flat and every child shows",
    )


# ---------------------------------------------------------------- the browser


def find_browser(explicit: str | None) -> tuple[str | None, str]:
    """(Chromium's path, None) or (None, why not)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return None, "the playwright package is not installed (pip install playwright)"
    if explicit:
        return (explicit, "") if Path(explicit).exists() else (None, f"--browser {explicit} does not exist")
    for name in BROWSER_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path, ""
    return None, "no Chromium found (apt-get install chromium, or --browser PATH)"


def rebased(url: str, base: str) -> str:
    """``url`` with its scheme and host replaced by ``base``'s (links name the UI's default address)."""
    parts = urllib.parse.urlsplit(url)
    return base + url[len(f"{parts.scheme}://{parts.netloc}") :]


def urls(base: str, experiment: Experiment, view_key: str | None, printed: str | None) -> dict[str, str]:
    """The pages to open, by screenshot name."""
    eid, parent_id = experiment.experiment_id, experiment.parent.info.run_id
    if printed is not None:
        runs = rebased(printed, base)
    elif view_key is not None:
        runs = f"{base}/#/experiments/{eid}/runs?" + urllib.parse.urlencode(
            {"viewStateShareKey": view_key, "workflowType": "machine_learning"}
        )
    else:
        runs = f"{base}/#/experiments/{eid}/runs?" + urllib.parse.urlencode(
            {
                "workflowType": "machine_learning",
                "searchFilter": f"tags.`mlflow.parentRunId` = '{parent_id}'",
                "orderByKey": f"metrics.`{STEP_METRIC}`",
                "orderByAsc": "true",
            }
        )
    compared = json.dumps([run.info.run_id for run in experiment.methods])
    pages = {
        "01-landing": f"{base}/#/experiments/{eid}",
        "02-runs": runs,
        "02b-reload": runs,
        "03-parent": f"{base}/#/experiments/{eid}/runs/{parent_id}?workflowType=machine_learning",
        "04-charts": runs + "&compareRunsMode=CHART",
        "05-compare": f"{base}/#/compare-runs?"
        + urllib.parse.urlencode({"runs": compared, "experiments": json.dumps([eid])}),
    }
    for run in [experiment.parent, *experiment.children]:  # the parent's table first
        tables = logged_tables(run)
        if tables:
            pages["06-table"] = f"{base}/#/experiments/{eid}/runs/{run.info.run_id}/artifacts/{tables[0]}"
            break
    note = experiment.parent.data.tags.get("mlflow.note.content", "")
    linked = re.search(r"\]\((\S+/artifacts/report/\S+)\)", note)
    if linked:
        pages["07-report"] = rebased(linked.group(1), base)
    return pages


def settle(page: Any, selector: str) -> bool:
    """Wait for ``selector``, then a moment for the data behind it; False when it never came."""
    try:
        page.wait_for_selector(selector, timeout=PAGE_TIMEOUT_S * 1000)
    except Exception:  # playwright's TimeoutError; the caller reports what is absent
        return False
    time.sleep(2.0)
    return True


def browse(executable: str, pages: dict[str, str], experiment: Experiment, out: Path, report: Report) -> None:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            for name, url in pages.items():
                context = browser.new_context(viewport={"width": 1600, "height": 1800 if name == "03-parent" else 1000})
                context.add_init_script(CLOSE_ASSISTANT)
                try:
                    page = context.new_page()
                    page.goto(url, wait_until="load", timeout=PAGE_TIMEOUT_S * 1000)
                    LOOKS[name](page, experiment, report)
                    page.screenshot(path=str(out / f"{name}.png"))
                    report.add("INFO", f"screenshot {name}", f"{out / (name + '.png')} <- {url}")
                finally:
                    context.close()
        finally:
            browser.close()


def look_landing(page: Any, experiment: Experiment, report: Report) -> None:
    with contextlib.suppress(Exception):  # the UI redirects /experiments/ID to a tab once it has the experiment
        page.wait_for_url(re.compile(r"#/experiments/[^/?]+/[a-z]"), timeout=PAGE_TIMEOUT_S * 1000)
    settle(page, "main, [role=main], h2")
    route = urllib.parse.urlsplit(page.url).fragment.split("?")[0]
    if "/runs" in route:
        report.add("OK", "landing", f"a new browser lands on the runs ({route})")
    else:
        report.add(
            "LIMIT",
            "landing",
            f"a new browser lands on {route}: MLflow 3.17.2 takes it from the browser's "
            "stored workflowType (default genai), not from an experiment tag; links must carry "
            "workflowType=machine_learning",
        )


def look_runs(page: Any, experiment: Experiment, report: Report) -> None:
    columns = shown_columns(page)
    if columns is None:
        report.add("MISSING", "runs list", "no runs table appeared")
        return
    shown = [column for column in WANTED_COLUMNS if column in columns]
    report.check(
        in_view_order(columns),
        "runs columns",
        f"{', '.join(shown)} are columns, in that order",
        f"columns shown: {shown or 'none'} of {list(WANTED_COLUMNS)}; all columns, left to right: {columns}",
    )
    body = page.inner_text("body")
    names = [run.info.run_name for run in experiment.methods]
    visible = [name for name in names if name in body]
    report.check(
        len(visible) == len(names),
        "runs rows",
        f"all {len(names)} method runs are rows",
        f"method runs visible: {visible} of {names} (children collapsed?)",
    )
    cells = page.eval_on_selector_all(".ag-row[row-index='0'] .ag-cell", "els => els.map(e => e.innerText)")
    words = [line.strip() for cell in cells for line in cell.splitlines()]
    report.add("INFO", "runs first row", " | ".join(w for w in words if w and not w.startswith("#")) or "(none)")


def shown_columns(page: Any) -> list[str] | None:
    """The runs table's column ids once it is drawn, left to right as the browser shows them (the grid's DOM order
    is not its visual order); None when no table came."""
    if not settle(page, "[role=columnheader][col-id]"):
        return None
    cells = page.eval_on_selector_all(
        "[role=columnheader][col-id]",
        "els => els.map(e => [e.getBoundingClientRect().left, e.getAttribute('col-id')])",
    )
    return [str(column) for _, column in sorted(cells, key=lambda cell: float(cell[0]))]


def in_view_order(columns: list[str]) -> bool:
    """Whether ``WANTED_COLUMNS`` are all shown, in the saved view's order."""
    positions = [columns.index(c) for c in WANTED_COLUMNS if c in columns]
    return len(positions) == len(WANTED_COLUMNS) and positions == sorted(positions)


def look_reload(page: Any, experiment: Experiment, report: Report) -> None:
    """The printed link, then reloaded (MLflow 3.17: default columns, the run names carrying the step times); then,
    in a fresh browser, the printed link, the README's click on Override saved view, a reload and the address
    opened as a bookmark in a new tab: are the step time and interval columns there each time?"""
    url = page.url
    report.check(column_check(page, report, "1-opened"), "before reload", "step time and interval columns", "missing")
    page.reload(wait_until="load")
    if column_check(page, report, "2-reloaded"):
        report.add("OK", "after reload", "the reloaded link keeps the step time and interval columns")
    else:
        body = page.inner_text("body")
        named = [run.info.run_name for run in experiment.methods if run.info.run_name in body]
        report.add(
            "LIMIT",
            "after reload",
            "MLflow 3.17 wrote the view's filter and sort into the address and then no longer applies the view: "
            f"default columns; the run names there carry the step time and interval for {len(named)} of "
            f"{len(experiment.methods)} methods",
        )
    context = page.context.browser.new_context(viewport={"width": 1600, "height": 1000})
    context.add_init_script(CLOSE_ASSISTANT)
    try:
        fresh = context.new_page()
        fresh.goto(url, wait_until="load", timeout=PAGE_TIMEOUT_S * 1000)
        report.check(column_check(fresh, report, "3-opened"), "override", "columns before the click", "missing")
        clicked = click_override(fresh)
        report.check(clicked, "override", f"clicked {OVERRIDE_BUTTON!r}", f"no {OVERRIDE_BUTTON!r} button")
        fresh.reload(wait_until="load")
        report.check(
            column_check(fresh, report, "4-overridden-reloaded"),
            "after reload",
            f"after {OVERRIDE_BUTTON!r}, the reloaded link keeps the step time and interval columns",
            f"after {OVERRIDE_BUTTON!r}, the reloaded link lost the step time or interval columns",
        )
        bookmark = context.new_page()
        bookmark.goto(fresh.url, wait_until="load", timeout=PAGE_TIMEOUT_S * 1000)
        report.check(
            column_check(bookmark, report, "5-bookmark"),
            "bookmark",
            "the reloaded address, opened in a new tab, shows the step time and interval columns",
            "the reloaded address, opened in a new tab, lost the step time or interval columns",
        )
    finally:
        context.close()


def column_check(page: Any, report: Report, step: str) -> bool:
    """Whether the runs table shows the view's columns (the step time and its interval among them) in the view's
    order; a screenshot and the address, as INFO."""
    columns = shown_columns(page) or []
    page.screenshot(path=str(report.out / f"02b-{step}.png"))
    report.add("INFO", f"reload {step}", f"{page.url} -> columns {[c for c in columns if '`' in c]}")
    return in_view_order(columns)


def click_override(page: Any) -> bool:
    """Click the shared view's Override saved view button (it keeps the view in the browser's local storage)."""
    try:
        page.get_by_role("button", name=OVERRIDE_BUTTON).click(timeout=10_000)
    except Exception:  # playwright's TimeoutError: the banner is not there
        return False
    time.sleep(2.0)
    return True


def look_parent(page: Any, experiment: Experiment, report: Report) -> None:
    settle(page, "text=About this run")
    with contextlib.suppress(Exception):  # no "Show more" when the description is short
        page.get_by_text("Show more", exact=True).first.click(timeout=3000)
        time.sleep(1.0)
    tables = page.eval_on_selector_all("table", "els => els.map(e => e.innerText)")
    names = [run.data.tags.get("method", "") for run in experiment.methods]
    result = [text for text in tables if sum(name in text for name in names) >= max(1, len(names) // 2)]
    report.check(
        bool(result),
        "parent page",
        "the description shows the result table: " + (result[0].splitlines()[0] if result else ""),
        "no table of the methods on the parent's page",
    )


def look_charts(page: Any, experiment: Experiment, report: Report) -> None:
    if not settle(page, "[data-testid=draggable-chart-cards-grid]"):
        report.add("MISSING", "charts", "no chart appeared")
        return
    cards = page.eval_on_selector_all(
        "[data-testid=draggable-chart-cards-grid] > *", "els => els.map(e => e.innerText)"
    )
    titles = [card.split("\n")[0] for card in cards]
    report.check(
        bool(titles) and titles[0] == CHART_METRIC,
        "charts",
        f"the first chart plots {CHART_METRIC} (its bars labelled with two decimals: 4 digits of a step time)",
        f"the first charts plot {titles[:4]} (alphabetical unless a saved view orders them)",
    )
    names = [run.info.run_name for run in experiment.methods]
    seen = page.evaluate(VISIBLE_TEXTS, {"selector": "[data-testid=draggable-chart-cards-grid] > *", "texts": names})
    beside = page.evaluate(VISIBLE_TEXTS, {"selector": "body", "texts": names})
    report.check(
        len(beside) == len(names),
        "chart names",
        f"the run list beside the charts names all {len(names)} method runs (each with its step time and the "
        f"colour of its bars); the first chart's legend shows {len(seen)} of them (it keeps two lines)",
        f"the run list beside the charts names {len(beside)} of {len(names)} method runs",
    )


def look_compare(page: Any, experiment: Experiment, report: Report) -> None:
    settle(page, "text=Parallel Coordinates Plot")
    body = page.inner_text("body")
    match = re.search(r"Metrics:\s*(.*?)\s*Clear All", body, re.S)
    metrics = [line.strip() for line in (match.group(1) if match else "").splitlines() if line.strip()]
    report.check(
        metrics[:1] == [STEP_METRIC],
        "compare page",
        f"the parallel-coordinates plot shows {STEP_METRIC}",
        f"the parallel-coordinates plot starts with {metrics or 'nothing'} (the first metric the runs logged)",
    )


def look_report(page: Any, experiment: Experiment, report: Report) -> None:
    settle(page, "text=step_time.md")
    body = page.inner_text("body")
    report.check(
        "Single-step training time" in body,
        "report link",
        "the description's report link opens the step-time table",
        "the description's report link did not show the step-time table",
    )


def look_table(page: Any, experiment: Experiment, report: Report) -> None:
    settle(page, "text=View as table")
    body = page.inner_text("body")
    rows = page.eval_on_selector_all("[role=row], tr", "els => els.length")
    report.check(
        "View as table" in body and rows > 1,
        "table artifact",
        f"the logged table opens as a table ({rows} rows drawn)",
        "the logged table did not render as a table",
    )


VISIBLE_TEXTS = """({selector, texts}) => {
  const root = document.querySelector(selector);
  if (!root) return [];
  const clipped = (e) => {
    const box = e.getBoundingClientRect();
    if (box.width === 0 || box.height === 0) return true;
    for (let a = e.parentElement; a; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (/(hidden|auto|scroll|clip)/.test(style.overflow + style.overflowY + style.overflowX)) {
        const limit = a.getBoundingClientRect();
        if (box.top >= limit.bottom - 1 || box.bottom <= limit.top + 1) return true;
      }
    }
    return false;
  };
  const found = new Set();
  for (const e of root.querySelectorAll('*')) {
    const own = Array.from(e.childNodes).filter(n => n.nodeType === 3).map(n => n.textContent).join('').trim();
    if (texts.some(t => own.startsWith(t.slice(0, 24))) && !clipped(e)) found.add(texts.find(t => own.startsWith(t.slice(0, 24))));
  }
  return Array.from(found);
}"""
"""The texts of ``texts`` drawn unclipped (by their first characters: long names are cut with an ellipsis) under
``selector``."""


LOOKS = {
    "01-landing": look_landing,
    "02-runs": look_runs,
    "02b-reload": look_reload,
    "03-parent": look_parent,
    "04-charts": look_charts,
    "05-compare": look_compare,
    "06-table": look_table,
    "07-report": look_report,
}


# ---------------------------------------------------------------- main


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tracking-uri", help="MLflow store or server to check (default: run tapp run first)")
    parser.add_argument("--experiment", default="tapp", help="MLflow experiment name (default: tapp)")
    parser.add_argument("--out", type=Path, default=Path("out/ui_check"), help="screenshots and summary.txt")
    parser.add_argument("--view-key", help="saved view to open (default: one sorted on step_time_s)")
    parser.add_argument("--browser", help="Chromium executable (default: chromium on PATH)")
    parser.add_argument("--require-browser", action="store_true", help="fail when no browser is found")
    parser.add_argument("--strict", action="store_true", help="exit 1 when something is MISSING")
    parser.add_argument("--tapp-timeout", type=float, default=900.0, help="seconds allowed for tapp run")
    parser.add_argument("--measure", action="store_true", help="tapp run measures on the workers (not --estimate-only)")
    parser.add_argument("--tapp-args", default="", help="more arguments for tapp run, e.g. '--model tiny_cnn'")
    return parser.parse_args()


def check(arguments: argparse.Namespace, workdir: Path, report: Report) -> None:
    printed = None
    tracking_uri = arguments.tracking_uri
    if not tracking_uri:
        extra = ([] if arguments.measure else ["--estimate-only"]) + arguments.tapp_args.split()
        tracking_uri, printed = run_tapp(workdir, arguments.tapp_timeout, extra)
        shutil.copy(workdir / "tapp-run.log", arguments.out / "tapp-run.log")  # what the terminal showed
        report.check(bool(printed), "printed link", f"tapp run printed {printed}", "tapp run printed no runs link")
    experiment = open_experiment(tracking_uri, arguments.experiment)
    view_key = pick_view(experiment, arguments.view_key)
    if arguments.view_key and view_key is None:
        raise CheckError(f"no saved view {arguments.view_key!r} ({VIEW_TAG_PREFIX}{arguments.view_key})")
    check_store(experiment, view_key, report)
    executable, why_not = find_browser(arguments.browser)
    if executable is None:
        report.add("SKIPPED", "browser", why_not)
        if arguments.require_browser:
            raise CheckError(f"no browser: {why_not}")
        return
    with mlflow_ui(tracking_uri, arguments.out) as base:
        pages = urls(base, experiment, view_key, printed)
        browse(executable, pages, experiment, arguments.out, report)
    report.add("INFO", "runs URL", pages["02-runs"])


def main() -> int:
    arguments = parse_arguments()
    arguments.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that every `finally` below stops its process
    report = Report(out=arguments.out)
    with tempfile.TemporaryDirectory(prefix="tapp-ui-check-") as workdir:
        try:
            check(arguments, Path(workdir), report)
        except CheckError as error:
            print(f"ui_check: {error}", file=sys.stderr)
            return 2
        finally:
            (arguments.out / "summary.txt").write_text(report.text())
    print(f"{report.missing} missing; screenshots and summary.txt in {arguments.out}")
    return 1 if arguments.strict and report.missing else 0


if __name__ == "__main__":
    sys.exit(main())
