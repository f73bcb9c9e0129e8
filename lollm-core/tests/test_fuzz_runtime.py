"""Property tests (hypothesis) of what lollm runs on behalf of a checkpoint or a plugin.

* Chat templates generated from a small grammar of Jinja constructs (loops,
  ranges, conditions, namespace variables, macros that may recurse, filters,
  string methods, arithmetic with small and huge numbers): every render ends
  in text or a TokenizerError, within a few seconds of CPU time and with
  bounded memory; and a render that succeeds is exactly the one of jinja2's
  plain sandbox (the bounds change nothing they let through).
* Family records with fields of any type and plugins that raise anything:
  building the registry never raises, every bad plugin is listed as broken,
  and ``lollm families`` still prints.

Budget: the profile ``ci`` (the default, what ``nox -t tests`` runs) makes a
fixed, derandomized set of examples and lowers the templates' CPU bound so it
stays under a minute; ``LOLLM_FUZZ_PROFILE=long`` (``nox -s fuzz_runtime``)
runs many more random examples with the real bounds.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from _core_helpers import CpuTimeExceeded, cpu_time_limit, peak_python_memory
from lollm.errors import TokenizerError
from lollm.tokenizer import chat

settings.register_profile(
    "ci", max_examples=150, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "long", max_examples=3000, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = os.environ.get("LOLLM_FUZZ_PROFILE", "ci")
pytestmark = pytest.mark.filterwarnings("ignore:Generating overly large repr")
settings.load_profile(PROFILE)

#: CPU seconds a case may take before it counts as a hang (the templates' own bound is far below).
CASE_CPU_SECONDS = 5.0
#: Python memory a case may allocate at its peak.
CASE_MEMORY_MB = 256


@pytest.fixture(autouse=True)
def render_bound(monkeypatch):
    # In CI, a smaller CPU bound keeps the many looping examples cheap; the mechanism is the same.
    if PROFILE == "ci":
        monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.2)


# -- a small grammar of Jinja ------------------------------------------------------------------

NUMBERS = st.one_of(
    st.integers(-3, 12),
    st.sampled_from([100, 4096, 99999, 100001, 10**6, 10**9, 10**18, 2**64]),
)
ATOMS = st.one_of(
    NUMBERS.map(str),
    st.sampled_from([
        "'a'", "'ab\\n'", "''", "'%s|%5d'", "'{}-{:>7}'", "'<|im_end|>'", "m.content", "m.role", "ns.s", "ns.n",
        "messages|length", "v0", "v1", "loop.index", "true", "none", "[1, 2, 3]", "{'k': 'v'}", "messages",
    ]),
)
FILTERS = st.one_of(
    st.sampled_from(["length", "upper", "trim", "string", "first", "list", "tojson", "reverse|list", "unique|list",
                     "sort", "sum", "join(',')", "replace('a', 'aaaa')", "format(7)", "center(9)", "indent(2)", "int",
                     "float", "wordcount", "title", "items|list", "dictsort", "map('string')|join"]),
    NUMBERS.map(lambda n: f"indent({n})"),
    NUMBERS.map(lambda n: f"center({n})"),
    NUMBERS.map(lambda n: f"batch({n}, 0)|list"),
    NUMBERS.map(lambda n: f"slice({n})|list"),
    NUMBERS.map(lambda n: f"truncate({n})"),
    NUMBERS.map(lambda n: f"tojson(indent={n})"),
    NUMBERS.map(lambda n: f"round({n})"),
)
OPERATORS = st.sampled_from(["+", "-", "*", "**", "~", "%", "//", "==", "<", "and", "in"])
METHODS = st.sampled_from(["ljust", "rjust", "center", "zfill", "expandtabs", "split", "replace", "join", "format", "startswith"])


def _expressions():
    def extend(inner):
        return st.one_of(
            st.tuples(inner, OPERATORS, inner).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
            st.tuples(inner, FILTERS).map(lambda t: f"({t[0]})|{t[1]}"),
            st.tuples(inner, METHODS, inner).map(lambda t: f"({t[0]}|string).{t[1]}({t[2]})"),
            st.tuples(inner, METHODS, inner, inner).map(lambda t: f"({t[0]}|string).{t[1]}({t[2]}, {t[3]})"),
            inner.map(lambda e: f"range({e})"),
            inner.map(lambda e: f"f({e})"),
            st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}]"),
            st.tuples(inner, inner, inner).map(lambda t: f"({t[0]} if {t[1]} else {t[2]})"),
        )

    return st.recursive(ATOMS, extend, max_leaves=6)


EXPRESSIONS = _expressions()
TEXT = st.sampled_from(["x", "\n", " ", "<|im_start|>", "{{ '{' }}", "é"])


def _statements():
    def extend(inner):
        body = st.lists(inner, min_size=0, max_size=3).map("".join)  # an empty body too: loops that only cost time
        return st.one_of(
            st.tuples(st.sampled_from(["v0", "v1"]), EXPRESSIONS, body).map(
                lambda t: f"{{% for {t[0]} in {t[1]} %}}{t[2]}{{% endfor %}}"),
            st.tuples(st.sampled_from(["v0", "v1"]), NUMBERS, body).map(
                lambda t: f"{{% for {t[0]} in range({t[1]}) %}}{t[2]}{{% endfor %}}"),
            st.tuples(body).map(lambda t: f"{{% for m in messages %}}{t[0]}{{% endfor %}}"),
            st.tuples(body).map(lambda t: f"{{% for v0 in [[1], [2, [3]]] recursive %}}{t[0]}{{{{ loop(v0) if v0 is iterable }}}}{{% endfor %}}"),
            st.tuples(EXPRESSIONS, body, body).map(lambda t: f"{{% if {t[0]} %}}{t[1]}{{% else %}}{t[2]}{{% endif %}}"),
            st.tuples(body).map(lambda t: f"{{% filter upper %}}{t[0]}{{% endfilter %}}"),
        )

    base = st.one_of(
        TEXT,
        EXPRESSIONS.map(lambda e: f"{{{{ {e} }}}}"),
        EXPRESSIONS.map(lambda e: f"{{% set ns.s = {e} %}}"),
        EXPRESSIONS.map(lambda e: f"{{% set ns.n = {e} %}}"),
    )
    return st.recursive(base, extend, max_leaves=8)


STATEMENTS = _statements()
MACRO_BODIES = st.sampled_from([
    "{{ a }}", "{{ a ~ a }}", "{{ f(a) }}", "{{ f(a ~ a) }}", "{% if a|length < 50 %}{{ f(a ~ 'x') }}{% endif %}",
    "{{ f(a + 1) if a is number else a }}", "{{ caller() if caller is defined }}",
])
TEMPLATES = st.tuples(MACRO_BODIES, st.lists(STATEMENTS, min_size=1, max_size=4)).map(
    lambda t: "{% set ns = namespace(s='a', n=1) %}{% macro f(a) %}" + t[0] + "{% endmacro %}" + "".join(t[1])
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi\nthere %s {0}"}]


def plain_render(source: str) -> str:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = chat._tojson
    env.globals.pop("lipsum", None)
    return env.from_string(source).render(messages=chat.prepare_messages(MESSAGES), add_generation_prompt=True,
                                          tools=None, documents=None)


@given(TEMPLATES)
def test_a_generated_template_renders_or_fails_cleanly_within_bounds(source):
    try:
        with cpu_time_limit(CASE_CPU_SECONDS), peak_python_memory(CASE_MEMORY_MB):
            try:
                text = chat.ChatTemplate(source, "fuzz/chat_template.jinja").render(MESSAGES, add_generation_prompt=True)
            except TokenizerError as exc:
                assert "fuzz/chat_template.jinja" in str(exc)
                event("error: " + str(exc).split(": ", 1)[-1].split(":")[0][:40])  # --hypothesis-show-statistics
                return
    except CpuTimeExceeded:
        pytest.fail(f"no result within {CASE_CPU_SECONDS} s of CPU time:\n{source}")
    assert isinstance(text, str)
    event("rendered")
    if "**" not in source:  # the plain sandbox folds constant powers at compile time, which may never end
        with cpu_time_limit(CASE_CPU_SECONDS):
            assert text == plain_render(source), source


# -- plugin records and plugin objects ------------------------------------------------------------

ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), st.text(max_size=12),
    st.lists(st.one_of(st.text(max_size=6), st.integers(), st.none()), max_size=4),
    st.tuples(st.text(max_size=6)), st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.floats(), st.text(max_size=4)), max_size=3),
)


def _families():
    from lollm.family import CONTRACT_VERSION, SAMPLING_KEYS, Capabilities, Family

    names = st.text(alphabet="abcxyz_0", min_size=1, max_size=6)
    type_lists = st.one_of(st.lists(names, max_size=3).map(tuple), names, ANY_VALUE)
    sampling = st.one_of(
        st.dictionaries(st.sampled_from(sorted(SAMPLING_KEYS) + ["temprature"]),
                        st.one_of(st.integers(-5, 100), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3)),
                        max_size=3),
        ANY_VALUE,
    )
    capabilities = st.one_of(
        st.builds(Capabilities, thinking_toggle=st.one_of(st.booleans(), ANY_VALUE), speculative_head=st.booleans()),
        ANY_VALUE,
    )
    return st.builds(
        Family,
        name=st.one_of(names, ANY_VALUE),
        contract=st.one_of(st.just(CONTRACT_VERSION), ANY_VALUE),
        model_types=type_lists,
        load=st.one_of(st.just("pkg.mod:load"), ANY_VALUE),
        gguf_architectures=st.one_of(st.just(()), type_lists),
        sampling_defaults=sampling,
        capabilities=capabilities,
        parity_reference=st.one_of(st.none(), st.just("pkg.ref:build"), ANY_VALUE),
        description=st.one_of(st.just(""), ANY_VALUE),
    )


class CustomBaseException(BaseException):
    pass


RAISES = st.sampled_from([None, ValueError("bad"), SystemExit(3), KeyboardInterrupt(), GeneratorExit(),
                          CustomBaseException("odd"), RecursionError("deep"), MemoryError()])


def _plugin(items, raises):
    from lollm.hookspecs import hookimpl

    class GeneratedPlugin:
        @hookimpl
        def lollm_register_families(self, register):
            for item in items:
                register(item)
            if raises is not None:
                raise raises

    return GeneratedPlugin()


PLUGINS = st.lists(
    st.tuples(st.lists(st.one_of(_families(), ANY_VALUE), max_size=3), RAISES),
    min_size=1, max_size=4,
)


@settings(max_examples=60 if PROFILE == "ci" else 1500)
@given(PLUGINS)
def test_generated_plugins_never_break_the_registry_or_the_families_listing(plugins):
    from typer.testing import CliRunner

    import lollm.load.plugins as plugin_module
    from lollm.cli import app
    from lollm.load.plugins import build_registry

    with cpu_time_limit(CASE_CPU_SECONDS):
        registry = build_registry(entry_points=[], extra_plugins=[(f"gen{i}", _plugin(items, raises))
                                                                  for i, (items, raises) in enumerate(plugins)])
    names = {f"gen{i}" for i in range(len(plugins))}
    assert {b.plugin for b in registry.broken} | {f.plugin for f in registry.families} <= names
    for i, (items, raises) in enumerate(plugins):
        if raises is not None:
            assert f"gen{i}" in {b.plugin for b in registry.broken}
    for installed in registry.families:  # what was accepted is clean
        family = installed.family
        assert isinstance(family.name, str) and all(isinstance(t, str) for t in family.model_types)
        assert isinstance(family.model_types, tuple) and isinstance(family.sampling_defaults, dict)
        for key in family.model_types:
            if f"model type:{key}" not in registry.conflicts:
                assert registry.route(key) is not None
    saved = plugin_module._REGISTRY
    plugin_module._REGISTRY = registry
    try:
        for args in (["families"], ["families", "--json"]):
            done = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
            assert done.exit_code == 0, (done.output, done.exception)
    finally:
        plugin_module._REGISTRY = saved
