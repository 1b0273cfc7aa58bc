"""The operator console in a real headless Chromium (Debian's chromium + chromedriver,
driven by Selenium) against a real `opgate dev` child process: sign in, find an
operation, approve one, resolve one, compensate one; screenshots of each page.

Environment: OPGATE_BIN (the opgate binary), CHROMIUM (default /usr/bin/chromium),
CHROMEDRIVER (default /usr/bin/chromedriver), OPGATE_SCREENSHOTS (where the PNGs go;
default target/ui-screenshots)."""

import json
import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import Select, WebDriverWait

ROOT = Path(__file__).resolve().parents[2]
BIN = os.environ.get("OPGATE_BIN", str(ROOT / "target/debug/opgate"))
SHOTS = Path(os.environ.get("OPGATE_SCREENSHOTS", str(ROOT / "target/ui-screenshots")))


@pytest.fixture(scope="module")
def dev():
    work = Path(tempfile.mkdtemp(prefix="opgate-ui-"))
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
    yield info
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = os.environ.get("CHROMIUM", "/usr/bin/chromium")
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1360,1000",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='opgate-chromium-')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(
        service=Service(os.environ.get("CHROMEDRIVER", "/usr/bin/chromedriver")), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def call(dev, method, path, token, body=None):
    req = urllib.request.Request(dev["api"] + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer " + token,
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sim(dev, path, body):
    req = urllib.request.Request(dev["sim"] + path, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


ENTITY_TYPES = {"capture_payment": "order", "write_off_balance": "account", "send_email": "user",
                "create_ticket": "user"}


def propose(dev, tool, entity, args, **fields):
    status, answer = call(dev, "POST", "/v1/proposals", dev["tokens"]["agent"],
                          {"event_id": "ui-" + uuid.uuid4().hex, "tool": tool,
                           "entity": {"type": ENTITY_TYPES[tool], "id": entity}, "args": args, **fields})
    assert status in (200, 201), answer
    return answer["operation"]["operation_id"]


def wait_status(dev, op_id, wanted, timeout=60):
    deadline = time.time() + timeout
    while True:
        _, op = call(dev, "GET", f"/v1/operations/{op_id}", dev["tokens"]["viewer"])
        if op["status"] in wanted:
            return op
        assert time.time() < deadline, f"{op_id} stayed {op['status']}, wanted {wanted}"
        time.sleep(0.2)


def shot(driver, name):
    """The whole page (the window grows to its height for the picture)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    time.sleep(0.3)  # let the last refresh paint
    size = driver.get_window_size()
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(size["width"], min(max(height + 20, 700), 3000))
    driver.save_screenshot(str(SHOTS / f"{name}.png"))
    driver.set_window_size(size["width"], size["height"])


def wait_for(driver, css, timeout=20):
    return WebDriverWait(driver, timeout).until(EC.presence_of_element_located((By.CSS_SELECTOR, css)))


def wait_text(driver, css, text, timeout=20):
    WebDriverWait(driver, timeout).until(EC.text_to_be_present_in_element((By.CSS_SELECTOR, css), text))


def sign_in(driver, dev, token):
    driver.get(dev["api"] + "/ui/")
    try:
        driver.find_element(By.ID, "sign-out").click()
    except Exception:
        pass
    box = wait_for(driver, "#token")
    WebDriverWait(driver, 10).until(lambda d: box.is_displayed())
    box.clear()
    box.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#sign-in-form button").click()


def act(driver, action, reason, resolution=None):
    wait_for(driver, f'button[data-action="{action}"]').click()
    wait_for(driver, "#action-reason").send_keys(reason)
    if resolution:
        Select(driver.find_element(By.ID, "action-resolution")).select_by_value(resolution)
    driver.find_element(By.ID, "action-confirm").click()
    wait_text(driver, "#action-message", f"{action} recorded")


@pytest.fixture(scope="module")
def seeded(dev):
    """An approval, an operation that exhausts its retries into needs_attention, an email
    whose outcome is ambiguous (reconciled), and plain captures with a duplicate."""
    ops = {}
    ops["write_off"] = propose(dev, "write_off_balance", "acct_ui_1", {"amount": "120.00", "currency": "usd"})
    # 500s without commit, more than capture_payment may try (max_attempts 5): its retries
    # are exhausted and it waits for a person.
    sim(dev, "/faults", {"provider": "payments", "fault": "error_not_committed", "times": 10,
                         "match": "default/payment:order_ui_stuck"})
    ops["stuck"] = propose(dev, "capture_payment", "order_ui_stuck", {"amount": "15.00", "currency": "usd"})
    sim(dev, "/faults", {"provider": "emails", "fault": "timeout_after_commit", "times": 1})
    ops["email"] = propose(dev, "send_email", "user_ui_1", {"template": "welcome", "to": "ui@example.com"},
                           workflow_id="wf-ui", step=1)
    ops["capture"] = propose(dev, "capture_payment", "order_ui_1", {"amount": "49.00", "currency": "usd"})
    again = propose(dev, "capture_payment", "order_ui_1", {"amount": "49.0", "currency": "USD"})
    assert again == ops["capture"], "a re-spelled duplicate is the same operation"
    for i in range(2, 6):
        propose(dev, "capture_payment", f"order_ui_{i}", {"amount": f"{i}.00", "currency": "eur"})
    wait_status(dev, ops["stuck"], {"needs_attention"})
    wait_status(dev, ops["capture"], {"completed_success"})
    return ops


def test_a_bad_token_is_refused_and_an_agent_token_cannot_sign_in(dev, browser):
    sign_in(browser, dev, "not-a-token-of-this-opgate")
    wait_text(browser, "#sign-in-error", "refused")
    sign_in(browser, dev, dev["tokens"]["agent"])
    wait_text(browser, "#sign-in-error", "agent token")
    assert not browser.find_element(By.ID, "view").is_displayed()


def test_a_viewer_sees_the_overview_and_operations_but_no_actions(dev, browser, seeded):
    sign_in(browser, dev, dev["tokens"]["viewer"])
    wait_text(browser, "#who-name", "(viewer)")
    wait_for(browser, "#chart-decisions")
    wait_text(browser, "#stat-approvals", "1")
    wait_text(browser, "#stat-attention", "1")
    # Dedupe hits by reason are charted from the ledger.
    assert "deduplicated" in browser.find_element(By.ID, "chart-decisions").text
    wait_text(browser, "#count-approvals", "1")
    time.sleep(2.5)  # a second sample for the queue and lag charts
    shot(browser, "overview")

    browser.get(dev["api"] + f"/ui/#/operations/{seeded['write_off']}")
    wait_text(browser, "#actions", "Signed in as a viewer")
    assert not browser.find_elements(By.CSS_SELECTOR, "button[data-action]")


def test_an_operator_finds_an_operation_by_filter_and_by_id_prefix(dev, browser, seeded):
    sign_in(browser, dev, dev["tokens"]["operator"])
    wait_text(browser, "#who-name", "(operator)")
    browser.get(dev["api"] + "/ui/#/operations")
    wait_for(browser, "#filter-tool").send_keys("capture_payment")
    Select(browser.find_element(By.ID, "filter-status")).select_by_value("completed_success")
    browser.find_element(By.CSS_SELECTOR, "#ops-filters button[type=submit]").click()
    row = f'#ops-table tr[data-op-id="{seeded["capture"]}"]'
    wait_for(browser, row)
    rows = browser.find_elements(By.CSS_SELECTOR, "#ops-table tbody tr[data-op-id]")
    assert rows and all("completed_success" in r.text and "capture_payment" in r.text for r in rows)
    shot(browser, "operations")

    # The start of an id is enough when one operation's id begins with it.
    _, page = call(dev, "GET", "/v1/operations?limit=500", dev["tokens"]["viewer"])
    others = [o["operation_id"] for o in page["operations"] if o["operation_id"] != seeded["capture"]]
    n = 8
    while any(o.startswith(seeded["capture"][:n]) for o in others):
        n += 1
    box = browser.find_element(By.ID, "find-id")
    box.send_keys(seeded["capture"][:n])
    browser.find_element(By.CSS_SELECTOR, "#ops-filters button[type=submit]").click()
    wait_text(browser, "#op-id", seeded["capture"])
    wait_text(browser, "#timeline", "attempt 1 answered: committed")
    wait_text(browser, "#timeline", "published")


def test_an_operator_approves_a_write_off_and_it_is_sent(dev, browser, seeded):
    sign_in(browser, dev, dev["tokens"]["operator"])
    wait_text(browser, "#who-name", "(operator)")
    browser.get(dev["api"] + "/ui/#/approvals")
    link = wait_for(browser, f'#ops-table tr[data-op-id="{seeded["write_off"]}"] a')
    shot(browser, "approvals")
    link.click()
    wait_text(browser, "#op-id", seeded["write_off"])
    # A reason is required.
    wait_for(browser, 'button[data-action="approve"]').click()
    browser.find_element(By.ID, "action-confirm").click()
    wait_text(browser, "#action-message", "Give a reason")
    browser.find_element(By.ID, "action-reason").send_keys("balance confirmed with finance")
    browser.find_element(By.ID, "action-confirm").click()
    wait_text(browser, "#action-message", "approve recorded")
    op = wait_status(dev, seeded["write_off"], {"completed_success"})
    assert op["external_id"] is None or op["external_id"]
    wait_text(browser, "#timeline", "balance confirmed with finance")
    wait_text(browser, "#timeline", "attempt 1 answered: committed", timeout=30)
    _, events = call(dev, "GET", f"/v1/operations/{seeded['write_off']}/events", dev["tokens"]["viewer"])
    approved = [e for e in events["events"] if e["to"] == "pending_dispatch"]
    assert approved and approved[0]["actor"] == "dev-operator", events


def test_an_operator_resolves_what_needs_attention(dev, browser, seeded):
    browser.get(dev["api"] + "/ui/#/attention")
    link = wait_for(browser, f'#ops-table tr[data-op-id="{seeded["stuck"]}"] a')
    shot(browser, "needs-attention")
    link.click()
    wait_text(browser, "#op-id", seeded["stuck"])
    wait_text(browser, "#timeline", "attempt 5 answered")
    timeline = browser.find_element(By.ID, "timeline").text
    for n in range(1, 6):  # in time order: each attempt is sent before it is answered
        assert timeline.index(f"attempt {n} sent") < timeline.index(f"attempt {n} answered"), timeline
    act(browser, "resolve", "provider shows no charge; customer will retry", resolution="failed")
    op = wait_status(dev, seeded["stuck"], {"failed_permanent"})
    assert op["status"] == "failed_permanent"
    wait_text(browser, "#timeline", "provider shows no charge")
    shot(browser, "operation")


def test_an_operator_compensates_a_capture(dev, browser, seeded):
    browser.get(dev["api"] + f"/ui/#/operations/{seeded['capture']}")
    wait_text(browser, "#op-id", seeded["capture"])
    act(browser, "compensate", "order cancelled by the customer")
    wait_status(dev, seeded["capture"], {"compensated"}, timeout=60)
    wait_text(browser, "#timeline", "compensation", timeout=30)


def test_the_ambiguous_email_was_resolved_without_a_person(dev, browser, seeded):
    wait_status(dev, seeded["email"], {"completed_success"}, timeout=60)
    _, overview = call(dev, "GET", "/v1/overview?window=1h", dev["tokens"]["viewer"])
    resolved = {c["name"]: c["count"] for c in overview["unknown"]["resolved"]}
    assert resolved.get("reconciler/completed_success", 0) >= 1, overview
    assert resolved.get("person/failed_permanent", 0) == 0  # stuck went needs_attention, not unknown
    browser.get(dev["api"] + "/ui/#/overview")
    wait_text(browser, "#chart-unknown", "reconciler/completed_success")


def test_hostile_values_are_shown_as_text(dev, browser, seeded):
    """An entity id with markup is shown, not run (the page's policy forbids inline
    script too)."""
    evil = '<img src=x onerror="document.title=1">'
    op = propose(dev, "create_ticket", "user_<b>x</b>", {"subject": evil, "body": evil},
                 workflow_id="wf-ui-evil", step=1)
    browser.get(dev["api"] + f"/ui/#/operations/{op}")
    wait_text(browser, "#op-id", op)
    text = browser.find_element(By.TAG_NAME, "body").text
    # The arguments are shown as JSON (its quotes escaped), the entity as it came.
    assert "user:user_<b>x</b>" in text and json.dumps(evil) in text
    assert not browser.find_elements(By.CSS_SELECTOR, "#view img")
    assert all(b.text != "x" for b in browser.find_elements(By.CSS_SELECTOR, "#view b"))
    assert browser.title == "opgate console"
