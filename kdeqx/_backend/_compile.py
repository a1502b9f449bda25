"""Compiling small programs quickly."""

import functools as ft

import jax
import jax.numpy as jnp


# XLA:CPU's older loop emitters and LLVM at -O1: for the operator series, a much
# shorter compile for a slightly slower run, a cost worth paying only where compiling
# dominates (see `benchmarks/operator_series.py`).
QUICK_START_OPTIONS = {
    "xla_cpu_use_fusion_emitters": False,
    "xla_backend_optimization_level": 1,
}


@ft.cache
def quick_start_options(optimise: bool = True) -> dict[str, object]:
    """Compiler options that trade a little run time for a much shorter compile, for
    programs whose first call is mostly compiling: XLA:CPU options that this jaxlib
    knows (each checked once, on a trivial program), none on other backends.

    `optimise=False`: LLVM at -O0 instead, for code whose compile outweighs its run
    (the operator series' Taylor expansions, whose shorter compile outweighs their
    slower run)."""
    if jax.default_backend() != "cpu":
        return {}
    if not optimise:  # the same options, checked once, at another level
        known = dict(quick_start_options())
        if "xla_backend_optimization_level" in known:
            known["xla_backend_optimization_level"] = 0
        return known
    known = {}
    for name, value in QUICK_START_OPTIONS.items():
        trivial = jax.jit(lambda x: x + 1, compiler_options={name: value})
        try:
            trivial.lower(jnp.zeros((), jnp.float32)).compile()
        except jax.errors.JaxRuntimeError:  # an option this jaxlib does not have
            continue
        known[name] = value
    return known


try:  # private, so looked up once: jax versions without it cannot tell
    from jax._src.core import trace_state_clean as _trace_state_clean
except ImportError:
    _trace_state_clean = None


def outside_any_trace() -> bool:
    """Whether no transformation (`jit`, `vmap`, `grad`, ...) is tracing: only then
    may a `jit` carry compiler options. False where this jax cannot tell."""
    return _trace_state_clean is not None and _trace_state_clean()
