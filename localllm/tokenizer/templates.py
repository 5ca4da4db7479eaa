"""The sandbox chat templates render in: an immutable sandboxed Jinja environment whose arithmetic is
bounded, with a time limit (:data:`TEMPLATE_TIME_LIMIT_S`) and an output limit
(:data:`TEMPLATE_OUTPUT_LIMIT_CHARS`), so that a hostile template fails its request alone.
"""

from __future__ import annotations

import ctypes
import json
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


def make_jinja_env():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """The sandbox, with ``*`` and ``**`` unable to build huge strings, lists or numbers."""

        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, times in ((left, right), (right, left)):
                    if (isinstance(seq, (str, list, tuple)) and isinstance(times, int)
                            and len(seq) * times > TEMPLATE_OUTPUT_LIMIT_CHARS):
                        raise _template_limit("a repetition in the chat template is too large")
            elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
                  and right > 0 and max(abs(left).bit_length(), 1) * right > _MAX_POW_BITS):
                raise _template_limit("a power in the chat template is too large")
            return super().call_binop(context, operator, left, right)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
