"""Whether the gradients `apply()` receives are scaled: stated by the code
that hands them over, never guessed.

Each entry point has one contract, visible at the call site or in the
optimizer's type:

=====================================================  ======================
gradients handed over by                               taken as
=====================================================  ======================
`fit` (Keras's `train_step`), `opt.apply(grads)` /     gradients of
`opt.apply_gradients(...)` on `kmp.LossScaleOptimizer`  `scale_loss(loss)`:
(Keras 3's contract)                                   unscaled by kmp
`opt.apply(grads, vars, scaled=True)`                  the same, stated
`opt.apply(grads, vars, scaled=False)`: the gradients  as they are
of `kmp.ScaledGradientTape.gradient`, of
`get_unscaled_gradients`, or of a loss never scaled
`kmp.mixed_precision.LossScaleOptimizer`'s             as they are
`apply_gradients` / `apply` (tf.keras 2's contract:
the gradients `get_unscaled_gradients` returned)
`stateless_apply` on JAX (`fit`'s jitted step)          gradients of
                                                       `scale_loss(loss)`
=====================================================  ======================

One exception to Keras 3's contract is decided by kmp, and only where it is
exact: in a traced step (a `tf.function`, such as the step `fit` traces)
that scaled no loss and whose optimizer never handed out unscaled
gradients, gradients computed by a tape's backward pass in that trace
without reading the loss scale (a custom `train_step` that never calls
`scale_loss`) cannot hold the scale: they are applied as they are, with a
one-time warning naming the line to add. kmp reads this from TensorFlow's
traced graph (`kmp.backend.backward`), and checks that reading once per
process on a tiny trace whose answers are known. Where the check fails, a
traced `apply` with no loss scaled raises an error naming the line to
write instead. Gradients that enter the traced function as values (its
arguments, captured tensors, a variable's value, or what is computed from
those alone) follow the contract.

What kmp records, per step context (the outermost graph being traced, or
eager execution) since the last `apply` there, is used to refuse sequences
that the contract makes wrong, never to decide (on TensorFlow; on JAX,
where no graph can be read, a loss scaled since the last apply decides,
and `scaled=` overrides it): gradients handed out
unscaled and then passed to an `apply` that would unscale them again, a
loss scaled inside a recording `ScaledGradientTape` (which scales it
already), scaled gradients passed to a tf.keras 2 `apply_gradients`. Two
more refusals where kmp cannot tell: an `apply` with no loss scaled in its
context once the optimizer has handed out unscaled gradients anywhere (a
tape in another function), and an eager `apply` with no loss scaled since
the last one. The records are Python objects of this process, never
saved; `scaled=` always decides.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import keras

from kmp._base import warn as _warn
from kmp.backend import backward
from kmp.backend import machine
from kmp.scaling.config import LossScaleError

# How `apply` treats its gradients.
SCALED = "scaled"  # unscale them
UNSCALED = "unscaled"  # apply them as they are
NEVER_SCALED = "never scaled"  # as they are, and warn once


@dataclasses.dataclass
class _Context:
    scaled_losses: int = 0  # scale_loss / get_scaled_loss calls
    hand_outs: int = 0  # unscaled gradients handed out
    recording_tapes: int = 0
    applied: bool = False  # a step was applied here (telemetry reads it)


class Ledger:
    """The per-context records of one optimizer (see the module docstring)."""

    def __init__(self):
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._eager = _Context()
        # Whether unscaled gradients were ever handed out (for refusals only).
        self._handed_out_before = False

    def _context(self) -> _Context:
        graphs = backward.step_graphs()
        if not graphs:
            return self._eager
        key = graphs[-1]
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

    def handed_out(self) -> None:
        """Unscaled gradients were handed out here."""
        self._context().hand_outs += 1
        self._handed_out_before = True

    # --- what apply does --------------------------------------------------

    def unscaled(self, grads, variables, *, scaled, contract, scale, owner) -> list:
        """The gradients handed to `owner.apply` as its inner optimizer must
        see them: unscaled where they are the gradients of a scaled loss
        (`decide`). `scale` is the owner's `LossScale`."""
        decision = self.decide(grads, scaled, contract, scale.value, scale.scaling)
        if not scale.scaling:
            return grads
        if decision == NEVER_SCALED and _warn.once(owner, "never scaled"):
            _warn.warn(NEVER_SCALED_WARNING)
        if decision == SCALED:
            return scale.unscale(grads, variables)
        return grads

    def decide(
        self,
        grads: list[Any],
        scaled: bool | None,
        contract: str,
        scale_variable: Any,
        scaling: bool = True,
    ) -> str:
        """How `apply` treats `grads`: `SCALED`, `UNSCALED` or `NEVER_SCALED`.

        Args:
            grads: The gradients `apply` received.
            scaled: What the caller stated (`None`: nothing).
            contract: The optimizer's contract when nothing is stated
                (`SCALED`: Keras 3's; `UNSCALED`: tf.keras 2's).
            scale_variable: The loss-scale variable, whose reads mark the
                gradients computed with the scale.
            scaling: Whether the loss is scaled at all (mode `'none'`: either
                reading gives the same update, so nothing is refused).

        Raises:
            LossScaleError: for a sequence the contract makes wrong.
        """
        current = self._context()
        eager = current is self._eager
        # What happened since the last apply in this context; the next apply
        # starts afresh.
        context = dataclasses.replace(current)
        current.scaled_losses = current.hand_outs = 0
        if scaled is not None:
            return SCALED if scaled else UNSCALED
        if not scaling:
            return UNSCALED
        if contract == UNSCALED:
            if context.scaled_losses and not context.hand_outs:
                raise LossScaleError(
                    "This optimizer keeps tf.keras 2's contract: apply_gradients "
                    "takes the unscaled gradients that get_unscaled_gradients "
                    "returns, and a loss was scaled here with none unscaled. "
                    "Unscale them first: grads = "
                    "optimizer.get_unscaled_gradients(scaled_grads); or, if they "
                    "are the gradients of the scaled loss, say so: "
                    "optimizer.apply(grads, variables, scaled=True)."
                )
            return UNSCALED
        if keras.backend.backend() == "jax":
            # No traced graph to read: a loss scaled in this step's code
            # (scale_loss runs in Python while JAX traces) decides.
            if context.scaled_losses:
                return SCALED
            raise LossScaleError(NO_LOSS_SCALED_ON_JAX)
        if context.hand_outs:
            raise LossScaleError(
                "apply() takes the gradients of scale_loss(loss) and unscales "
                "them, but unscaled gradients were handed out here (by "
                "kmp.ScaledGradientTape.gradient): "
                "unscaling those again would divide the update by the loss "
                "scale. Say which these are: optimizer.apply(grads, variables, "
                "scaled=False) for the unscaled ones, scaled=True for the "
                "gradients of scale_loss(loss). (To look at gradients without "
                "applying them, a plain tf.GradientTape hands out nothing.)"
            )
        if context.scaled_losses:
            return SCALED
        if self._handed_out_before:
            raise LossScaleError(
                "apply() received gradients with no loss scaled here, and this "
                "optimizer has handed out unscaled gradients before (by "
                "kmp.ScaledGradientTape.gradient), "
                "perhaps in another function: kmp cannot tell which these are. "
                "Say so: optimizer.apply(grads, variables, scaled=False) for "
                "unscaled gradients, scaled=True for the gradients of "
                "scale_loss(loss)."
            )
        if eager:
            raise LossScaleError(
                "apply() received gradients eagerly, and no loss was scaled "
                "since the last apply: kmp cannot tell whether they are the "
                "gradients of scale_loss(loss) (Keras's own wrapper assumes so "
                "and divides them by the loss scale) or of a loss never scaled "
                "(a custom train_step run eagerly). Scale the loss before taking "
                "gradients, loss = optimizer.scale_loss(loss), or say which "
                "they are: optimizer.apply(grads, variables, scaled=True) or "
                "scaled=False."
            )
        misread = backward.misread_cases()
        if misread:
            version = machine.tensorflow_version()
            raise LossScaleError(
                "apply() received gradients in a traced step that scaled no "
                "loss, and kmp cannot tell whether they are scaled on "
                f"TensorFlow {version}. kmp reads that from the traced "
                "graph, and this TensorFlow fails kmp's check of that reading "
                f"({'; '.join(misread)}). Scale the loss before taking "
                "gradients: loss = optimizer.scale_loss(loss). Or say which "
                "they are: optimizer.apply(grads, variables, scaled=False) for "
                "the gradients of a loss never scaled, scaled=True for the "
                "gradients of scale_loss(loss)."
            )
        if backward.computed_without_the_scale(grads, scale_variable):
            return NEVER_SCALED
        return SCALED

    def applied(self) -> None:
        """A step was applied in this context."""
        self._context().applied = True

    def took_step(self) -> bool:
        """Whether a step was applied in this context since the last call (a
        training step: telemetry reports only there); resets it."""
        context = self._context()
        applied, context.applied = context.applied, False
        return applied


NO_LOSS_SCALED_ON_JAX = (
    "The optimizer takes the gradients of optimizer.scale_loss(loss) and "
    "unscales them, but no loss was scaled since its last apply: kmp cannot "
    "tell whether these gradients are scaled, and on JAX it cannot read that "
    "from the step. Scale the loss inside the function jax.value_and_grad "
    "differentiates, traced with this apply: loss = optimizer.scale_loss(loss). "
    "In a train_step, call self.optimizer.scale_loss inside a "
    "keras.StatelessScope over the optimizer's state (kmp's docs, the JAX "
    "page, show how). Or say which "
    "they are: stateless_apply(..., scaled=True) for the gradients of a loss "
    "scaled in another function, scaled=False for those of a loss never scaled."
)


NEVER_SCALED_WARNING = (
    "kmp.LossScaleOptimizer.apply() received the gradients of a loss that was "
    "never scaled (a custom train_step or loop that does not call scale_loss; "
    "kmp read it from the traced step: no loss was scaled, and a backward "
    "pass there computed the gradients without meeting the loss scale). kmp "
    "applies them as they are; float16 gradients may underflow without "
    "scaling. Scale the loss before taking gradients: "
    "loss = optimizer.scale_loss(loss) (self.optimizer in a train_step). "
    "Where no layer computes in float16 (bfloat16, float32), build the "
    "optimizer with mode='none': it then scales nothing."
)
