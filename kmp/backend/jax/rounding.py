"""Rounding float32 to bfloat16 on JAX: to nearest, or stochastically, as
`kmp.backend.rounding` does on TensorFlow (see its docstring).

The random draw comes from JAX's own generator, keyed by the optimizer's
seed and folded with the step and the moment: the same step draws the same
numbers eagerly and under `jit`. They are not TensorFlow's numbers.
"""

from __future__ import annotations

from typing import Any


def to_bfloat16(
    value: Any, rounding: str, seed: int | None = None, step: Any = 0, stream: int = 0
) -> Any:
    """`value` (float32) as bfloat16, rounded `rounding` (`'nearest'` or
    `'stochastic'`); for `'stochastic'`, the draw of (`seed`, `step`,
    `stream`)."""
    import jax
    import jax.numpy as jnp

    value = jnp.asarray(value, jnp.float32)
    if rounding == "nearest":
        return value.astype(jnp.bfloat16)
    if rounding != "stochastic":
        raise ValueError(
            f"rounding must be 'stochastic' or 'nearest'. Received: {rounding!r}."
        )
    if seed is None:
        raise ValueError(
            "Stochastic rounding needs a seed (an integer) to select its random "
            "draw. Received: seed=None."
        )
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), stream)
    noise = jax.random.randint(key, value.shape, 0, 1 << 16, jnp.int32)
    bits = (jax.lax.bitcast_convert_type(value, jnp.int32) + noise) & -(1 << 16)
    # Inf stays Inf (its low bits are zero), and a finite value above
    # bfloat16's largest may round up to Inf. NaN is passed through.
    rounded = jax.lax.bitcast_convert_type(bits, jnp.float32)
    return jnp.where(jnp.isnan(value), value, rounded).astype(jnp.bfloat16)
