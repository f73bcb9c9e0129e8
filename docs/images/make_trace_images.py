"""Take the screenshots in docs/trace.md and the README from trace pages, with headless Chromium.

    python docs/images/make_trace_images.py NAME=PAGE.html[:SELECTOR[:CLICK]] ...

Each argument writes docs/images/NAME.png: the element SELECTOR of the page (default:
the top of the page as a 1100 x 900 window), after clicking the token at position
CLICK when given. The pages used for the pictures of docs/trace.md:

    lollm trace ~/.cache/lollm/qwen2.5-coder-0.5b-instruct/safetensors -o qwen25.html \\
        -p "Complete the function so that it returns the n-th Fibonacci number: def fib(n): ..."
    lollm trace ~/.cache/lollm/gemma-3-270m/safetensors --compare -o gemma3.html \\
        -p "The Eiffel Tower is in Paris, the capital of France. The Colosseum is in Rome, the capital of"

and tiny random checkpoints of gemma3 (window 6), qwen3_5 and qwen3_5_moe (as the tests write them).
The PNGs are then shrunk with ``pngquant`` when it is installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from lollm.testing.browser import Browser

HERE = Path(__file__).resolve().parent


def main(args: list[str]) -> None:
    with Browser(width=1100, height=900) as browser:
        for arg in args:
            name, _, spec = arg.partition("=")
            page, _, rest = spec.partition(":")
            selector, _, click = rest.partition(":")
            opened = browser.open(page)
            if opened.errors:
                raise SystemExit(f"{page}: console errors {opened.errors}")
            browser.driver.set_window_size(1100, 900)
            if click:
                browser.click(f'.tok[data-pos="{click}"]')
            out = HERE / f"{name}.png"
            if selector:
                browser.screenshot(out, selector)
            else:
                browser.js("window.scrollTo(0, 0)")
                browser.driver.save_screenshot(str(out))
            if shutil.which("pngquant"):
                subprocess.run(["pngquant", "--force", "--skip-if-larger", "--quality", "60-90", "--output", str(out), str(out)], check=False)
            print(out, out.stat().st_size)


if __name__ == "__main__":
    main(sys.argv[1:])
