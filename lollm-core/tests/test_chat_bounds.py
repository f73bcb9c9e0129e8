"""Chat templates are untrusted code: every render is bounded in CPU time, size, integers and depth.

Each hostile template must end in a TokenizerError that names the template's
file, within a few seconds of CPU time and without a large allocation; never
a hang, a RecursionError traceback or gigabytes. Templates that stay within the
bounds render exactly as jinja2's plain sandbox (the one transformers uses).
"""

from __future__ import annotations

import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from _core_helpers import cpu_time_limit, peak_python_memory
from lollm.errors import TokenizerError
from lollm.tokenizer import chat
from lollm.tokenizer.chat import ChatTemplate

ORIGIN = "/models/hostile/chat_template.jinja"
USER = [{"role": "user", "content": "hi"}]

#: (template, words the error must contain)
HOSTILE = {
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "CPU time"),
    "empty loops over a long string": (
        "{% set s = 'a' * 90000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}", "CPU time"),
    "output from nested loops": (
        "{% set s = 'x' * 50000 %}{% for i in range(100000) %}{% for j in range(100000) %}{{ s }}{% endfor %}{% endfor %}",
        "output exceeds"),
    "indent by a billion": ("{{ 'a\nb' | indent(10**9) }}", "indent"),
    "indent within the width limit but huge in total": ("{{ ('a\n' * 4000) | indent(90000) }}", "indent"),
    "integer power": ("{{ 10 ** (10 ** 8) }}", "bits"),
    "integer power folded at compile time": ("{% if false %}{{ 7 ** 99999999 }}{% endif %}{{ 7 ** 99999999 }}", "bits"),
    "squaring in a loop": (
        "{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}", "bits"),
    "string repetition": ("{{ 'x' * 10 ** 10 }}", "'*'"),
    "list repetition": ("{{ (messages * 100000000) | length }}", "'*'"),
    "doubling with ~": (
        "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "'~'"),
    "doubling with +": (
        "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "'+'"),
    "printf width": ("{{ '%0999999999d' % 1 }}", "width"),
    "printf star width": ("{{ '%*d' % (999999999, 1) }}", "%*d"),
    "format filter width": ("{{ '%0999999999d' | format(1) }}", "width"),
    "str.format width": ("{{ '{:>999999999}'.format(1) }}", "format spec"),
    "str.format nested width": ("{{ '{0:>{1}}'.format(1, 999999999) }}", "format spec"),
    "ljust": ("{{ 'a'.ljust(10 ** 9) }}", "ljust"),
    "expandtabs": ("{{ ('\t' * 90000).expandtabs(90000) }}", "expandtabs"),
    "replace blow-up": ("{% set s = 'a' * 90000 %}{{ s.replace('', 'b' * 90000) }}", "replace"),
    "replace filter blow-up": ("{% set s = 'a' * 90000 %}{{ s | replace('a', 'b' * 90000) }}", "replace"),
    "join blow-up": ("{% set s = 'a' * 90000 %}{{ s.join([s] * 90) }}", "join"),
    "center": ("{{ 'a' | center(10 ** 9) }}", "center"),
    "batch padding": ("{{ [1] | batch(10 ** 9, 0) | list }}", "batch"),
    "slice count": ("{{ [1] | slice(10 ** 9) | list }}", "slice"),
    "range": ("{{ range(10 ** 9) | list | length }}", "range"),
    "tojson indent": ("{{ ([[[1]]] * 1000) | tojson(indent=99999) }}", "tojson"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nest deeper"),
    "recursive macro growing its argument": ("{% macro f(s) %}{{ f(s ~ s) }}{% endmacro %}{{ f('ab') }}", "'~'"),
    "recursive loop": ("{% for x in [[1]] recursive %}{{ loop([x]) }}{% endfor %}", "nest deeper"),
    "deeply nested loops": ("{% for a in [1] %}" * 30 + "x" + "{% endfor %}" * 30, "nests too deeply"),
    "deeply nested ifs": ("{% if true %}" * 3000 + "x" + "{% endif %}" * 3000, "nests too deeply"),
    "deeply nested parentheses": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nests too deeply"),
    "lipsum": ("{{ lipsum(10 ** 9) }}", "lipsum"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_a_clean_error_naming_the_file(name):
    source, needle = HOSTILE[name]
    with cpu_time_limit(15), peak_python_memory(300):
        with pytest.raises(TokenizerError) as info:
            ChatTemplate(source, ORIGIN).render(USER, add_generation_prompt=True)
    message = str(info.value)
    assert ORIGIN in message, message
    assert needle in message, message


def test_data_nested_deeper_than_python_can_walk_is_a_clean_error():
    deep: list = []
    for _ in range(20000):
        deep = [deep]
    with cpu_time_limit(15):
        with pytest.raises(TokenizerError, match="nests too deeply") as info:
            ChatTemplate("{{ messages | tojson }}", ORIGIN).render([{"role": "user", "content": deep}], add_generation_prompt=True)
    assert ORIGIN in str(info.value)


def test_the_cpu_bound_is_the_documented_one(monkeypatch):
    # Breaking the bound breaks the behaviour: with a tiny budget, even a small loop stops.
    monkeypatch.setattr(chat, "MAX_RENDER_SECONDS", 0.0)
    with pytest.raises(TokenizerError, match="CPU time"):
        ChatTemplate("{% for i in range(5000) %}{% endfor %}", ORIGIN).render(USER, add_generation_prompt=True)


def test_the_error_names_the_file_the_template_came_from(tmp_path):
    from lollm.tokenizer import load_tokenizer

    from _core_helpers import write_tiny_tokenizer

    folder = write_tiny_tokenizer(tmp_path / "tok")
    (folder / "chat_template.jinja").write_text("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", encoding="utf-8")
    tokenizer = load_tokenizer(folder)
    with pytest.raises(TokenizerError) as info:
        tokenizer.encode_chat(USER)
    assert str(folder / "chat_template.jinja") in str(info.value)


def test_a_render_in_a_thread_has_its_own_budget():
    # The budget lives in a context variable: a render in another thread (a server's worker) is bounded too.
    import threading

    outcome = {}

    def work():
        try:
            ChatTemplate(HOSTILE["nested range loops"][0], ORIGIN).render(USER, add_generation_prompt=True)
        except TokenizerError as exc:
            outcome["error"] = str(exc)

    with cpu_time_limit(15):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert "CPU time" in outcome["error"]


# -- within the bounds nothing changes -------------------------------------------------


def plain_sandbox_render(source: str, **variables) -> str:
    """The reference: jinja2's immutable sandbox set up the way transformers sets it up, with no bounds."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = chat._tojson
    return env.from_string(source).render(**variables)


BUSY_BUT_FINE = """\
{%- macro fmt(value, depth) -%}
{%- if value is mapping -%}{ {% for k, v in value | dictsort %}{{ k }}: {{ fmt(v, depth + 1) }}{{ ', ' if not loop.last }}{% endfor %} }
{%- elif value is sequence and value is not string -%}[{{ value | map('string') | join(', ') }}]
{%- else -%}{{ value }}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(total=0, text='') -%}
{%- for m in messages -%}
{%- set ns.total = ns.total + m.content | length -%}
{%- set ns.text = ns.text ~ m.role[0] -%}
<|{{ m.role }}|>{{ m.content | trim | indent(2) }}{{ '%-8s|%5.2f' % (m.role, loop.index / 3) }}{{ '{:>6}'.format(loop.index) }}
{% for i in range(3) %}{{ i ** 2 * 2 }}{% endfor %}{{ fmt(m.meta, 0) if m.meta is defined }}
{% endfor -%}
{{ ns.total }} {{ ns.text }} {{ messages | tojson(indent=2) | length }} {{ 'ab' * 3 }} {{ [1, 2] + [3] }} {{ 2 ** 100 }}
"""


def test_templates_within_the_bounds_render_exactly_as_the_plain_sandbox():
    messages = [
        {"role": "system", "content": "  Be brief.\nTwo lines.  "},
        {"role": "user", "content": "Hello 😀 %s {0}", "meta": {"b": [1, 2], "a": {"x": "y"}}},
        {"role": "assistant", "content": "Hi!"},
    ] * 40
    ours = ChatTemplate(BUSY_BUT_FINE, ORIGIN).render(messages, add_generation_prompt=False)
    reference = plain_sandbox_render(BUSY_BUT_FINE, messages=messages, add_generation_prompt=False)
    assert ours == reference
    assert len(ours) > 5000


def test_filters_are_not_folded_at_compile_time_where_no_budget_applies():
    # jinja2 would compute a filter over constants while compiling (even in a branch never taken) and write
    # the result into the compiled code; here that is five lists of 99999 lists, tens of MB, outside any budget.
    folded = "{{ ('x' | center(99999)) | list | slice(99999) | list }}"
    source = "{% if false %}" + folded * 5 + "{% endif %}ok"
    with cpu_time_limit(15), peak_python_memory(8):
        assert ChatTemplate(source, ORIGIN).render(USER, add_generation_prompt=True) == "ok"
