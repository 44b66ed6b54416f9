"""megatrain's Grafana dashboard, as a user meets it: its JSON as Grafana's dashboard model, `megatrain dashboard
--out`, and a run on a `ray start --head --metrics-export-port` cluster: the dashboard beside Ray's in the session's
folder, every megatrain series at Ray's metrics endpoint, and every panel's query answered by a real Prometheus
(Debian's `prometheus`) scraping the run on the `prometheus.yml` Ray generated.

One cluster serves both live tests (a module fixture): it runs under its own RAY_TMPDIR, which is how its processes
are found and ended (`ray stop` would stop other people's Rays), and the driver finds it as a user's does, through
the record `ray start` leaves there (Ray sends its auth token to a cluster found that way; RAY_ADDRESS would need
RAY_AUTH_MODE=token too). Under CI (.ci/run exports MEGATRAIN_CI=1) a missing `prometheus` fails the test;
elsewhere it is skipped with the command that installs it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import TIMEOUT, assert_nothing_left, dead_segments, free_port, private_ray_env, run_cli

from megatrain.telemetry import WAIT_CAUSES, metric_specs
from megatrain.telemetry.dashboard import DASHBOARD_FILE, dashboard, dashboard_json, write_into_ray_session

CI_VARIABLE = "MEGATRAIN_CI"
INSTALL = "sudo apt-get install -y prometheus"
# what the test puts for Grafana's variables: the run at hand, every node and executor, a short rate window
RATE_WINDOW = "15s"
WAIT_S = 90  # for series to appear: Ray reports every second here, Prometheus scrapes every second


def panels() -> list[dict]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def variables() -> dict[str, dict]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def for_run(expr: str, run: str) -> str:
    """A panel's query as Grafana sends it for this run, every node and executor."""
    values = {"$run": run, "$node": ".*", "$executor": ".*", "$__rate_interval": RATE_WINDOW}
    return re.sub(r"\$\w+", lambda v: values[v.group(0)], expr)


# ---- the JSON ----

def test_the_dashboard_is_a_grafana_dashboard_model() -> None:
    model = json.loads(dashboard_json())
    assert model == dashboard() and model["uid"] and model["title"] == "megatrain"
    assert isinstance(model["schemaVersion"], int)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells = set()
    for p in model["panels"]:
        pos = p["gridPos"]
        assert set(pos) == {"h", "w", "x", "y"} and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & cell, f"{p['title']} overlaps another panel"
        cells |= cell

    named = variables()
    assert named["datasource"]["type"] == "datasource" and named["datasource"]["query"] == "prometheus"
    for name in ("run", "node", "executor"):
        assert named[name]["type"] == "query" and named[name]["datasource"] == "${datasource}"
        assert named[name]["query"]["query"] == named[name]["definition"].strip()

    queried = set()
    for p in panels():
        assert p["type"] == "timeseries" and p["datasource"] == "${datasource}" and p["title"]
        assert len(p["description"]) > 40, p["title"]
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        for t in p["targets"]:
            assert set(re.findall(r"\$\w+", t["expr"])) <= {"$run", "$node", "$executor", "$__rate_interval"}
            assert 'run=~"$run"' in t["expr"], t["expr"]
            queried |= set(re.findall(r"ray_megatrain_\w+", t["expr"]))
    # each cause of waiting on a panel of its own, gradients too
    causes = [re.findall(r'cause="(\w+)"', t["expr"]) for p in panels() for t in p["targets"]]
    assert sorted(c for found in causes for c in found) == sorted((*WAIT_CAUSES, "other"))
    # every metric actors/metrics.py records is on a panel (skipped steps: a healthy run has none to show)
    wanted = {s.series + ("_bucket" if s.kind == "histogram" else "") for s in metric_specs.METRICS
              if s is not metric_specs.SKIPPED_STEPS}
    assert queried == wanted


def test_megatrain_dashboard_writes_the_same_dashboard(tmp_path: Path) -> None:
    out = tmp_path / "grafana" / "dash.json"
    result = run_cli("dashboard", "--out", str(out))
    assert result.returncode == 0 and str(out) in result.output, result.output
    assert out.read_text() == dashboard_json()
    printed = run_cli("dashboard")
    assert printed.returncode == 0 and json.loads(printed.output) == dashboard()


def test_the_dashboard_goes_where_ray_provisions_dashboards(tmp_path: Path) -> None:
    session = tmp_path / "session"
    session.mkdir()
    assert write_into_ray_session(session) is None and not any(session.rglob("*"))  # Ray wrote no Grafana files

    # the folder Ray's provisioning file names (RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR), else the session's own
    default = session / "metrics" / "grafana" / "dashboards"
    default.mkdir(parents=True)
    assert write_into_ray_session(session) == default / DASHBOARD_FILE
    elsewhere = tmp_path / "dashboards"
    elsewhere.mkdir()
    provisioning = session / "metrics" / "grafana" / "provisioning" / "dashboards" / "default.yml"
    provisioning.parent.mkdir(parents=True)
    provisioning.write_text(f"apiVersion: 1\nproviders:\n  - name: Ray\n    options:\n      path: {elsewhere}\n")
    assert write_into_ray_session(session) == elsewhere / DASHBOARD_FILE
    assert (elsewhere / DASHBOARD_FILE).read_text() == dashboard_json()


# ---- a run on a `ray start` cluster ----

# Trains the tiny model until the stop file appears (the test queries while the run is live: Ray drops a gauge
# that is no longer set, and Prometheus marks it stale).
DRIVER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import numpy as np
    import megatrain

    run_file, stop_file = Path(sys.argv[1]), Path(sys.argv[2])
    engine = megatrain.Engine("tiny", device="cpu", precision="fp32", optimizer_workers=1, lr=1e-3)
    run_file.with_suffix(".tmp").write_text(engine.run_id)
    os.replace(run_file.with_suffix(".tmp"), run_file)  # the test reads it as soon as it exists
    rng = np.random.default_rng(0)
    deadline = time.monotonic() + 240
    while not stop_file.exists() and time.monotonic() < deadline:
        engine.step(rng.integers(0, 256, (2, 32)))
        time.sleep(0.2)  # leaves the 2 cores room for Ray's agents and Prometheus
    engine.shutdown()
""")


@dataclass
class LiveRun:
    run: str  # the run's id: its series carry it as the `run` label
    session: Path  # the Ray session directory
    metrics_port: int  # the node's metrics export port


def ray_start_with_metrics(env: dict[str, str]) -> int:
    """`ray start --head` with its dashboard (which writes Ray's Grafana and Prometheus files into the session)
    and a metrics export port, on free ports; returns that port."""
    ports = {flag: free_port() for flag in ("--port", "--ray-client-server-port", "--dashboard-port",
                                            "--dashboard-agent-listen-port", "--metrics-export-port")}
    proc = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--num-cpus=2",
                           "--disable-usage-stats", f"--object-store-memory={100 * 2**20}",
                           *(f"{flag}={port}" for flag, port in ports.items())],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT, start_new_session=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ports["--metrics-export-port"]


def wait_for(what: str, ready: Callable[[], Any], log: Path | None = None) -> Any:
    """ready()'s first true value within WAIT_S; else the test fails naming what did not happen."""
    deadline = time.monotonic() + WAIT_S
    while not (value := ready()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert value, f"{what} within {WAIT_S} s" + (f"; driver log:\n{log.read_text()[-4000:]}" if log else "")
    return value


@pytest.fixture(scope="module")
def live_run() -> Iterator[LiveRun]:
    with private_ray_env() as env:  # its processes killed and its directory removed after, a failure or not
        env["RAY_metrics_report_interval_ms"] = "1000"  # Ray's 10 s default: the test would wait for it
        tmp = env["RAY_TMPDIR"]
        dead_before = dead_segments()
        run_file, stop_file, log = Path(tmp, "run"), Path(tmp, "stop"), Path(tmp, "driver.log")
        driver = None
        try:
            metrics_port = ray_start_with_metrics(env)
            Path(tmp, "driver.py").write_text(DRIVER)
            with log.open("w") as out:
                driver = subprocess.Popen([sys.executable, str(Path(tmp, "driver.py")), str(run_file),
                                           str(stop_file)], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True)
            wait_for("the driver started its run", lambda: run_file.exists() or driver.poll() is not None, log)
            assert run_file.exists(), log.read_text()[-4000:]
            yield LiveRun(run_file.read_text(), Path(tmp, "ray", "session_latest").resolve(), metrics_port)
            stop_file.touch()
            assert driver.wait(timeout=TIMEOUT) == 0, log.read_text()[-4000:]
        finally:
            stop_file.touch()
            if driver is not None and driver.poll() is None:
                driver.kill()
            assert_nothing_left(env, dead_before)


def test_a_run_leaves_its_dashboard_and_series_in_the_ray_session(live_run: LiveRun) -> None:
    folder = live_run.session / "metrics" / "grafana" / "dashboards"
    assert (folder / "default_grafana_dashboard.json").is_file()  # Ray's, which its Grafana provisioning loads
    assert (folder / DASHBOARD_FILE).read_text() == dashboard_json()

    # every megatrain metric at the node's metrics endpoint (skipped steps: none in this run; post-training: a train
    # run records none, test_grpo_trainer.py's run does), as Ray names them
    expected = {s.series + ("_bucket" if s.kind == "histogram" else "") for s in metric_specs.METRICS
                if s not in (metric_specs.SKIPPED_STEPS, metric_specs.POST_TRAINING)}

    def exported() -> set[str] | None:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{live_run.metrics_port}/metrics", timeout=5).read()
        except OSError:
            return None
        names = {line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
                 if "megatrain_" in line and not line.startswith("#") and f'run="{live_run.run}"' in line}
        return names if expected <= names else None

    found = wait_for(f"every series of {sorted(expected)} at the metrics endpoint", exported)
    assert all(name.startswith("ray_megatrain_") for name in found), found


def prometheus_binary() -> str:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get(CI_VARIABLE):
            pytest.fail(f"CI needs Prometheus for the dashboard's queries: .ci/run installs it ({INSTALL})")
        pytest.skip(f"needs Prometheus to run the dashboard's queries: {INSTALL}")
    return binary


def api(port: int, path: str, **params: str) -> list:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    answer = json.loads(urllib.request.urlopen(url, timeout=10).read())
    assert answer["status"] == "success", answer
    return answer["data"]["result"] if isinstance(answer["data"], dict) else answer["data"]


def test_every_panel_query_returns_the_run_from_prometheus(live_run: LiveRun, tmp_path: Path) -> None:
    binary = prometheus_binary()
    # Ray's prometheus.yml (its file_sd targets: this cluster's metrics endpoints), scraping every second
    config = yaml.safe_load((live_run.session / "metrics" / "prometheus" / "prometheus.yml").read_text())
    config["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (tmp_path / "prometheus.log").open("w") as log:
        prometheus = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                                       f"--web.listen-address=127.0.0.1:{port}",
                                       f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        queries = {f"{p['title']} / {t['refId']}": for_run(t["expr"], live_run.run)
                   for p in panels() for t in p["targets"] if p["title"] != "Post-training"}  # a train run: none

        def unanswered() -> dict[str, str]:
            try:
                return {name: q for name, q in queries.items() if not api(port, "query", query=q)}
            except OSError:  # not listening yet
                return queries

        deadline = time.monotonic() + WAIT_S
        while (missing := unanswered()) and prometheus.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert not missing, f"panel queries without a series: {missing}\n{(tmp_path / 'prometheus.log').read_text()}"

        # the variables' label_values(...) as Grafana asks Prometheus for them
        named = variables()
        for name in ("run", "node", "executor"):
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", named[name]["definition"]).groups()
            values = api(port, f"label/{label}/values", **{"match[]": for_run(selector, live_run.run)})
            assert values and (name != "run" or live_run.run in values), (name, values)
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prometheus.kill()
            prometheus.wait()
