"""Precision policies: the value, the registry, and the one global state.

A `Policy` names two dtypes: the dtype layers compute in and the dtype their
variables are stored in. kmp keeps no global policy of its own: `set_policy`
writes through to Keras's global dtype policy (`keras.config.set_dtype_policy`)
so that kmp and Keras can never disagree, and `get_policy` reads it back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import keras

from kmp.precision.auto import AutoChoice

logger = logging.getLogger("kmp")

# What only the machine edge knows, registered by it (`kmp.backend`, which
# `import kmp` loads): the policy 'auto' picks on this machine, and the
# process-wide settings a compute dtype needs there (the float16 CPU fast
# path). Policies are values; these two are the machine's part.
_machine: dict[str, Callable[..., Any]] = {}


def use_machine(
    resolve_auto: Callable[[], AutoChoice],
    apply_settings: Callable[[str], object],
) -> None:
    """Registers the machine edge's two functions (`kmp.backend` calls this
    when it is imported): `resolve_auto()` returns the `AutoChoice` for this
    machine, `apply_settings(compute_dtype)` applies the process-wide
    settings a compute dtype needs."""
    _machine.update(resolve_auto=resolve_auto, apply_settings=apply_settings)


def _from_machine(name: str) -> Callable[..., Any]:
    try:
        return _machine[name]
    except KeyError:
        raise RuntimeError(
            f"kmp's machine edge is not loaded, so {name!r} cannot run: "
            "kmp.precision was imported without kmp.backend. Import kmp "
            "(`import kmp`), which loads both."
        ) from None


FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
SIXTEEN_BIT = ("float16", "bfloat16")
_WIDTH = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}
AUTO = "auto"
# float16's largest finite value: activations above it overflow to inf.
FLOAT16_MAX = 65504.0


class PolicyError(ValueError):
    """A policy name, dtype or registration is invalid."""


def _standardize_dtype(value: Any, what: str) -> str:
    """Returns the canonical name of a floating dtype, or raises."""
    try:
        name = keras.backend.standardize_dtype(value)
    except (ValueError, TypeError) as e:
        raise PolicyError(
            f"Invalid {what}: {value!r} is not a dtype. Expected one of "
            f"{', '.join(FLOAT_DTYPES)}."
        ) from e
    if name not in FLOAT_DTYPES:
        raise PolicyError(
            f"Invalid {what}: {name!r} is not a floating-point dtype that a "
            f"precision policy can use. Expected one of {', '.join(FLOAT_DTYPES)}. "
            "Integer and quantized dtypes are applied with Keras's "
            "`model.quantize(...)`, not with a precision policy."
        )
    return name


@dataclasses.dataclass(frozen=True)
class Policy:
    """A precision policy: the dtype layers compute in and the dtype of their
    variables.

    Policies are immutable values: equal when their fields are equal, hashable,
    and round-trip through `get_config()`/`from_config()`.

    Args:
        name: The policy's name, as used by `kmp.set_policy(name)`.
        compute_dtype: The dtype layers compute in and return: one of
            `float16`, `bfloat16`, `float32`, `float64`.
        variable_dtype: The dtype variables are stored in. It may not be
            narrower than `compute_dtype`, and when it differs from
            `compute_dtype` it must be `float32` (the only mixed form Keras 3
            layers accept).

    Attributes:
        needs_loss_scaling: True exactly when `compute_dtype` is `float16`,
            whose narrow exponent range lets small gradients underflow.

    Example:

    >>> policy = kmp.Policy("my_bf16", compute_dtype="bfloat16",
    ...                     variable_dtype="float32")
    >>> policy
    <Policy "my_bf16": compute=bfloat16, variables=float32>
    >>> policy.needs_loss_scaling
    False
    >>> kmp.Policy.from_config(policy.get_config()) == policy
    True
    """

    name: str
    compute_dtype: str
    variable_dtype: str
    needs_loss_scaling: bool = dataclasses.field(init=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise PolicyError(
                f"A policy name must be a non-empty string. Received: "
                f"name={self.name!r}."
            )
        compute = _standardize_dtype(self.compute_dtype, "compute_dtype")
        variable = _standardize_dtype(self.variable_dtype, "variable_dtype")
        if _WIDTH[variable] < _WIDTH[compute]:
            raise PolicyError(
                f"Policy {self.name!r}: variable_dtype={variable} is narrower "
                f"than compute_dtype={compute}. Variables must be at least as "
                "wide as the computation, or updates are lost to rounding. "
                f"Use variable_dtype='float32' (or '{compute}')."
            )
        if variable != compute and _WIDTH[variable] == _WIDTH[compute]:
            raise PolicyError(
                f"Policy {self.name!r}: variable_dtype={variable} and "
                f"compute_dtype={compute} are different 16-bit formats; "
                "variables would be converted with rounding at every use. "
                f"Use variable_dtype='float32' (or '{compute}')."
            )
        if variable != compute and variable != "float32":
            raise PolicyError(
                f"Policy {self.name!r}: compute_dtype={compute} with "
                f"variable_dtype={variable} cannot be expressed as a Keras 3 "
                "dtype policy, which mixes dtypes only with float32 variables. "
                f"Use variable_dtype='float32' or variable_dtype='{compute}'."
            )
        object.__setattr__(self, "compute_dtype", compute)
        object.__setattr__(self, "variable_dtype", variable)
        object.__setattr__(self, "needs_loss_scaling", compute == "float16")

    def __repr__(self) -> str:
        return (
            f'<Policy "{self.name}": compute={self.compute_dtype}, '
            f"variables={self.variable_dtype}>"
        )

    @property
    def is_16bit(self) -> bool:
        """True when the compute dtype is a 16-bit float (mixed or not)."""
        return _WIDTH[self.compute_dtype] == 16

    @property
    def keras_name(self) -> str:
        """The name of the equivalent Keras `DTypePolicy`."""
        if self.compute_dtype == self.variable_dtype:
            return self.compute_dtype
        return f"mixed_{self.compute_dtype}"

    def to_keras(self) -> keras.DTypePolicy:
        """Returns the equivalent `keras.DTypePolicy`."""
        return keras.DTypePolicy(self.keras_name)

    def get_config(self) -> dict[str, str]:
        """Returns the policy as a JSON-serializable dict."""
        return {
            "name": self.name,
            "compute_dtype": self.compute_dtype,
            "variable_dtype": self.variable_dtype,
        }

    @classmethod
    def from_config(cls, config: dict[str, str]) -> Policy:
        """Creates a policy from the dict returned by `get_config()`."""
        return cls(**config)


_BUILTIN = (
    Policy("float32", "float32", "float32"),
    Policy("mixed_float16", "float16", "float32"),
    Policy("mixed_bfloat16", "bfloat16", "float32"),
    Policy("float16", "float16", "float16"),
    Policy("bfloat16", "bfloat16", "bfloat16"),
)
_registry: dict[str, Policy] = {p.name: p for p in _BUILTIN}
_lock = threading.Lock()
# The kmp policy most recently set. Only its *name* is remembered here: the
# dtypes always come from Keras's global policy, which is the one state.
_last_set: Policy | None = None


def list_policies() -> list[str]:
    """Returns the names `kmp.set_policy` accepts: built-in, `'auto'`, then
    registered ones.

    Example:

    >>> kmp.precision.policy.list_policies()[:6]
    ['float32', 'mixed_float16', 'mixed_bfloat16', 'float16', 'bfloat16', 'auto']
    """
    builtin = [p.name for p in _BUILTIN]
    return [*builtin, AUTO, *(n for n in _registry if n not in builtin)]


def register_policy(policy: Policy) -> Policy:
    """Registers a user-named policy so that it can be set by name.

    Registering the same policy twice is harmless; registering a different
    policy under a taken name is an error.

    Args:
        policy: The `kmp.Policy` to register.

    Returns:
        The registered policy.

    Raises:
        TypeError: if `policy` is not a `kmp.Policy`.
        PolicyError: if the name is `'auto'`, or is taken by a different policy.

    Example:

    >>> kmp.register_policy(kmp.Policy("fast", "bfloat16", "float32"))
    <Policy "fast": compute=bfloat16, variables=float32>
    >>> with kmp.policy_scope("fast"):
    ...     kmp.get_policy().name
    'fast'

    See also: `kmp.set_policy`.
    """
    if not isinstance(policy, Policy):
        raise TypeError(
            "register_policy() expects a kmp.Policy, e.g. "
            "kmp.Policy('fast', 'bfloat16', 'float32'). "
            f"Received: {policy!r} (of type {type(policy).__name__})."
        )
    if policy.name == AUTO:
        raise PolicyError(
            "The name 'auto' is reserved: it resolves to a concrete policy for "
            "this machine. Register the policy under another name."
        )
    with _lock:
        existing = _registry.get(policy.name)
        if existing is not None and existing != policy:
            raise PolicyError(
                f"A policy named {policy.name!r} is already registered as "
                f"{existing!r}; cannot register {policy!r} under the same name. "
                "Choose another name."
            )
        _registry[policy.name] = policy
    return policy


def _unregister_user_policies() -> None:
    """Test hook: forgets every registered (non built-in) policy."""
    builtin = {p.name for p in _BUILTIN}
    with _lock:
        for name in [n for n in _registry if n not in builtin]:
            del _registry[name]


def get(identifier: str | Policy | keras.DTypePolicy) -> Policy:
    """Resolves a policy name, `kmp.Policy` or `keras.DTypePolicy` to a
    `kmp.Policy`. `'auto'` resolves to the policy for this machine.

    Raises:
        PolicyError: for an unknown name.
        TypeError: for anything that is not a name or a policy.
    """
    if isinstance(identifier, Policy):
        return identifier
    if isinstance(identifier, keras.DTypePolicy):
        if identifier.quantization_mode is not None:
            raise PolicyError(
                f"{identifier!r} is a quantized Keras policy; kmp policies "
                "describe float precision only. Pass the float policy the model "
                "computes in (such as 'mixed_bfloat16') and quantize with "
                "model.quantize(...)."
            )
        by_keras_name = {p.keras_name: p for p in _BUILTIN}
        return by_keras_name.get(identifier.name) or Policy(
            identifier.name, identifier.compute_dtype, identifier.variable_dtype
        )
    if isinstance(identifier, str):
        if identifier == AUTO:
            choice = _from_machine("resolve_auto")()
            if choice.policy not in _registry:
                raise PolicyError(
                    f"'auto' resolved to {choice.policy!r} ({choice.reason}), "
                    f"which is not a policy. Valid names: "
                    f"{', '.join(repr(n) for n in list_policies() if n != AUTO)}."
                )
            return get(choice.policy)
        with _lock:
            policy = _registry.get(identifier)
        if policy is None:
            raise PolicyError(
                f"Unknown policy {identifier!r}. Valid names: "
                f"{', '.join(repr(n) for n in list_policies())}. "
                "Register your own with kmp.register_policy(kmp.Policy(...))."
            )
        return policy
    raise TypeError(
        "Expected a policy name (such as 'mixed_float16'), a kmp.Policy or a "
        f"keras.DTypePolicy. Received: {identifier!r} "
        f"(of type {type(identifier).__name__})."
    )


def set_policy(policy: str | Policy | keras.DTypePolicy) -> Policy:
    """Sets the global precision policy: every Keras layer built afterwards
    computes in its compute dtype with variables in its variable dtype.

    The policy is written through to Keras's global dtype policy, so built-in
    layers and your own `keras.layers.Layer` subclasses follow it with no
    kmp-specific code.

    On a machine without GPUs, a float16 policy also turns off grappler's
    remapper while it is in force (`kmp doctor` says why).

    Args:
        policy: A policy name (`'float32'`,
            `'mixed_float16'`, `'mixed_bfloat16'`, `'float16'`, `'bfloat16'`,
            `'auto'` or a registered name), a `kmp.Policy` or a
            `keras.DTypePolicy`.

    Returns:
        The concrete policy now in force (`'auto'` is resolved).

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": compute=float16, variables=float32>
    >>> keras.layers.Dense(4).compute_dtype
    'float16'
    >>> kmp.set_policy("float32")
    <Policy "float32": compute=float32, variables=float32>

    See also: `kmp.policy_scope`, `kmp.get_policy`.
    """
    global _last_set
    resolved = get(policy)
    keras.config.set_dtype_policy(resolved.to_keras())
    _from_machine("apply_settings")(resolved.compute_dtype)
    _last_set = resolved
    logger.debug("kmp policy set to %r", resolved)
    return resolved


def get_policy() -> Policy:
    """Returns the global policy in force (read from Keras; never writes).

    If Keras's global policy was changed directly with
    `keras.config.set_dtype_policy`, this returns the matching built-in policy.

    Example:

    >>> kmp.get_policy()
    <Policy "float32": compute=float32, variables=float32>
    """
    current = keras.config.dtype_policy()
    if _last_set is not None and _last_set.keras_name == current.name:
        return _last_set
    return get(current)


def lost_policy(model_policy: str) -> str:
    """'' normally; where the policy `kmp.set_policy` last set is no longer
    Keras's global policy (`keras.backend.clear_session()` resets it, as can
    another library) and a model computes in another policy (`model_policy`,
    a Keras policy name), a sentence saying so, with the fix."""
    current = keras.config.dtype_policy().name
    if _last_set is None or current == _last_set.keras_name:
        return ""
    if model_policy == _last_set.keras_name:
        return ""
    return (
        f"kmp.set_policy({_last_set.name!r}) is no longer in force: Keras's "
        f"global dtype policy is {current!r} (keras.backend.clear_session() "
        f"resets it, as can another library), so this model computes in "
        f"{model_policy!r}. Call kmp.set_policy({_last_set.name!r}) after "
        "clear_session() and build the model again."
    )


@contextlib.contextmanager
def policy_scope(policy: str | Policy | keras.DTypePolicy) -> Iterator[Policy]:
    """A context manager that sets the global policy and restores the previous
    one on exit, also when the body raises.

    Args:
        policy: Anything `kmp.set_policy` accepts.

    Yields:
        The concrete policy in force inside the scope.

    Example:

    >>> with kmp.policy_scope("mixed_bfloat16") as p:
    ...     keras.layers.Dense(4).compute_dtype
    'bfloat16'
    >>> kmp.get_policy().name
    'float32'
    """
    global _last_set
    previous_keras = keras.config.dtype_policy()
    previous_last = _last_set
    try:
        yield set_policy(policy)
    finally:
        keras.config.set_dtype_policy(previous_keras)
        _from_machine("apply_settings")(previous_keras.compute_dtype)
        _last_set = previous_last
