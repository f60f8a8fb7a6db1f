"""What a training collapse was, named: `TrainingCollapsedError`, with the
cause, the layers at fault and the fix (`diagnose`)."""

from __future__ import annotations

from typing import Any

import keras

from kmp.diagnostics import debug
from kmp.precision import policy as policy_lib
from kmp.precision import quantization
from kmp.scaling import optimizer as optimizer_lib
from kmp.training.stall import TrainingCollapsedError


def diagnose(
    model: keras.Model,
    cause: str,
    max_consecutive_skips: int,
    probe: Any = None,
    probe_targets: Any = None,
) -> TrainingCollapsedError:
    """The diagnosis of a collapse `kmp.callbacks.NonFiniteGuard` detected:
    what collapsed (`cause`: `'weights'`, `'gradient'` or `'forward'`), the
    layers at fault where they can be found (by `kmp.debug.last_overflow`, or
    `kmp.debug.find_nonfinite` on the probe batch), and the fix."""
    opt = optimizer_lib.of_model(model)
    if cause == "weights":
        if policy_lib.get(quantization.float_policy(model)).needs_loss_scaling:
            advice = (
                "Use kmp.compile or a kmp.LossScaleOptimizer, which skips such steps."
            )
        else:
            advice = (
                "Without loss scaling (bfloat16, float32) every step is "
                "applied, also a non-finite one. Restore the weights from "
                "before the collapse (a checkpoint, or "
                "keras.callbacks.BackupAndRestore), find the layer with "
                "kmp.debug.find_nonfinite(model, x) on the failing batch, "
                "and lower the learning rate or clip gradients "
                "(global_clipnorm on the optimizer)."
            )
        name = type(getattr(opt, "inner_optimizer", model.optimizer))
        name = name.__name__
        return TrainingCollapsedError(
            "Training collapsed: the loss is inf/NaN and the weights have "
            f"become inf/NaN (the optimizer, {name}, applied a non-finite "
            f"step). {advice}",
            cause,
            (),
        )
    if opt.mode == "none":
        head = (
            f"Training collapsed: {max_consecutive_skips} steps in a row "
            "were skipped (no loss scaling: nothing to lower)."
        )
    else:
        head = (
            f"Training collapsed: {max_consecutive_skips} steps in a row "
            f"were skipped with the loss scale at its floor "
            f"({opt.config.min_scale:g})."
        )
    if cause == "gradient":
        layers = debug.last_overflow(model).layers
        names = ", ".join(repr(n) for n in layers)
        body = (
            "Cause: gradient overflow at every scale: the loss is finite, but "
            f"the gradients of {names} are inf/NaN."
        )
        # The backward search reads TensorFlow's tape.
        if (
            probe is not None
            and probe_targets is not None
            and keras.backend.backend() == "tensorflow"
        ):
            report = debug.find_nonfinite(model, probe, probe_targets)
            if report.found:
                body += f"\n{report}"
        fix = (
            "Fix: if weights are exploding (the largest amplification above, "
            "or the learning rate), fix that; else compute those layers in "
            "float32: "
            + "; ".join(f"kmp.set_layer_policy('name:{n}', 'float32')" for n in layers)
            + ", then kmp.prepare(model)."
        )
        return TrainingCollapsedError(f"{head}\n{body}\n{fix}", cause, layers)
    layers: tuple[str, ...] = ()
    body = "Cause: non-finite forward values: the loss itself is inf/NaN."
    if probe is not None:
        report = debug.find_nonfinite(model, probe)
        if report.found:
            layers = (report.layer,)
            body += f"\n{report}"
        else:
            body += " The probe batch ran finite; the failing batch differs."
    else:
        body += (
            " Pass probe=x_batch to NonFiniteGuard, or run "
            "kmp.debug.find_nonfinite(model, x_batch), to find the layer."
        )
    return TrainingCollapsedError(f"{head}\n{body}", cause, layers)
