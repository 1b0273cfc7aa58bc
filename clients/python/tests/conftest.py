"""A real `opgate dev` child process per test session (SQLite, its in-process broker served
over TCP, the simulated providers, every role and the API), found at $OPGATE_BIN."""

import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

BIN = os.environ.get("OPGATE_BIN", str(Path(__file__).resolve().parents[3] / "target/debug/opgate"))


@pytest.fixture(scope="session")
def dev():
    work = Path(tempfile.mkdtemp(prefix="opgate-py-"))
    ready = work / "ready.json"
    log = open(work / "dev.log", "w")
    proc = subprocess.Popen(
        [BIN, "dev", "--fresh", "--ledger", str(work / "ledger.db"), "--api-listen", "127.0.0.1:0",
         "--sim-listen", "127.0.0.1:0", "--ready-file", str(ready)],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )
    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, f"opgate dev exited; see {work / 'dev.log'}"
        assert time.time() < deadline, "opgate dev never got ready"
        time.sleep(0.1)
    info = json.loads(ready.read_text())
    info["work"] = str(work)
    yield info
    proc.terminate()
    proc.wait(timeout=30)


def sim_effects(dev, provider, needle):
    """Effects at the simulated provider whose key contains `needle`."""
    with urllib.request.urlopen(dev["sim"] + "/effects", timeout=10) as r:
        report = json.loads(r.read())
    return sum(e["count"] for e in report["effects"] if e["provider"] == provider and needle in e["key"])
