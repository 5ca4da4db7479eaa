"""The sandbox chat templates render in: an immutable sandboxed Jinja environment whose operators,
str methods and filters cannot build a value larger than the output limit, with a time limit
(:data:`TEMPLATE_TIME_LIMIT_S`) and an output limit (:data:`TEMPLATE_OUTPUT_LIMIT_CHARS`), so that a
hostile template fails its request alone, as a template error (HTTP 400).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from datetime import datetime

from localllm.errors import RequestFailedError


def _template_limit(message: str):
    from jinja2.exceptions import TemplateError

    return TemplateError(message)


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


# A chat template comes with the model file, so it may be hostile or broken: rendering one stops
# at these limits (the sandbox already forbids attribute tricks and caps range() at 100k).
TEMPLATE_TIME_LIMIT_S = 5.0
TEMPLATE_OUTPUT_LIMIT_CHARS = 64 << 20
_MAX_POW_BITS = 1 << 16

# Names the renderer sets itself (the messages, the flags, tokens, tools, and the template's
# functions): a request's template variables may not replace them.
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
    "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace",
})


class _TemplateDeadline(BaseException):
    """Raised inside a rendering thread whose time is up (a BaseException: templates can't catch it)."""


def call_with_deadline(fn, seconds: float):
    """``fn()`` in this thread, interrupted by :class:`_TemplateDeadline` after ``seconds``.

    Jinja templates compile to Python bytecode, so an asynchronous exception stops any loop in
    them; the big C-level operations a template could start (``*`` and ``**``) are bounded by
    the environment instead.
    """
    tid = threading.get_ident()
    lock = threading.Lock()
    done = False

    def fire() -> None:
        with lock:
            if not done:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_TemplateDeadline))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            return fn()
        finally:
            with lock:
                done = True
            timer.cancel()
    except _TemplateDeadline:
        raise RequestFailedError(
            f"the model's chat template ran longer than {seconds:g} s and was stopped"
        ) from None


# ---------------------------------------------------------------- how big a value may grow
#
# Every string, list or joined block a template builds through an operator, a method or a filter
# that can make it much larger than its inputs is checked against the output limit *before* it is
# built, so that a hostile template fails with a template error (a 400) instead of allocating
# gigabytes. Lists count 8 bytes an item; counts of pieces (batch, slice) are capped like range().

_ITEM_BYTES = 8
_NUMBER_CHARS = 330  # the longest a number formats to without a width ('%f' of 1e308)
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_FORMAT_DIGITS = re.compile(r"\d+")


def _check_size(size: int, what: str) -> None:
    # The limit is read at each call: a test lowers it.
    if size > TEMPLATE_OUTPUT_LIMIT_CHARS:
        raise _template_limit(
            f"{what} in the chat template would build more than {TEMPLATE_OUTPUT_LIMIT_CHARS} characters"
        )


def _check_count(count: int, what: str) -> None:
    from jinja2.sandbox import MAX_RANGE

    if count > MAX_RANGE:
        raise _template_limit(f"{what} in the chat template asks for {count} pieces, more than {MAX_RANGE}")


def _weight(value) -> int:
    """What a value costs in characters: its length for text, 8 an item for a list or tuple."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return _ITEM_BYTES * len(value)
    return 0


def _text_len(value) -> int:
    return len(value) if isinstance(value, str) else len(str(value))


def _number(text: str) -> int:
    """A width written in a format spec (int() refuses more than 4300 digits)."""
    return int(text) if len(text) < 19 else 1 << 63


def _int(value, default: int = 0) -> int:
    # Anything but an int is refused by the call itself, so it adds nothing here.
    return value if isinstance(value, int) else default


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _ints_in(values: list) -> list[int]:
    """The ints among ``values`` and one level inside them (a nested ``{:{w}}`` may read either)."""
    out = []
    for value in values:
        inner = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        out += [v for v in (value, *inner) if isinstance(v, int)]
    return out


def _percent_size(fmt: str, args) -> int:
    """An upper bound on ``fmt % args``: each field at most its widest width plus its longest argument."""
    fields = _PERCENT_FIELD.findall(fmt)
    if not fields:
        return len(fmt)
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    width = 0
    for parts in fields:
        for part in parts:
            if part == "*":
                width = max([width, *_ints_in(values)])
            elif part:
                width = max(width, _number(part))
    longest = max((_text_len(v) for v in values), default=0)
    return len(fmt) + len(fields) * (width + max(longest, _NUMBER_CHARS))


def _format_size(fmt: str, args: tuple, kwargs: dict) -> int:
    """An upper bound on ``fmt.format(*args, **kwargs)``, as :func:`_percent_size`."""
    import string

    try:
        specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(fmt) if name is not None]
    except ValueError:
        return len(fmt)  # format() refuses it itself
    values = [*args, *kwargs.values()]
    width = 0
    for spec in specs:
        if "{" in spec:
            width = max([width, *_ints_in(values)])
        width = max([width, *(_number(d) for d in _FORMAT_DIGITS.findall(spec))])
    longest = max((_text_len(v) for v in values), default=0)
    return len(fmt) + len(specs) * (width + max(longest, _NUMBER_CHARS))


def _replace_size(text: str, old, new, count) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(text)
    hits = text.count(old) if old else len(text) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(text) + hits * max(len(new) - len(old), 0)


def _join_size(sep: str, items: list) -> int:
    return sum(_text_len(item) for item in items) + len(sep) * max(len(items) - 1, 0)


def _translate_size(text: str, table) -> int:
    values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
    return len(text) * max([1, *(len(v) for v in values if isinstance(v, str))])


# str methods whose result can be far larger than the string: (text, args, kwargs) -> its size at most
_STR_METHODS = {
    "ljust": lambda s, a, k: max(len(s), _int(_arg(a, k, 0, "width"))),
    "rjust": lambda s, a, k: max(len(s), _int(_arg(a, k, 0, "width"))),
    "center": lambda s, a, k: max(len(s), _int(_arg(a, k, 0, "width"))),
    "zfill": lambda s, a, k: max(len(s), _int(_arg(a, k, 0, "width"))),
    "expandtabs": lambda s, a, k: len(s) + s.count("\t") * max(_int(_arg(a, k, 0, "tabsize", 8), 8), 0),
    "replace": lambda s, a, k: _replace_size(s, _arg(a, k, 0, "old"), _arg(a, k, 1, "new"), _arg(a, k, 2, "count")),
    "join": lambda s, a, k: _join_size(s, a[0]) if a and isinstance(a[0], (list, tuple)) else len(s),
    "translate": lambda s, a, k: _translate_size(s, a[0]) if a else len(s),
}


def _indent_size(text: str, a: tuple, k: dict) -> int:
    width = _arg(a, k, 0, "width", 4)
    return len(text) + (text.count("\n") + 1) * (_int(width, 4) if not isinstance(width, str) else len(width))


def _wordwrap_size(text: str, a: tuple, k: dict) -> int:
    wrap = _arg(a, k, 2, "wrapstring")
    return len(text) + (len(text) + 1) * (len(wrap) if isinstance(wrap, str) else 1)


# Filters whose result can be far larger than their input: (value, args, kwargs) -> its size at most
_FILTERS = {
    "center": lambda v, a, k: max(_text_len(v), _int(_arg(a, k, 0, "width", 80), 80)),
    "indent": lambda v, a, k: _indent_size(str(v), a, k),
    "wordwrap": lambda v, a, k: _wordwrap_size(str(v), a, k),
    "replace": lambda v, a, k: _replace_size(str(v), _arg(a, k, 0, "old"), _arg(a, k, 1, "new"),
                                             _arg(a, k, 2, "count")),
    "join": lambda v, a, k: _join_size(str(_arg(a, k, 0, "d", "")), v),
    "format": lambda v, a, k: _percent_size(str(v), k or tuple(a)),
}
# Filters that build one piece per count: their count argument, capped like range()
_COUNTED_FILTERS = {"batch": "linecount", "slice": "slices"}


def _bounded_filter(name: str, fn):
    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(fn) is not None else 0  # the context or environment Jinja passes first
    size_of, count_name = _FILTERS.get(name), _COUNTED_FILTERS.get(name)

    @functools.wraps(fn)  # (keeps the pass_context/pass_environment mark)
    def bounded(*args, **kwargs):
        passed, value, rest = args[:skip], args[skip] if len(args) > skip else None, args[skip + 1 :]
        if name == "join" and not isinstance(value, (list, tuple, str)):
            value = list(value)  # a generator (from map or select), measured once and joined as a list
        if size_of is not None:
            _check_size(size_of(value, rest, kwargs), f"the filter {name}")
        if count_name is not None:
            _check_count(_int(_arg(rest, kwargs, 0, count_name)), f"the filter {name}")
        return fn(*passed, value, *rest, **kwargs)

    return bounded


def _bounded_lipsum(fn):
    def lipsum(n=5, html=True, min=20, max=100):  # (Jinja's names)
        _check_size(_int(n, 5) * _int(max, 100) * 16, "lipsum()")
        return fn(n, html, min, max)

    return lipsum


@functools.cache
def _sandbox_class():
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        """Jinja's code generator, with each ``a ~ b`` checked (the one join that Jinja makes
        with a function of its own rather than the environment's ``concat``)."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.bounded_text(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with operators, str methods, filters and joined blocks unable to build huge
        strings, lists or numbers (see :func:`_check_size`)."""

        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                        _check_size(_weight(seq) * times, "a repetition")
                if (isinstance(left, int) and isinstance(right, int)
                        and left.bit_length() + right.bit_length() > _MAX_POW_BITS):
                    raise _template_limit("a product in the chat template is too large")
            elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
                  and right > 0 and max(abs(left).bit_length(), 1) * right > _MAX_POW_BITS):
                raise _template_limit("a power in the chat template is too large")
            elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(_weight(left) + _weight(right), "a sum")
            elif operator == "%" and isinstance(left, str):
                _check_size(_percent_size(left, right), "a % format")
            return super().call_binop(context, operator, left, right)

        def call(self, context, obj, /, *args, **kwargs):
            owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", None)
            if isinstance(owner, str) and name in _STR_METHODS:
                if name == "join" and args and not isinstance(args[0], (list, tuple, str)):
                    args = (list(args[0]), *args[1:])  # a generator, measured once and joined as a list
                _check_size(_STR_METHODS[name](owner, args, kwargs), f"str.{name}()")
            return super().call(context, obj, *args, **kwargs)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            fmt, is_map = value.__self__, value.__name__ == "format_map"

            def bounded(*args, **kwargs):
                if is_map and len(args) == 1 and isinstance(args[0], dict):
                    _check_size(_format_size(fmt, (), args[0]), "str.format_map()")
                else:
                    _check_size(_format_size(fmt, args, kwargs), "str.format()")
                return wrapped(*args, **kwargs)

            return bounded

        @staticmethod
        def concat(parts) -> str:
            """Join a block's pieces (a ``{% set %}`` block, a macro, a filter block) into one text."""
            parts = parts if isinstance(parts, list) else list(parts)
            _check_size(sum(map(len, parts)), "a block")
            return "".join(parts)

        @staticmethod
        def bounded_text(text):
            # Checked after the join: its parts are each within the limit, so at most a few times it.
            _check_size(_text_len(text), "a ~ join")
            return text

    return BoundedSandbox


def make_jinja_env():
    env = _sandbox_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    for name in (*_FILTERS, *_COUNTED_FILTERS):
        env.filters[name] = _bounded_filter(name, env.filters[name])
    env.globals["lipsum"] = _bounded_lipsum(env.globals["lipsum"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


_MAX_JSON_INDENT = 16


def _tojson(x, indent=None, ensure_ascii=False, **_):
    # An indent repeats on every line at every depth: a wide one multiplies the text.
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > _MAX_JSON_INDENT:
        raise _template_limit(f"tojson's indent in the chat template is wider than {_MAX_JSON_INDENT}")
    return json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
