"""Cheaper device-function calls under Triton's interpreter (``TRITON_INTERPRET=1``), for the tests.

Under the interpreter every call of a ``@triton.jit`` helper from inside a kernel re-patches
``triton.language`` (``interpreter._patch_lang``: five ``inspect.getmembers`` walks over the
language modules, ~2 ms a call) although the launch already patched those modules and the patch
is the same each time. Our top-k kernels call helpers a dozen times a program, so this was about
half of the conformance suite's time (profiled on Triton 3.9: 4.5 of 9.5 s for the radix select
on one 4 x 4096 case). ``install`` skips the re-patch when every language module the helper can
see is already patched (its ``load`` is no longer the raw builtin), and patches as before
otherwise; what the kernels compute is untouched, and a module left unpatched would fail loudly
(a raw builtin called outside the compiler raises), never silently.

A no-op where Triton or its interpreter internals are not what this expects (another Triton
version): the tests then run at the old speed.
"""

from __future__ import annotations

import importlib.util
import inspect
import os


def install() -> bool:
    """Patch the interpreter once (idempotent); True when the faster path is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_type is None or not hasattr(tl.core, "is_builtin"):
        return False
    if getattr(original, "_needlescope_fast", False):
        return True

    # The language modules a helper's module holds, found once per module (its globals): a scan
    # of every global at each helper call was ~3% of a kernel test's time under cProfile.
    langs_of: dict[int, list] = {}

    def patch_lang(fn):
        key = id(fn.__globals__)  # a module's dict: alive as long as its module, never reused
        if key not in langs_of:
            langs_of[key] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        langs = langs_of[key]
        if langs and all(not tl.core.is_builtin(getattr(v, "load", None)) for v in langs):
            return scope_type()  # already patched by the launch (or an earlier helper call)
        return original(fn)

    patch_lang._needlescope_fast = True
    interpreter._patch_lang = patch_lang
    return True
