"""A real headless Chromium (Debian's chromium and chromium-driver, driven by Selenium 4)
for tests and game days that use the control plane's pages as a human would.

Selenium blocks: call it from a thread (`asyncio.to_thread`) when the control plane under
test shares the event loop. Without Chromium a test skips, or fails under
COVEY_REQUIRE_BROWSER=1 (CI, where a skipped browser test would hide a broken page).
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def screenshot_dir() -> Path:
    folder = Path(os.environ.get("COVEY_SCREENSHOT_DIR", "reports"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def require_chromium() -> None:
    if shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER):
        return
    if os.environ.get("COVEY_REQUIRE_BROWSER") == "1":
        pytest.fail("COVEY_REQUIRE_BROWSER=1 but Debian's chromium and chromium-driver "
                    "are not installed (apt-get install -y chromium chromium-driver)")
    pytest.skip("no Chromium here: apt-get install -y chromium chromium-driver")


@contextmanager
def chromium(window: str = "1300,1600", offline: bool = False) -> Iterator[Any]:
    """A headless Chromium; Selenium Manager downloads nothing (it would fail here).
    `offline`: every request beyond this host goes to a proxy that is not there, as on a
    machine without internet."""
    require_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", f"--window-size={window}",
                 *(("--proxy-server=http://127.0.0.1:9",) if offline else ())):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def click(driver: Any, element_id: str, timeout_s: float = 10) -> None:
    """Click once the element can take it: shown by the page's script, and not covered.

    The page's live updates re-lay it out (an agent's row changes, the banner turns red),
    so an element Selenium found clickable can move before the click lands and the click
    hits something else. Such a click is tried again, within the same timeout.
    """
    from selenium.common.exceptions import (
        ElementClickInterceptedException,
        StaleElementReferenceException,
    )
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    def clicked(d: Any) -> bool:
        element = expected_conditions.element_to_be_clickable(("id", element_id))(d)
        if not element:
            return False
        element.click()
        return True

    WebDriverWait(driver, timeout_s, ignored_exceptions=(
        ElementClickInterceptedException, StaleElementReferenceException)).until(
        clicked, f"#{element_id} never took a click (never shown, or always covered)")


def type_into(driver: Any, element_id: str, text: str, timeout_s: float = 10) -> None:
    """Type into a field once it is shown (send_keys focuses it: no click that could miss)."""
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.wait import WebDriverWait

    WebDriverWait(driver, timeout_s).until(
        expected_conditions.visibility_of_element_located(("id", element_id)),
        f"#{element_id} never became visible").send_keys(text)


def sign_in(driver: Any, base_url: str, email: str, password: str) -> None:
    """Sign in through /administration's own form, as a human would."""
    driver.get(f"{base_url}/administration")
    type_into(driver, "email", email)
    type_into(driver, "password", password)
    click(driver, "sign-in")
    driver.find_element("id", "who")  # the signed-in page (implicit wait)


def pull_fleet_switch(driver: Any, reason: str) -> None:
    """The red button, then the confirmation with a reason."""
    click(driver, "fleet-kill")
    type_into(driver, "fleet-reason", reason)
    click(driver, "fleet-confirm")


async def in_browser(fn: Any, *args: Any) -> Any:
    """Run one of Selenium's blocking calls off the event loop: in the tests, the control
    plane under test serves on this very loop."""
    return await asyncio.to_thread(fn, *args)
