"""Headless Chromium (the system's ``chromium`` and ``chromedriver``) driven by Selenium, for the web
chat page. Without them the browser tests skip, naming what to install; where
``LOCALLLM_BROWSER_TESTS=required`` (CI) they fail instead."""

from __future__ import annotations

import os
import shutil

import pytest

BROWSER_REQUIRED = os.environ.get("LOCALLLM_BROWSER_TESTS") == "required"


def _browser_paths() -> tuple[str, str] | None:
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    driver = shutil.which("chromedriver")
    return (chromium, driver) if chromium and driver else None


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for a module (its localStorage lives as long as it does)."""
    paths = _browser_paths()
    if paths is None:
        message = "no chromium and chromedriver on PATH (Debian: apt install chromium chromium-driver)"
        if BROWSER_REQUIRED:
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=paths[1]))
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
