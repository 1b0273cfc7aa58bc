"""On a failed test, the browser's screen and the page's text go beside the screenshots
(failed-<test>.png / .txt), so a failure in CI can be read."""

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and "browser" in item.funcargs:
        from test_console import SHOTS  # noqa: PLC0415
        driver = item.funcargs["browser"]
        SHOTS.mkdir(parents=True, exist_ok=True)
        try:
            driver.save_screenshot(str(SHOTS / f"failed-{item.name}.png"))
            (SHOTS / f"failed-{item.name}.txt").write_text(
                driver.current_url + "\n\n" + driver.find_element("tag name", "body").text)
        except Exception as e:  # the browser itself may be what failed
            report.sections.append(("screenshot", f"none: {e}"))
