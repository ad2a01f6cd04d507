"""The dashboard in a real browser: headless Chromium (Debian's package) driven by Playwright loads
each page against a stack that ran real jobs, checks what a person would read there, and saves a
screenshot of each page in the test's tmp dir (dashboard-*.png)."""

from __future__ import annotations

import os
import shutil

import pytest

from gpuq.service import jobs
from gpuq.service.db import write_scope
from tests.conftest import IN_CI
from tests.dashboard_stack import TRAIN_EPOCHS, stack_with_jobs

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

CHROMIUM = os.environ.get("GPUQ_TEST_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
# Flags that let Chromium run headless as root in a container with no GPU and no network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A Chromium page with a fresh profile; skipped without Chromium or Playwright (failed in CI)."""
    missing = None
    if not os.path.exists(CHROMIUM):
        missing = f"Chromium ({CHROMIUM}); `apt-get install chromium`"
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "the playwright package"
    if missing:
        if IN_CI:
            pytest.fail(f"{missing} is missing, and CI must run the browser tests")
        pytest.skip(f"{missing} is missing")
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                       args=FLAGS, viewport={"width": 1400, "height": 900})
        try:
            yield context.new_page()
        finally:
            context.close()


@pytest.fixture(scope="module", params=["postgres"])
def ran(request, tmp_path_factory, redis_url):
    yield from stack_with_jobs(request, tmp_path_factory, redis_url)


def shoot(page, tmp_path, name: str) -> None:
    path = tmp_path / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000  # a rendered page, not a blank one
    print(f"screenshot: {path}")


def test_queue_page_in_chromium_lists_the_jobs_and_the_gpus_with_their_bars(browser, ran, dash, tmp_path):
    st, j = ran
    response = browser.goto(dash.url + "/")
    assert response.status == 200
    assert browser.title() == "queue - gpuq"
    rows = browser.locator("table.jobs tbody tr")
    assert rows.count() == 6
    running = browser.locator("table.jobs tbody tr", has_text="long-nap")
    assert "running" in running.inner_text()
    held = browser.locator("table.jobs tbody tr", has_text="on-hold")
    assert "held" in held.inner_text()
    gpus = browser.locator("table.gpus tbody tr")
    assert gpus.count() == st.settings.fake_gpus
    busy = browser.locator("table.gpus tbody tr", has_text="long-nap")
    assert busy.locator("svg.bar").count() == 2 and busy.locator("svg.bar").first.is_visible()
    shoot(browser, tmp_path, "queue")


def test_job_page_in_chromium_shows_parameters_result_epochs_and_plots(browser, ran, dash, tmp_path):
    st, j = ran
    browser.goto(dash.url + "/")
    browser.click(f"a[href='/jobs/{j.train}']")
    browser.wait_for_url(f"**/jobs/{j.train}")
    assert browser.locator("h1").inner_text() == f"Job {j.train}: tiny-train"
    with write_scope(st.settings) as session:
        result = jobs.get_job(session, j.train).result
    assert "test_acc" in browser.locator("h2:has-text('Result') + table").inner_text()
    assert f"{result['test_acc']:.4g}" in browser.locator("h2:has-text('Result') + table").inner_text()
    assert browser.locator("table.metrics tbody tr").count() == TRAIN_EPOCHS
    for chart in ("loss", "accuracy", "GPU utilisation", "GPU memory used", "GPU power"):
        svg = browser.locator(f"svg[aria-label='{chart}']")
        assert svg.is_visible(), chart
        assert svg.locator("polyline").count() >= 1, chart
    shoot(browser, tmp_path, "job")


def test_usage_page_in_chromium_shows_each_users_gpu_hours_for_day_and_week(browser, ran, dash, tmp_path):
    st, j = ran
    with write_scope(st.settings) as session:
        user = jobs.get_job(session, j.train).user
    browser.goto(dash.url + "/usage")
    assert "Usage, last day" in browser.locator("h1").inner_text()
    assert user in browser.locator("table.usage-users tbody").inner_text()
    browser.click("a[href='/usage?period=week']")
    browser.wait_for_url("**/usage?period=week")
    assert "Usage, last week" in browser.locator("h1").inner_text()
    assert browser.locator("svg[aria-label^='GPUs kept busy'] polyline").count() >= 1
    shoot(browser, tmp_path, "usage")
