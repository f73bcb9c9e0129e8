"""The chat page of ``lollm serve`` attaches an image (session 50's trial: it could not), in a real headless Chromium.

The tiny Gemma 3 with a vision tower of test_gemma3_vision_engine_entry_points.py, served in this
process (uvicorn in a thread), with a second entry listed as reading no images. What it proves:

* the Image button's file goes with the next message as an ``image_url`` part (a ``data:`` URL): the
  answer's prompt holds the image's 16 tokens, the user's bubble shows the picture as a thumbnail that
  the page's CSP (``img-src data:``) lets load, and the console has no error (a CSP refusal is one);
* the button is disabled, with a title saying why, for a model whose /v1/models entry says ``vision: false``.
"""

from __future__ import annotations

import time

import pytest

from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.serve.models import ModelEntry, ServedModels
from lollm.testing import serving
from lollm.testing.browser import Browser

from test_gemma3_vision import TOKENS
from test_gemma3_vision_engine_entry_points import NAME, folder, loaded, picture  # noqa: F401 (fixtures)


def wait(browser: Browser, script: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout  # a hang guard far above the second these take
    while not browser.js(script):
        assert time.monotonic() < deadline, f"the page never satisfied: {script}"
        time.sleep(0.05)


def test_the_page_sends_an_attached_image_and_shows_it(loaded, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By

    path = tmp_path / "boat.png"
    picture(3, (90, 60)).save(path)
    server = ModelServer(loaded, name=NAME, context=128)
    text_only = ModelEntry("text-only", "text-only", 0, load=lambda: None, images=False)  # listed, never loaded
    models = ServedModels([ModelEntry(NAME, NAME, 0, load=lambda: server, images=server.reads_images), text_only],
                          max_body_bytes=server.max_body_bytes)
    models.load_first()
    try:
        with Browser() as browser, serving.app_in_thread(create_app(models)) as root:
            browser.driver.get(root + "/")
            wait(browser, "return document.body && document.body.dataset.ready === 'true'")
            assert browser.js("return document.getElementById('attach').disabled") is False
            browser.js("document.getElementById('image').hidden = false")  # a file input takes keys when shown
            browser.driver.find_element(By.ID, "image").send_keys(str(path))
            wait(browser, "return document.querySelectorAll('#pending img').length === 1")
            browser.js("document.getElementById('max_tokens').value = '3'; document.getElementById('temperature').value = '0'")
            browser.driver.find_element(By.ID, "input").send_keys("what is it")
            browser.click("#send")
            wait(browser, "return Number(document.body.dataset.replies || 0) > 0")
            assert browser.texts(".msg.error") == []
            stats = browser.texts(".msg.assistant .stats")[-1]
            assert int(stats.split(" · prompt ")[1].split()[0]) > TOKENS, stats  # the image's tokens are in the prompt
            thumb = "document.querySelector('.msg.user .thumbs img')"
            assert browser.js(f"return {thumb}.src.startsWith('data:image/png;base64,') && {thumb}.naturalWidth") == 90
            assert browser.js("return document.querySelectorAll('#pending img').length") == 0
            assert browser.errors() == []
            browser.js("const s = document.getElementById('model'); s.value = 'text-only';"
                       "s.dispatchEvent(new Event('change'))")
            assert browser.js("return document.getElementById('attach').disabled") is True
            assert "text-only reads no images" in browser.js("return document.getElementById('attach').title")
    finally:
        server.close()
