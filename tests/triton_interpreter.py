"""Triton's CPU interpreter without one repeated cost.

Triton 3.6's interpreter patches ``triton.language`` (every builtin of ``tl``, ``tl.tensor`` and
``tl.math``, found by ``inspect.getmembers``) once per kernel launch, and again on every call of a
``@triton.jit`` function inside the kernel (ours and ``tl.sum``, ``tl.zeros``, ...), for every
program of the grid; the second kind is never undone. The patch a launch made, and the one a device
function's call left behind, are in place while the launch's programs run, so repeating them
changes nothing; it costs about 1 ms a call (one selector grid test: 9,333 calls, 33 s before,
20 s after). Here a device-function call inside a launch that has already patched every language
module the function sees runs the function directly; any other call keeps the interpreter's own
path. What the interpreter computes is unchanged; only Python work without effect is skipped.
"""

import inspect


def skip_repeated_language_patch() -> bool:
    """Install the shortcut when the interpreter has the expected shape; False (nothing changed)
    otherwise, e.g. on another Triton version."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    grid_cls = getattr(itp, "GridExecutor", None)
    fn_cls = getattr(itp, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or getattr(fn_cls, "_speedsfi_shortcut", False):
        return False
    if not all(hasattr(x, a) for x, a in ((itp, "_patch_lang"), (itp, "tl"), (itp, "InterpreterError"),
                                          (fn_cls, "rewrite"))):
        return False
    if any("_patch_lang(self.fn)" not in inspect.getsource(c.__call__) for c in (grid_cls, fn_cls)):
        return False

    languages = (itp.tl, itp.tl.core)
    seen: dict = {}
    launches: list = []        # the language modules each enclosing launch patched

    def languages_of(fn) -> frozenset:
        got = seen.get(fn)
        if got is None:
            got = frozenset(id(v) for v in fn.__globals__.values()
                            if inspect.ismodule(v) and any(v is lang for lang in languages))
            seen[fn] = got
        return got

    launch_call = grid_cls.__call__
    device_call = fn_cls.__call__

    def launch(self, *args, **kwargs):
        launches.append(languages_of(self.fn))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def call(self, *args, **kwargs):
        sees = languages_of(self.fn) if launches else None
        if not sees or not sees <= launches[-1]:
            try:
                return device_call(self, *args, **kwargs)
            finally:
                if sees:                 # its patch is never undone: in place for the rest of the launch
                    launches[-1] = launches[-1] | sees
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise itp.InterpreterError(repr(e)) from e

    grid_cls.__call__ = launch
    fn_cls.__call__ = call
    fn_cls._speedsfi_shortcut = True
    return True
