"""Whether the gradients `apply()` receives are still scaled, decided from
where they came from, never from one flag shared by every call.

Three ways of training hand `kmp.LossScaleOptimizer.apply` gradients:

* Keras 3 (`fit`, a plain `tf.GradientTape` on `optimizer.scale_loss(loss)`):
  scaled gradients; `apply` unscales them.
* `kmp.ScaledGradientTape.gradient` and tf.keras 2's
  `get_unscaled_gradients`: unscaled gradients, clipped or not.
* A custom step that never scaled its loss: gradients that never were scaled.

A `Ledger` records, per step context (the graph being traced, or the eager
steps since the last `apply`), every loss it scaled and every set of
gradients it handed out unscaled, holding those tensors so that their
identity is a mark. `apply` then looks its gradients up (`decide`):

1. all of them handed out unscaled: applied as they are;
2. the scaled gradients that `get_unscaled_gradients` was given (unscaled
   copies taken, e.g. to log a norm): unscaled;
3. some of both: an error, not a guess;
4. unknown tensors after unscaled ones were handed out in this context
   (clipped, or otherwise computed from them): applied as they are;
5. unknown tensors after a scaled loss in this context: unscaled;
6. nothing in this context, with gradients computed in it (a graph's own
   ops: a custom train_step that never scaled its loss): applied as they
   are, with a one-time warning naming the line to add;
7. nothing in this context, with gradients from elsewhere (arguments of a
   `tf.function`, eager values): decided at run time from the step state
   another context left (`PENDING_*` in a variable): unscaled gradients
   handed out there are applied as they are; anything else is taken as
   scaled, Keras's own `apply` semantics (its tests apply pre-scaled
   gradients directly).

The same ledger refuses the sequences that would scale twice: scaling a
loss inside a recording `ScaledGradientTape`, or unscaling gradients that
were handed out unscaled.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import tensorflow as tf

from kmp.loss_scale import LossScaleError

# What the last step context left for `apply`, at run time.
PENDING_NONE = 0
PENDING_SCALED_LOSS = 1
PENDING_UNSCALED = 2

# How `apply` treats its gradients.
SCALED = "scaled"  # unscale them
UNSCALED = "unscaled"  # apply them as they are
NEVER_SCALED = "never scaled"  # as they are, and warn once
AT_RUN_TIME = "at run time"  # from the pending-state variable

# Hand-outs kept per eager context, at most (eager code may take gradients
# it never applies).
_MAX_HANDED_OUT = 2


@dataclasses.dataclass
class _Context:
    scaled_losses: int = 0
    handed_out: list = dataclasses.field(default_factory=list)  # lists of tensors
    scaled_known: list = dataclasses.field(default_factory=list)  # lists of tensors
    recording_tapes: int = 0
    applied: bool = False  # a step was applied here (telemetry reads it)


def _key():
    """The current step context: the graph being built, or None (eager)."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


class Ledger:
    """The per-context record of one optimizer (see the module docstring)."""

    def __init__(self):
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._eager = _Context()

    def _context(self) -> _Context:
        key = _key()
        if key is None:
            return self._eager
        context = self._graphs.get(key)
        if context is None:
            context = self._graphs[key] = _Context()
        return context

    # --- what happened in this context -------------------------------------

    def scaled_loss(self) -> None:
        """A loss was scaled here; refuses a loss scaled inside a recording
        ScaledGradientTape, which scales it already."""
        context = self._context()
        if context.recording_tapes:
            raise LossScaleError(
                "The loss would be scaled twice: a kmp.ScaledGradientTape is "
                "recording, and its gradient() scales the loss itself. Pass the "
                "unscaled loss to tape.gradient(loss, variables) and drop "
                "scale_loss/get_scaled_loss, or use a plain tf.GradientTape "
                "with optimizer.scale_loss(loss)."
            )
        context.scaled_losses += 1

    def tape_entered(self) -> None:
        self._context().recording_tapes += 1

    def tape_exited(self) -> None:
        context = self._context()
        context.recording_tapes = max(0, context.recording_tapes - 1)

    def handing_out(self, scaled: list, unscaled: list) -> None:
        """`unscaled` (computed from `scaled`, which may be empty) is handed
        out as unscaled gradients; refuses to unscale gradients twice."""
        context = self._context()
        known = {id(t) for hand_out in context.handed_out for t in hand_out}
        if any(id(g) in known for g in scaled if g is not None):
            raise LossScaleError(
                "These gradients are unscaled already: they came from "
                "kmp.ScaledGradientTape.gradient or get_unscaled_gradients. "
                "Unscaling them again would divide them by the loss scale twice. "
                "Pass them to optimizer.apply(grads, variables) as they are."
            )
        context.handed_out.append([g for g in unscaled if g is not None])
        if scaled:
            context.scaled_known.append([g for g in scaled if g is not None])
        if context is self._eager and len(context.handed_out) > _MAX_HANDED_OUT:
            del context.handed_out[0]
            if context.scaled_known:
                del context.scaled_known[0]

    # --- what apply does --------------------------------------------------

    def decide(self, grads: list[Any]) -> str:
        """How `apply` treats `grads` (`SCALED`, `UNSCALED`, `NEVER_SCALED`
        or `AT_RUN_TIME`), consuming what it used; see the module docstring."""
        context = self._context()
        ids = {id(g) for g in grads if g is not None}
        unscaled = {id(t) for hand_out in context.handed_out for t in hand_out}
        known_scaled = {id(t) for hand_in in context.scaled_known for t in hand_in}
        if ids and ids <= unscaled:
            self._consume(context, context.handed_out, ids)
            return UNSCALED
        if ids & unscaled:
            raise LossScaleError(
                "apply() received a mix of gradients: some were handed out "
                "unscaled (by kmp.ScaledGradientTape.gradient or "
                "get_unscaled_gradients) and some not, so kmp cannot tell "
                "whether to unscale them. Pass all of one kind: the unscaled "
                "gradients (clipped as you like), or all the scaled ones."
            )
        if ids and ids <= known_scaled:
            self._consume(context, context.scaled_known, ids)
            if context.handed_out:
                del context.handed_out[0]
            return SCALED
        if context.handed_out:
            del context.handed_out[0]
            if context.scaled_known:
                del context.scaled_known[0]
            return UNSCALED
        if context.scaled_losses:
            context.scaled_losses -= 1
            return SCALED
        if _computed_here(grads):
            return NEVER_SCALED
        return AT_RUN_TIME

    def applied(self) -> None:
        """A step was applied in this context."""
        self._context().applied = True

    def took_step(self) -> bool:
        """Whether a step was applied in this context since the last call (a
        training step: telemetry reports only there); resets it."""
        context = self._context()
        applied, context.applied = context.applied, False
        return applied

    @staticmethod
    def _consume(context, hand_outs: list, ids: set) -> None:
        for i, hand_out in enumerate(hand_outs):
            if {id(t) for t in hand_out} & ids:
                del hand_outs[i]
                return


def _computed_here(grads) -> bool:
    """Whether the gradients are ops of the graph being built (not its
    inputs or captured values): computed in this step, from a loss no one
    scaled here. Eager values carry no such record."""
    graph = _key()
    if graph is None:
        return False
    found = False
    for g in grads:
        if g is None:
            continue
        tensor = g.values if isinstance(g, tf.IndexedSlices) else g
        op = getattr(tensor, "op", None)
        if op is None or getattr(tensor, "graph", None) is not graph:
            return False
        if op.type == "Placeholder":
            return False
        found = True
    return found
