"""Each choice made once: on ``lollm run``'s path the device, the attention backend, the family and the
packed weights are each decided exactly once (issue 36, item 4).

The CLI checks its flags, then :func:`lollm.load.pipeline.prepare` decides every choice with the
checkpoint open, and ``open_model`` takes the resolved options as they are. The test wraps the four
deciders wherever a lollm module holds them, runs ``lollm run`` on the toy checkpoint of
test_cli_run.py, and counts.
"""

from __future__ import annotations

import sys
from collections import Counter

import pytest

import lollm.attention
import lollm.cli  # noqa: F401 - every command module, imported before the deciders are wrapped
import lollm.cli.batch  # noqa: F401
import lollm.engine.llm  # noqa: F401
import lollm.generate.loop  # noqa: F401
import lollm.load.pipeline as pipeline
from test_cli_run import ckpt, invoke, ok, toy_site  # noqa: F401 - the fixtures of the cli tests

#: The deciders, by the module that defines each.
DECIDERS = {"pick_device": pipeline, "resolve_backend": lollm.attention, "route": pipeline, "pick_quantization": pipeline}


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Wrap each decider in every lollm module that holds it (its own module too, so that a call through
    a function-level import counts); the counter of their calls. ``use_backend(name)``, which the generation
    loop enters, sets the name already decided and is not a decider."""
    counter: Counter = Counter()
    for name, home in DECIDERS.items():
        original = getattr(home, name)

        def counted(*args, __name=name, __original=original, **kwargs):
            counter[__name] += 1
            return __original(*args, **kwargs)

        for module_name, module in list(sys.modules.items()):
            if (module_name == "lollm" or module_name.startswith("lollm.")) and getattr(module, name, None) is original:
                monkeypatch.setattr(module, name, counted)
    return counter


def test_lollm_run_decides_each_choice_once(invoke, ckpt, calls):
    done = ok(invoke("run", ckpt, "-p", "hello", "--temperature", "0", "-n", "4"))
    assert done.stdout.strip()
    assert dict(calls) == {"pick_device": 1, "resolve_backend": 1, "route": 1, "pick_quantization": 1}


@pytest.mark.parametrize("named", ["flag", "environment"])
def test_a_named_backend_is_checked_early_and_chosen_once(invoke, ckpt, calls, monkeypatch, named):
    """--attn (or $LOLLM_ATTN) is checked by name before the model is looked for, and chosen once."""
    args = ["--attn", "eager"] if named == "flag" else []
    if named == "environment":
        monkeypatch.setenv("LOLLM_ATTN", "eager")
    done = ok(invoke("run", ckpt, "-p", "hello", "--temperature", "0", "-n", "4", *args))
    assert done.stdout.strip()
    assert dict(calls) == {"pick_device": 1, "resolve_backend": 1, "route": 1, "pick_quantization": 1}


def test_llm_decides_each_choice_once(toy_site, ckpt, calls, monkeypatch):
    """``LLM(path)``, the Python entry: the same one decision per choice as ``lollm run``."""
    import lollm.load.plugins as plugins
    from lollm.engine.llm import LLM

    monkeypatch.syspath_prepend(str(toy_site))
    monkeypatch.setattr(plugins, "_REGISTRY", None)
    LLM(str(ckpt), attn="eager")
    assert dict(calls) == {"pick_device": 1, "resolve_backend": 1, "route": 1, "pick_quantization": 1}
