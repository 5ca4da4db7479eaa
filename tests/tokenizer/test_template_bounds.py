"""The chat-template sandbox's bounds: no operator, str method or filter builds a value larger than
the output limit, each refused before it is built with a template error; ordinary templates render
as before. The limit is lowered to 1 MiB here, so that each hostile template asks for a few MB:
enough to be refused, little enough to build at once where nothing refuses it."""

from __future__ import annotations

import pytest
from jinja2.exceptions import TemplateError

from localllm.tokenizer import templates
from localllm.tokenizer.templates import make_jinja_env

LIMIT = 1 << 20
BIG = 4 << 20  # a width over the limit, small enough to build


@pytest.fixture(autouse=True)
def _small_limit(monkeypatch):
    monkeypatch.setattr(templates, "TEMPLATE_OUTPUT_LIMIT_CHARS", LIMIT)


def render(source: str, **variables) -> str:
    return make_jinja_env().from_string(source).render(**variables)


# Each builds a value over the limit and prints only its length: the output limit never sees it.
HOSTILE = {
    "str.ljust": f"'a'.ljust({BIG})",
    "str.rjust": f"'a'.rjust({BIG})",
    "str.center": f"'a'.center({BIG})",
    "str.zfill": f"'1'.zfill({BIG})",
    "str.expandtabs": f"('\\t' * 64).expandtabs({BIG // 64})",
    "str.replace": "('a' * 4096).replace('a', 'b' * 1024)",
    "str.join": "('x' * 4096).join(range(1024)|map('string'))",
    "str.translate": "('a' * 1024).translate({97: 'b' * 4096})",
    "str.format width": f"'{{:{BIG}}}'.format(1)",
    "str.format nested width": f"'{{:{{w}}}}'.format(1, w={BIG})",
    "str.format precision": f"'{{:.{BIG}f}}'.format(1.0)",
    "% width": f"'%{BIG}d' % 1",
    "% star width": f"'%*d' % ({BIG}, 1)",
    "filter format": f"'%{BIG}d'|format(1)",
    "filter center": f"'a'|center({BIG})",
    "filter indent": "('a\\n' * 1024)|indent(4096)",
    "filter wordwrap": "('a ' * 1024)|wordwrap(1, wrapstring='x' * 4096)",
    "filter replace": "('a' * 4096)|replace('a', 'b' * 1024)",
    "filter join": "(range(1024)|map('string'))|join('x' * 4096)",
    "lipsum": "lipsum(2000)",
    "list repetition": f"[0] * {BIG // 4}",
}


@pytest.mark.parametrize("expression", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_method_filter_or_operator_cannot_build_a_value_over_the_limit(expression):
    source = f"{{% set x = {expression} %}}{{{{ x|length }}}}"
    with pytest.raises(TemplateError, match="would build more than"):
        render(source)


GROWING = {
    "~ in a loop": "{% set ns.s = ns.s ~ ns.s %}",
    "+ in a loop": "{% set ns.s = ns.s + ns.s %}",
    "a set block in a loop": "{% set ns.s %}{{ ns.s }}{{ ns.s }}{% endset %}",
}


@pytest.mark.parametrize("step", GROWING.values(), ids=GROWING.keys())
def test_a_text_that_doubles_in_a_loop_stops_at_the_limit(step):
    # 1 KiB doubled 13 times is 8 MiB: the loop must stop at 1 MiB, not run to its end.
    source = "{% set ns = namespace(s='x' * 1024) %}{% for i in range(13) %}" + step + "{% endfor %}{{ ns.s|length }}"
    with pytest.raises(TemplateError, match="would build more than"):
        render(source)


@pytest.mark.parametrize("source", [
    "{{ [1]|batch(1000000, 0)|list|length }}",
    "{{ [1]|slice(1000000, 0)|list|length }}",
])
def test_filters_that_build_one_piece_per_count_are_capped_like_range(source):
    with pytest.raises(TemplateError, match="pieces, more than"):
        render(source)


def test_tojson_refuses_a_wide_indent():
    with pytest.raises(TemplateError, match="indent"):
        render("{{ x|tojson(indent=100000) }}", x={"a": [1, 2]})


def test_ordinary_templates_render_as_before():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\tthere"}]
    source = (
        "{% for m in messages %}{{ '<|' + m['role'] + '|>' }}{{ m['content'] | trim }}"
        "{{ '%s!' | format(loop.index) }}{{ ', '.join(['a', 'b'] | map('upper')) }}{% endfor %}"
        "{{ 'x'.ljust(3, '.') }}{{ 'ab'.replace('a', 'A') }}{{ [1, 2] | join('-') }}"
        "{{ 'x' ~ 1 ~ 'y' }}{{ '{} {k}'.format(1, k=2) }}{{ 'a\\nb' | indent(2, true) }}"
        "{{ tools | tojson(indent=2) }}{{ 7 % 3 }}{{ 2 ** 10 }}{{ [1] + [2] }}{{ '-' * 3 }}"
    )
    out = render(source, messages=messages, tools=[{"name": "f"}])
    assert out == (
        "<|system|>Be brief.1!A, B<|user|>Hi\tthere2!A, B"
        "x..Ab1-2x1y1 2  a\n  b"
        '[\n  {\n    "name": "f"\n  }\n]11024[1, 2]---'
    )
