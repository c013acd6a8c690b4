"""The dashboard in a real headless Chromium, against a running server and real Redis.

The screenshot lands in the test's tmp_path (its path is printed) so a
person can check that the page reads well.
"""
from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from collections.abc import Iterator

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from common import contracts as c
from common.cancel import cancel_and_wait
from crawl_monitor import http_api
from test.test_ops_http import monitoring_update, seed, serve

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


@contextmanager
def headless_chromium() -> Iterator[webdriver.Chrome]:
    """Chromium with a throwaway profile; quit() stops both it and chromedriver."""
    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), \
        "chromium and chromium-driver are missing: `make test` installs them"
    profile = tempfile.mkdtemp(prefix="ops-dashboard-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", "--window-size=1440,1100"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class HourOfHistory(http_api.History):
    """A server that has been up for 55 minutes, so the chart has a full hour to draw."""

    def __init__(self, span: float = http_api.HISTORY_SECONDS):
        super().__init__(span)
        now = time.time()
        for i in range(660, 0, -1):
            t = now - i * 5
            wave = 0.5 + 0.5 * ((i // 60) % 2)
            general = {"success_rps": 40 * wave, "error_rps": 2 * (i % 120 < 10), "processing_rate": 41 * wave,
                       "global_max_rps": 179.075}
            self.samples.append({"time": t, "general": general, "sources": {
                "flickr": {"rps": 42 * wave, "rate_limit": 178.375},
                "animaldiversity": {"rps": 0.4 if i > 60 else 0.0, "rate_limit": 0.5},
                "phylopic": {"rps": 0.2 if i > 200 else 0.0, "rate_limit": 0.2},
            }})


async def fake_worker(redis) -> None:
    """Requests at about 40/s to flickr, as workers would count them and score its outcomes."""
    while True:
        await redis.incrby(c.source_requests_key("flickr"), 2)
        await redis.zadd(c.ACTIVE_SOURCES, {"flickr": time.time()}, gt=True)
        await asyncio.sleep(0.05)


def load_dashboard(url: str, screenshot: Path) -> dict:
    with headless_chromium() as driver:
        driver.get(url)
        WebDriverWait(driver, 20).until(
            lambda d: len(d.find_elements(By.CSS_SELECTOR, "#sources tbody tr[data-source]")) == 3)
        rows = {row.get_attribute("data-source"): [td.text for td in row.find_elements(By.TAG_NAME, "td")]
                for row in driver.find_elements(By.CSS_SELECTOR, "#sources tbody tr[data-source]")}
        polylines = len(driver.find_elements(By.CSS_SELECTOR, "#chart polyline"))
        general = driver.find_element(By.ID, "general").text
        banner_hidden = driver.find_element(By.ID, "banner").get_attribute("hidden") is not None
        omitted = driver.find_element(By.ID, "omitted").text
        driver.save_screenshot(str(screenshot))
        console_errors = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert console_errors == []
    return {"rows": rows, "polylines": polylines, "general": general, "banner_hidden": banner_hidden,
            "omitted": omitted}


async def test_dashboard_shows_sources_limits_errors_halts_and_a_chart(
        redis_client, redis_url, tmp_path, monkeypatch) -> None:
    await seed(redis_client)
    await redis_client.sadd(c.INBOUND_SOURCES, "quiet")  # seen, nothing crawled lately: counted, not shown
    monkeypatch.setattr(http_api, "History", HourOfHistory)
    screenshot = tmp_path / "dashboard.png"
    # The fake worker has a client of its own: cancelling it mid-command must not
    # leave a half-read connection in the pool the server's handlers use.
    worker_redis = redis_client.__class__.from_url(redis_url)
    async with serve(redis_client, monitoring_update, sample_every=0.5) as base:
        worker = asyncio.create_task(fake_worker(worker_redis))
        try:
            await asyncio.sleep(1.2)  # two samples apart: an achieved rate to show
            page = await asyncio.wait_for(
                asyncio.to_thread(load_dashboard, f"{base}/", screenshot), timeout=120)
        finally:
            await cancel_and_wait([worker])
            await worker_redis.aclose()
    sys.__stderr__.write(f"\n[dashboard] screenshot: {screenshot}\n")
    cells = page["rows"]
    assert list(cells) == ["animaldiversity", "flickr", "phylopic"]
    rows = {source: " | ".join(texts) for source, texts in cells.items()}
    assert "halted" in rows["phylopic"] and "paused" in rows["animaldiversity"] and "ok" in rows["flickr"]
    assert "178.38" in rows["flickr"] and "override 0.5" in rows["animaldiversity"]
    assert "500×20" in rows["flickr"] and "Timeout×2" in rows["flickr"] and "200×48" in rows["flickr"]
    assert "13,188" in rows["flickr"]
    assert [cells[s][9] for s in ("flickr", "animaldiversity", "phylopic")] == ["6,790", "0", "9,932"]  # backlog
    assert page["omitted"].startswith("and 1 more sources, quiet for 10 minutes"), page["omitted"]
    assert 10 < float(cells["flickr"][6]) < 80, rows["flickr"]  # achieved req/s, from the fake worker
    # Its limit, its capacity discovery ceiling, what the adaptive back-off allows now, and the
    # response times it judges by.
    assert [cells["flickr"][i] for i in (2, 4, 5)] == ["120", "178.38", "210 / 450"], rows["flickr"]
    assert cells["flickr"][3].startswith("200") and "discovery" in cells["flickr"][3], rows["flickr"]
    assert "discovery" not in cells["animaldiversity"][3]
    assert "adaptation off" in cells["phylopic"][4]
    assert page["polylines"] >= 4
    assert "phylopic" in page["general"] and page["banner_hidden"]
    assert screenshot.stat().st_size > 10_000


@contextmanager
def monitor_process(env: dict[str, str]) -> Iterator[list[dict]]:
    """``python -m crawl_monitor``, its monitoring_update lines collected as they come."""
    process = subprocess.Popen([sys.executable, "-m", "crawl_monitor"], env=env, cwd=ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    updates: list[dict] = []

    def read() -> None:
        for line in process.stdout:
            with suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == c.EVENT_MONITORING_UPDATE:
                    updates.append(record)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield updates
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        reader.join(timeout=5)


async def test_dashboard_shows_what_the_real_monitor_logs(stack_env, redis_client, tmp_path) -> None:
    """The real monitor's monitoring_update lines, served as the monitor's main will serve them."""
    await seed(redis_client)
    sources = tmp_path / "sources.json"
    sources.write_text(json.dumps([{"source_name": "flickr", "image_count": 500_000_000},
                                   {"source_name": "animaldiversity", "media_count": 20_000},
                                   {"source_name": "phylopic", "image_count": 10_000}]))
    screenshot = tmp_path / "dashboard-real-monitor.png"
    with monitor_process({**stack_env, "SOURCES_URL": str(sources)}) as updates:
        for _ in range(200):  # until the regulator has applied SOURCES_URL and a line is logged
            # The limit from SOURCES_URL; a new source is granted a tenth of it at first (slow start).
            state = await redis_client.hgetall(c.adaptive_key("flickr"))
            if updates and state.get("ceiling") == "200" and "enabled" in state:  # the monitor's, not seed's
                break
            await asyncio.sleep(0.1)
        assert updates, "the monitor logged no monitoring_update within 20 s"
        async with serve(redis_client, lambda: updates[-1], sample_every=0.5) as base:
            page = await asyncio.to_thread(load_dashboard, f"{base}/", screenshot)
    sys.__stderr__.write(f"\n[dashboard] screenshot: {screenshot}\n")
    rows = {source: " | ".join(texts) for source, texts in page["rows"].items()}
    assert list(rows) == ["animaldiversity", "flickr", "phylopic"]
    assert page["rows"]["flickr"][2] == "200"  # the largest sources get the top rate (SPEC.md §3)
    assert "halted" in rows["phylopic"] and "13,188" in rows["flickr"]
