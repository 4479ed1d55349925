"""The web console in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``, driven
by Selenium) against a live cluster: the overview shows its nodes and streams, the stream page a
record's value, and a value holding HTML or script is shown as text, never run.

``SBPSTREAM_CONSOLE_SCREENSHOT=docs/img/console.png`` also saves the stream page's screenshot
(the one in docs/operations.md).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from sbpstream.client import AsyncClient
from sbpstream.cluster import LocalCluster
from sbpstream.net.ports import free_port

pytestmark = [pytest.mark.integration, pytest.mark.browser]

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
WAIT_S = 30.0  # a hang guard for a cold browser on a loaded machine, not a measurement
SCRIPT_VALUE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402


@pytest.fixture()
def browser() -> Iterator[object]:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("chromium and chromium-driver are not installed (scripts/ensure-sysdeps.sh)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1000,760"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(options=opts, service=webdriver.ChromeService(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def text_of(driver: object, css: str) -> str:
    els = driver.find_elements(By.CSS_SELECTOR, css)  # type: ignore[attr-defined]
    return " ".join(e.text for e in els)


async def test_console_shows_cluster_streams_and_records_as_text(
        tmp_path: Path, browser: object) -> None:
    admin = free_port()
    with LocalCluster(tmp_path, datanodes=1,
                      extra_pm_args=["--metrics-port", str(admin)]) as cluster:
        async with AsyncClient(cluster.pm_address) as client:
            sid = await client.create_stream()
            async with client.producer(linger_ms=0) as p:
                values = [b"hello console %d" % i for i in range(5)] + [SCRIPT_VALUE.encode()]
                futs = [await p.send(sid, v) for v in values]
                await p.flush()
                assert [await f for f in futs] == list(range(len(values)))
        d = browser
        wait = WebDriverWait(d, WAIT_S, poll_frequency=0.2)
        d.get(f"http://127.0.0.1:{admin}/")  # type: ignore[attr-defined]
        wait.until(lambda _: str(sid) in text_of(d, "#streams td a"))
        nodes = text_of(d, "#nodes")
        assert cluster.datanodes[0].address in nodes and "live" in nodes

        d.get(f"http://127.0.0.1:{admin}/#/stream/{sid}")  # type: ignore[attr-defined]
        wait.until(lambda _: "hello console 4" in text_of(d, "#tail"))
        values_shown = [e.get_attribute("textContent") for e in
                        d.find_elements(By.CSS_SELECTOR, "#tail pre.value")]  # type: ignore
        assert values_shown[-1] == SCRIPT_VALUE  # the markup, shown as text
        assert d.execute_script("return window.__pwned === undefined")  # type: ignore
        assert not d.find_elements(By.CSS_SELECTOR, "#view script, #view img")  # type: ignore
        assert "0*" in text_of(d, "#ranges") or "1*" in text_of(d, "#ranges")  # primary marked
        assert d.find_elements(By.CSS_SELECTOR, "canvas#rate")  # type: ignore[attr-defined]
        shot = os.environ.get("SBPSTREAM_CONSOLE_SCREENSHOT")
        if shot:  # a few points of the rate chart, for the picture
            wait.until(lambda _: d.execute_script("return history.points.length >= 4"))
        png = d.get_screenshot_as_png()  # type: ignore[attr-defined]
        assert png.startswith(b"\x89PNG")
        if shot:
            Path(shot).write_bytes(png)

        d.get(f"http://127.0.0.1:{admin}/#/connections")  # type: ignore[attr-defined]
        wait.until(lambda _: "DATA_NODE" in text_of(d, "#connections"))
