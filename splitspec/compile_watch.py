"""Triton kernel variants compiled once a service is SERVING: each one logged and counted.

Triton compiles a kernel once per variant (its constexprs and its arguments'
specialisations), at the first call that needs it, or loads it from its disk
cache then. A service's start-up (warmup, graph capture) is meant to meet every
variant serving will need: a variant met first while serving makes that request
wait for the compile, and one that fails to compile fails the request instead of
start-up. :func:`watch`, called before start-up, installs Triton's post-compile
hook; after :func:`serving`, every variant compiled is a WARNING that names it,
and :func:`compiled_while_serving` lists them (a GPU test expects none where
start-up covered them).
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

WHILE_SERVING = "Triton compiled a kernel variant while serving"  # each warning's start


class _Watch:
    def __init__(self) -> None:
        self.is_serving = False
        self.compiled: list[str] = []
        self.previous: Callable[..., Any] | None = None  # a hook installed before ours
        self.lock = threading.Lock()


_WATCH = _Watch()


def _runtime_knobs() -> Any | None:
    """triton.knobs.runtime where it has the post-compile hook (Triton 3.3 and later)."""
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") else None


def watch() -> bool:
    """Install the hook (once, after any hook already there, which it still calls); False
    where Triton, or its post-compile hook, is missing."""
    runtime = _runtime_knobs()
    if runtime is None:
        return False
    if runtime.jit_post_compile_hook is not _on_compile:
        _WATCH.previous = runtime.jit_post_compile_hook
        runtime.jit_post_compile_hook = _on_compile
    return True


def serving() -> None:
    """From now on every compile is logged and listed."""
    _WATCH.is_serving = True


def compiled_while_serving() -> list[str]:
    with _WATCH.lock:
        return list(_WATCH.compiled)


def describe(hook_args: dict[str, Any]) -> str:
    """A variant as its kernel, warps and stages, each argument's type with ``div16`` where
    Triton specialised it as a multiple of 16 (an integer) or 16-byte aligned (a pointer),
    and each constexpr's value: what tells two variants of a kernel apart, e.g.
    ``_gemv_kernel[num_warps=4, num_stages=3](x: *bf16, w: *bf16 div16, ..., K=4096)``.

    Built from the hook's ``compile`` arguments (signature, constants, configs), because
    Triton 3.3 and later pair the parameters with the characters of a string key in the
    ``repr`` it passes (``_gemv_kernel[...](x: (``); that ``repr`` is the fallback where
    the arguments lack a signature."""
    compile_args = hook_args.get("compile") or {}
    signature = compile_args.get("signature")
    if not isinstance(signature, dict):
        return str(hook_args.get("repr", "a kernel"))
    constants = compile_args.get("constants") or {}
    configs = compile_args.get("configs") or [{}]
    attrs = configs[0] if isinstance(configs[0], dict) else {}
    args = []
    for i, (name, kind) in enumerate(signature.items()):
        if kind == "constexpr":
            args.append(f"{name}={constants.get((i,), '?')}")
        else:
            div16 = any(attr[0] == "tt.divisibility" for attr in attrs.get((i,), ()))
            args.append(f"{name}: {kind}{' div16' if div16 else ''}")
    fn = hook_args.get("fn")
    name = getattr(fn, "name", None) or str(hook_args.get("repr", "a kernel")).split("[")[0]
    return (f"{name}[num_warps={compile_args.get('num_warps', '?')}, "
            f"num_stages={compile_args.get('num_stages', '?')}]({', '.join(args)})")


def _on_compile(**hook_args: Any) -> Any:
    """Triton's post-compile hook (keyword arguments: key, repr, fn, compile, ...)."""
    previous = _WATCH.previous
    result = previous(**hook_args) if previous is not None else None
    if _WATCH.is_serving:
        variant = describe(hook_args)
        with _WATCH.lock:
            _WATCH.compiled.append(variant)
        log.warning("%s (the call that needed it waited; start-up's warmup and graph capture "
                    "did not meet it): %s", WHILE_SERVING, variant)
    return result
