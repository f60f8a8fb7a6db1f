"""A float32 scope: custom code that computes in float32 inside a 16-bit
model and hands back what its caller expects.

It is Keras's spelling of PyTorch's `autocast(enabled=False)` (the context
manager) and `custom_fwd(cast_inputs=torch.float32)` (the decorator).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any
from typing import TypeVar

import keras

from kmp.internals import keras_private
from kmp.precision import policy as policy_lib

F = TypeVar("F", bound=Callable[..., Any])


def _is_float_tensor(x: Any) -> bool:
    """Whether `x` is a floating backend tensor, symbolic tensor or variable
    (NumPy arrays and Python numbers are left as they are)."""
    if isinstance(x, keras.Variable):
        return keras.backend.is_float_dtype(x.dtype)
    if not (keras.ops.is_tensor(x) or isinstance(x, keras.KerasTensor)):
        return False
    return keras.backend.is_float_dtype(keras.backend.standardize_dtype(x.dtype))


def _cast(structure: Any, dtype: str, only: tuple[str, ...] | None = None) -> Any:
    """`structure` with its floating tensors cast to `dtype` (those in one of
    the dtypes `only` names, where given)."""

    def cast(x):
        if not _is_float_tensor(x):
            return x
        own = keras.backend.standardize_dtype(x.dtype)
        if own == dtype or (only is not None and own not in only):
            return x
        return keras.ops.cast(x, dtype)

    return keras.tree.map_structure(cast, structure)


def _float_dtypes(structure: Any) -> list[str]:
    found = []
    for x in keras.tree.flatten(structure):
        if _is_float_tensor(x):
            dtype = keras.backend.standardize_dtype(x.dtype)
            if dtype not in found:
                found.append(dtype)
    return found


class _Float32Scope:
    """The object `float32_scope()` returns: a context manager, and a
    decorator that casts at the function's edges."""

    def __init__(self, output_dtype: str | None):
        self._output_dtype = output_dtype
        # Per thread: one scope object may be entered by replica threads.
        self._local = threading.local()

    def __enter__(self) -> None:
        if self._output_dtype is not None:
            raise TypeError(
                "float32_scope(output_dtype=...) applies to a decorated "
                "function, not to a `with` block. Expected "
                "`@kmp.float32_scope(output_dtype=...)` above a function. "
                f"Received: output_dtype={self._output_dtype!r} in a `with` "
                "statement. Cast what leaves the block yourself: "
                "keras.ops.cast(y, x.dtype)."
            )
        scope = keras_private.autocast_scope("float32")
        scope.__enter__()
        self._entered().append(scope)

    def __exit__(self, *exc: Any) -> None:
        self._entered().pop().__exit__(*exc)

    def _entered(self) -> list[Any]:
        if not hasattr(self._local, "scopes"):
            self._local.scopes = []
        return self._local.scopes

    def __call__(self, fn: F) -> F:
        if not callable(fn):
            raise TypeError(
                "float32_scope decorates a function. Expected a callable. "
                f"Received: {fn!r}."
            )
        output_dtype = self._output_dtype

        @functools.wraps(fn)
        def in_float32(*args: Any, **kwargs: Any) -> Any:
            dtypes = _float_dtypes((args, kwargs))
            sixteen = [d for d in dtypes if d in policy_lib.SIXTEEN_BIT]
            if output_dtype is not None:
                target = output_dtype
            elif sixteen and len(dtypes) > 1:
                raise ValueError(
                    f"`{fn.__qualname__}` in a float32 scope cannot tell which "
                    "dtype to return its results in. Expected its floating "
                    "inputs to share one dtype. Received: "
                    f"{', '.join(dtypes)}. Name the dtype: "
                    "@kmp.float32_scope(output_dtype='bfloat16')."
                )
            else:
                # Nothing came in 16-bit: nothing to give back.
                target = sixteen[0] if sixteen else None
            args, kwargs = _cast((args, kwargs), "float32", only=policy_lib.SIXTEEN_BIT)
            with _Float32Scope(None):
                outputs = fn(*args, **kwargs)
            return outputs if target is None else _cast(outputs, target)

        return in_float32  # type: ignore[return-value]


def float32_scope(fn: F | None = None, /, *, output_dtype: str | None = None) -> Any:
    """Computes a region of your own code in float32 inside a 16-bit model.

    Use it around numerically sensitive code of your own: a variance, a
    log-sum-exp, a custom softmax or scatter. kmp's rules already keep
    Keras's own sensitive layers in float32.

    As a decorator (PyTorch's `custom_fwd(cast_inputs=torch.float32)`), it
    casts the function's float16 and bfloat16 tensor inputs to float32 and
    runs it in float32. Its floating outputs go back in the 16-bit dtype
    the inputs came in, so the code that calls it receives what it expects.
    A function whose floating inputs arrive in several dtypes, one of them
    16-bit, names its output dtype.

    As a context manager (PyTorch's `autocast(enabled=False)`), variables
    read inside the block are float32, also inside a mixed layer's `call`.
    Cast the 16-bit tensors that enter the block yourself, and what leaves
    it: `keras.ops.cast(x, "float32")`, `keras.ops.cast(y, x.dtype)`.

    Keras layers called inside either form keep their own policy: Keras
    casts their inputs to it. Build such a layer with `dtype="float32"` to
    run it in float32. A layer's inputs are rounded to its policy before its
    `call` runs: where that rounding is the problem, set the layer's own
    policy (`kmp.set_layer_policy`), not a scope inside it.

    Args:
        fn: The function to decorate. Leave it out to get a context manager,
            or a decorator that takes `output_dtype`.
        output_dtype: The dtype the decorated function's floating outputs
            are cast to. By default, the one 16-bit dtype its floating
            inputs came in; where none came in 16-bit, outputs are left as
            the function returns them.

    Returns:
        The decorated function, or an object that is both a context manager
        and a decorator.

    Raises:
        ValueError: when a decorated function's floating inputs arrive in
            several dtypes and `output_dtype` is not given.
        TypeError: for `output_dtype` on a `with` block, or a decorated
            object that is not callable.

    Example:

    >>> @kmp.float32_scope
    ... def log_sum_exp(x):
    ...     return keras.ops.logsumexp(x, axis=-1)
    >>> x = keras.ops.full((2, 3), 60.0, dtype="bfloat16")
    >>> y = log_sum_exp(x)
    >>> keras.backend.standardize_dtype(y.dtype)
    'bfloat16'
    >>> class Scaled(keras.layers.Layer):
    ...     def build(self, shape):
    ...         self.w = self.add_weight(shape=(), initializer="ones")
    ...     def call(self, x):
    ...         with kmp.float32_scope():  # self.w is read in float32
    ...             y = keras.ops.cast(x, "float32") * self.w
    ...         return keras.ops.cast(y, x.dtype)
    >>> layer = Scaled(dtype="mixed_bfloat16")
    >>> keras.backend.standardize_dtype(layer(x).dtype)
    'bfloat16'
    """
    if output_dtype is not None:
        output_dtype = keras.backend.standardize_dtype(output_dtype)
        if not keras.backend.is_float_dtype(output_dtype):
            raise ValueError(
                "float32_scope's output_dtype is the dtype floating outputs "
                "are cast to. Expected a floating dtype such as 'bfloat16'. "
                f"Received: output_dtype={output_dtype!r}."
            )
    scope = _Float32Scope(output_dtype)
    if fn is None:
        return scope
    return scope(fn)
