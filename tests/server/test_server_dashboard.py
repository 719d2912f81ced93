"""/dashboard in a real headless Chromium (selenium + Debian's chromium and
chromium-driver) against a real fleet server behind an API key: the page asks for the
key, then shows every model of the fleet with its replicas, its figures change once
traffic is sent, and the browser logs no console error.

`FLEETSERVE_DASHBOARD_SCREENSHOT=PATH` keeps the final screenshot there (e.g.
docs/dashboard.png; the README's copy shows the same fleet after 90 s of mixed traffic);
otherwise it goes to the test's temp folder.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ops_fleet import OPS_API_KEY
from server_proc import ServerProc

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs chromium and chromedriver (Debian: apt-get install chromium chromium-driver)",
)
MODELS = {"chat-a", "chat-b"}
ROUNDS = 4
AUTH = {"Authorization": f"Bearer {OPS_API_KEY}"}


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1440,2200", "--disable-extensions", "--no-first-run"):  # fmt: skip
        options.add_argument(arg)
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Given the driver's path, selenium does not look for one online.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """Console entries at error level since the last call (reading the log drains it)."""
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# The page redraws every second, so elements found by one call may be gone by the next:
# what the page shows is read in one script run instead (atomic within the page).
READ_PAGE = """
const out = {};
const cells = (row) => [...row.querySelectorAll("td")].map((td) => td.textContent);
for (const card of document.querySelectorAll("section.model[data-model]")) {
  const figures = {}, classes = {};
  for (const t of card.querySelectorAll("[data-figure]")) {
    figures[t.dataset.figure] = t.querySelector(".v").textContent;
  }
  for (const row of card.querySelectorAll("tr[data-class]")) classes[row.dataset.class] = cells(row);
  out[card.dataset.model] = {
    figures, classes, replicas: [...card.querySelectorAll("tr[data-replica]")].map(cells),
    charts: card.querySelectorAll(".chart").length,
    lines: card.querySelectorAll(".chart svg path").length,
  };
}
return out;
"""


def shown(driver: Any) -> dict[str, Any]:
    return dict(driver.execute_script(READ_PAGE))


def figure(driver: Any, model: str, name: str) -> str:
    return str(shown(driver)[model]["figures"][name])


def send_traffic(url: str, rounds: int) -> None:
    """A completion to chat-a and a streamed chat in class batch to chat-b per round, a
    round about every poll, so the charts have a few points to draw."""
    c = openai.OpenAI(base_url=f"{url}/v1", api_key=OPS_API_KEY, max_retries=0, timeout=120)
    for i in range(rounds):
        c.completions.create(
            model="chat-a", prompt=f"dashboard {i}", max_tokens=6, extra_body={"ignore_eos": True}
        )
        stream = c.chat.completions.create(
            model="chat-b",
            messages=[{"role": "user", "content": f"hello {i}"}],
            max_tokens=6,
            stream=True,
            extra_headers={"X-Fleetserve-Class": "batch"},
        )
        for _ in stream:
            pass
        time.sleep(1.0)


def test_dashboard_shows_the_fleet_live(
    ops_fleet: ServerProc, browser: Any, tmp_path: Path
) -> None:
    url = ops_fleet.url
    # The page is static and open; its data is behind the key.
    assert httpx.get(f"{url}/dashboard/api/snapshot", timeout=10).status_code == 401
    page = httpx.get(f"{url}/dashboard", timeout=10)
    assert (
        page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]
    )

    browser.get(f"{url}/dashboard")
    wait = WebDriverWait(browser, 30, poll_frequency=0.2)
    status = browser.find_element(By.ID, "status")
    wait.until(lambda d: status.text == "needs the API key")
    key_field = browser.find_element(By.ID, "key")
    assert key_field.is_displayed()
    # The only console entry so far is the refused snapshot (the browser logs every 401).
    refused = console_errors(browser)
    assert refused and all("api/snapshot" in e["message"] and "401" in e["message"]
                           for e in refused), refused  # fmt: skip

    key_field.send_keys(OPS_API_KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()
    wait.until(lambda d: status.text == "live")
    wait.until(lambda d: set(shown(d)) == MODELS)
    # Every replica of each model, with its pool (the admin API's list; one started since
    # the last poll may take a second to appear).
    admin = httpx.get(f"{url}/admin/replicas", headers=AUTH, timeout=10).json()["data"]
    for model in MODELS:
        want = {(f"{model}:{r['index']}", r["pool"]) for r in admin if r["model"] == model}
        assert want
        wait.until(lambda d, m=model, w=want: w <= {(r[0], r[1]) for r in shown(d)[m]["replicas"]})

    before = {m: int(figure(browser, m, "requests_total")) for m in MODELS}
    tokens_before = int(figure(browser, "chat-a", "generation_tokens_total"))
    # The model's total counts every class (the access-log tests share this fleet and send
    # chat-b requests in other classes); the class table counts its own class only.
    cell = shown(browser)["chat-b"]["classes"]["batch"][4]
    batch_before = 0 if cell == "–" else int(cell)
    send_traffic(url, ROUNDS)
    for model in MODELS:
        wait.until(lambda d, m=model: int(figure(d, m, "requests_total")) == before[m] + ROUNDS)
    assert int(figure(browser, "chat-a", "generation_tokens_total")) == tokens_before + 6 * ROUNDS
    assert float(figure(browser, "chat-a", "requests_per_s")) > 0
    # The class the streamed requests went to has latencies now (TTFT p50 is the 7th cell).
    wait.until(lambda d: shown(d)["chat-b"]["classes"]["batch"][6] != "–")
    # The class table is its own series: it may reach the page a poll after the figures.
    want_b = str(batch_before + ROUNDS)
    wait.until(lambda d: shown(d)["chat-b"]["classes"]["batch"][4] == want_b)
    page_a = shown(browser)["chat-a"]
    assert page_a["charts"] == 6 and page_a["lines"] > 0

    assert console_errors(browser) == []
    shot = os.environ.get("FLEETSERVE_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png")
    assert browser.save_screenshot(shot) and Path(shot).stat().st_size > 10_000
