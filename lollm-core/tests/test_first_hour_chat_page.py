"""The chat page at ``/`` of ``lollm serve`` used as a new user does (issue 41), in a real headless Chromium.

Everything goes through the page's own controls: type a message and press Send, watch the reply
arrive in pieces (a MutationObserver counts how often its text changes), change a setting in the
settings panel, send again and see the setting obeyed; no console error on the way. The server is
the toy family in this process (test_server_hostile.py's ``loaded``), through uvicorn in a thread.

``LOLLM_SCREENSHOTS=DIR`` also writes ``DIR/chat-page.png`` (docs/images/chat-page.png was made so,
on the real Qwen2.5-Coder GGUF: ``python lollm-core/tests/test_first_hour_chat_page.py`` runs it).
"""

from __future__ import annotations

import os
import sys

import pytest

from lollm.serve.app import create_app
from lollm.serve.model_server import ModelServer
from lollm.testing import serving
from lollm.testing.browser import Browser

from test_chat_page import _open, _wait
from test_server_hostile import NAME, loaded  # noqa: F401  (the toy checkpoint, loaded once per module)

#: Counts the changes of the last reply's text while it streams (installed before Send is pressed).
WATCH = """
window.pieces = 0;
new MutationObserver(() => {
  const texts = document.querySelectorAll('.msg.assistant .text');
  const last = texts[texts.length - 1];
  if (last && last.textContent !== window.lastText) { window.lastText = last.textContent; window.pieces += 1; }
}).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});
"""


def _type(browser: Browser, element_id: str, text: str) -> None:
    """Replace what the control ``element_id`` holds with ``text``, keystroke by keystroke."""
    box = browser.driver.find_element("id", element_id)
    box.clear()
    box.send_keys(text)


def _send(browser: Browser, text: str) -> str:
    """Type a message, press Send, wait for the reply's statistics; return them."""
    before = int(browser.js("return Number(document.body.dataset.replies || 0)"))
    _type(browser, "input", text)
    browser.click("#send")
    _wait(browser, f"return Number(document.body.dataset.replies || 0) > {before}")
    assert browser.texts(".msg.error") == []
    return browser.texts(".msg.assistant .stats")[-1]


def chat_session(browser: Browser, root: str, first: str, second: str, *, max_tokens: tuple[str, str]) -> tuple[str, str]:
    """The user's path through the page: a message, a setting changed, another message; both replies' statistics."""
    _open(browser, root + "/")
    _type(browser, "temperature", "0")
    _type(browser, "max_tokens", max_tokens[0])
    browser.js(WATCH)
    stats_one = _send(browser, first)
    _type(browser, "max_tokens", max_tokens[1])  # switch a setting: the next request carries it
    stats_two = _send(browser, second)
    return stats_one, stats_two


def test_a_message_streams_its_reply_and_a_changed_setting_is_obeyed(loaded):  # noqa: F811
    server = ModelServer(loaded, name=NAME, context=64)
    with Browser() as browser, serving.app_in_thread(create_app(server)) as root:
        one, two = chat_session(browser, root, "hello", "again", max_tokens=("6", "2"))
        assert one.startswith("6 tokens · ") and "length" in one, one
        assert browser.js("return window.pieces") >= 3  # the reply grew piece by piece, not in one paint
        assert two.startswith("2 tokens · "), two  # the new max tokens from the settings panel
        assert browser.texts(".msg .role") == ["user", "assistant", "user", "assistant"]
        assert browser.errors() == []
        if os.environ.get("LOLLM_SCREENSHOTS"):
            browser.screenshot(os.path.join(os.environ["LOLLM_SCREENSHOTS"], "chat-page.png"), width=900)


if __name__ == "__main__":  # the docs' screenshot, on a running `lollm serve` of a real model: URL OUT.png
    url, png = sys.argv[1], sys.argv[2]
    with Browser(width=900, height=700) as browser:
        chat_session(browser, url, "Write a Python function that reverses a string.", "Now in one line, please.",
                     max_tokens=("120", "60"))
        assert browser.errors() == []
        browser.js("window.scrollTo(0, 0)")
        browser.screenshot(png, width=900)
        print(f"wrote {png}")
