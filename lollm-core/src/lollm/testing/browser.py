"""A real headless browser for the tests of ``lollm trace`` pages (and for the screenshots in docs/).

Debian's Chromium and its ChromeDriver (``apt-get install chromium chromium-driver``;
``.ci/run`` installs them), driven by selenium (``lollm-core[browser]``). No browser is
downloaded: a missing one is an error that says what to install, never a skip.

::

    with Browser() as browser:
        page = browser.open("trace.html")     # waits until the page says it is drawn
        page.errors                           # console errors and uncaught exceptions so far
        browser.click('.tok[data-pos="3"]')
        browser.js("return document.body.dataset.pos")

Paths: ``$LOLLM_CHROMIUM`` (default ``/usr/bin/chromium``) and ``$LOLLM_CHROMEDRIVER``
(default ``/usr/bin/chromedriver``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Lazy imports below: selenium (an optional extra, lollm-core[browser]); the module loads without it.

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# flags for a machine with no network and no screen (and, under CI, running as root)
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")


def executables() -> tuple[str, str]:
    """(chromium, chromedriver) paths; raises RuntimeError naming what to install when one is missing."""
    chromium = os.environ.get("LOLLM_CHROMIUM", CHROMIUM)
    driver = os.environ.get("LOLLM_CHROMEDRIVER", CHROMEDRIVER)
    missing = [p for p in (chromium, driver) if not (Path(p).is_file() and os.access(p, os.X_OK))]
    if missing:
        raise RuntimeError(f"no browser for the trace page tests: {', '.join(missing)} not found. Install Debian's "
                           f"chromium and chromium-driver (apt-get install -y chromium chromium-driver; .ci/run does), "
                           f"or point $LOLLM_CHROMIUM and $LOLLM_CHROMEDRIVER at them")
    return chromium, driver


@dataclass
class OpenPage:
    """A page opened by :meth:`Browser.open`; ``errors`` holds the console errors seen while it loaded."""

    path: Path
    errors: list[str] = field(default_factory=list)


class Browser:
    """One headless Chromium, reused for many pages (starting one takes a second or two)."""

    def __init__(self, width: int = 1280, height: int = 900):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        chromium, driver = executables()
        self._profile = tempfile.mkdtemp(prefix="lollm-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for flag in FLAGS:
            options.add_argument(flag)
        options.add_argument(f"--user-data-dir={self._profile}")
        options.add_argument(f"--window-size={width},{height}")
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        self.driver = webdriver.Chrome(service=Service(driver), options=options)

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self._profile, ignore_errors=True)

    def errors(self) -> list[str]:
        """Console messages of level SEVERE (console.error, uncaught exceptions, failed loads) since the last call."""
        return [entry["message"] for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def open(self, path: str | Path, *, timeout: float = 60.0) -> OpenPage:
        """Load a page from a file and wait until ``document.body.dataset.ready`` (set when it is drawn)."""
        path = Path(path).resolve()
        self.errors()  # forget what earlier pages said
        self.driver.get(path.as_uri())
        deadline = time.monotonic() + timeout
        while self.js("return document.body && document.body.dataset.ready") != "true":
            if self.js("return !!document.getElementById('error')") or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return OpenPage(path, self.errors())

    def js(self, script: str, *args: object) -> Any:
        """Run JavaScript in the page and return its result."""
        return self.driver.execute_script(script, *args)

    def click(self, selector: str) -> None:
        """Click the first element that matches a CSS selector (scrolled into view first)."""
        from selenium.webdriver.common.by import By

        element = self.driver.find_element(By.CSS_SELECTOR, selector)
        self.js("arguments[0].scrollIntoView({block: 'center'})", element)
        element.click()

    def texts(self, selector: str) -> list[str]:
        """The text of every element that matches a CSS selector."""
        return self.js("return Array.from(document.querySelectorAll(arguments[0]), n => n.textContent)", selector)

    def screenshot(self, path: str | Path, selector: str | None = None, *, width: int | None = None) -> Path:
        """A PNG of the element ``selector`` (or of the whole page), at ``width`` CSS pixels wide when given."""
        from selenium.webdriver.common.by import By

        if width is not None:
            self.driver.set_window_size(width, self.driver.get_window_size()["height"])
        # a window as tall as the page, so that no element is cut at the bottom of the screen
        height = self.js("return document.documentElement.scrollHeight")
        self.driver.set_window_size(self.driver.get_window_size()["width"], height + 100)
        if selector is None:
            self.driver.save_screenshot(str(path))
        else:
            element = self.driver.find_element(By.CSS_SELECTOR, selector)
            self.js("arguments[0].scrollIntoView({block: 'start'})", element)
            element.screenshot(str(path))
        return Path(path)
