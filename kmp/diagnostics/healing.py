"""`OverflowHealer`: a layer whose forward pass keeps overflowing float16
moves to float32 (or bfloat16) on its own, while `fit` runs.

Loss scaling protects gradients; it cannot fix a forward pass whose
activations exceed float16's range (65504): every such step is skipped,
and a plain loss-scale optimizer halves its scale each time, until it hits
the floor and training stalls. The healer tells the two apart and acts:

1. **Watching** (the default state): after each step it reads how many
   steps had a loss that was itself inf/NaN (counted in the step by a watch
   set on the optimizer: `kmp.diagnostics.forward_watch`). Such a step is
   skipped and counted, and the loss scale is left as it is (a lower scale
   cannot fix it).
2. **Diagnosing**: at the first forward overflow, the step is traced again
   with a probe (`kmp.backend.probe`) that records the first op whose
   output is non-finite, which names the layer whose call ran it. This
   costs one finite check per activation, for as long as it lasts.
3. **Healing**: when the same layer overflows in `overflows` of the last
   `window` steps, it is moved to float32 compute, or bfloat16 with
   `to=` (through Keras's public `layer.dtype_policy` setter, quantization
   kept), and the step is traced again. Its variables keep their dtype;
   Keras casts its output for the Keras layers that take it. The healer
   goes on diagnosing: the overflow may move on to the layer its large
   output reaches, which is then moved in turn. After `window` steps
   without a forward overflow it stops diagnosing and the step is traced
   once more without the probe.

A move is chosen before anything moves, from one trace of the forward pass
at the layers' own policies (nothing runs): where code outside the layer
would join its moved output with a 16-bit tensor in raw TensorFlow, the
enclosing layer, whose code that is, moves instead; where there is none,
the healer gives up (below). So validation, `evaluate` or `predict` right
after a move trace a model that works. A `train_step` of the model's own
is not traced before it runs: where only it refuses the move, its next
step fails with an error that says what moved and what to do. Its watch
on the optimizer lasts one call of the train function and is renewed
before each, so a `fit` that ends without `on_train_end` leaves none
behind.

Every move is in `healer.heals` (layer, step, the op that overflowed, and
what the layer's activations reached in float32 in the step after it), in
`History` as `healed_layers` (how many so far), printed, and in
`kmp.precision_report` as the rule that decided the layer's precision.
The layer's policy is the model's own, so `model.save` /
`keras.models.load_model` keep the healed precision, and a later
`kmp.prepare` keeps it as it keeps a `dtype=` of the user's.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import keras

from kmp._base import backends
from kmp._base import warn as _warn
from kmp.backend import distribute
from kmp.backend import graph
from kmp.backend import machine
from kmp.backend import probe as probe_lib
from kmp.backend import tracing
from kmp.diagnostics import forward_watch
from kmp.planning import applied as applied_lib
from kmp.planning import saved
from kmp.precision import quantization
from kmp.precision import traversal
from kmp.scaling import optimizer as optimizer_lib
from kmp.training import attach as attach_lib
from kmp.training import train_function

WATCHING = "watching"
DIAGNOSING = "diagnosing"
_TARGETS = ("float32", "bfloat16", "auto")
# The policy a layer moved to a dtype gets (its variables stay float32).
_POLICIES = {"float32": "float32", "bfloat16": "mixed_bfloat16"}


@dataclasses.dataclass(frozen=True)
class Heal:
    """One layer moved out of float16 by `OverflowHealer`.

    Attributes:
        layer: The layer's path in the model.
        step: The training step (counted from the start of `fit`, from 1)
            after which it moved.
        op: The op whose output overflowed (its graph name).
        overflows: In how many of the last `window` steps it overflowed.
        magnitude: The largest |value| its activations reached after the
            move, in the step after it (what overflowed float16, 65504);
            None until that step ran.
        dtype: What it computes in since (`'float32'`, or `'bfloat16'`).
        sublayers: Whether the layers inside it moved with it (the op that
            overflowed is in its own code, which joins their outputs).
    """

    layer: str
    step: int
    op: str
    overflows: int
    magnitude: float | None = None
    dtype: str = "float32"
    sublayers: bool = False

    def __str__(self) -> str:
        reached = (
            ""
            if self.magnitude is None
            else f"; in {self.dtype} its activations reached {self.magnitude:.3g}"
        )
        inside = " with the layers inside it" if self.sublayers else ""
        return (
            f"healed at step {self.step}: {self.layer!r}{inside} moved to "
            f"{self.dtype} "
            f"(its output overflowed float16 in {self.overflows} "
            f"step{'s' if self.overflows != 1 else ''}, at {self.op}{reached})"
        )


class OverflowHealer(keras.callbacks.Callback):
    """Moves a layer whose forward pass overflows float16 to float32.

    See the module docstring for what it does step by step. Use it with a
    model compiled by `kmp.compile` (or with a `kmp.LossScaleOptimizer`),
    trained by `fit`; a forward overflow of the loss computation itself
    (outside every layer) is reported, not healed.

    Args:
        overflows: How many forward overflows of the same layer, within
            `window` steps, move it. At least 1.
        window: The number of steps those overflows are counted in, and
            the number of steps without one after which diagnosing stops.
            At least `overflows`.
        verbose: Print each move (1, default) or not (0).
        to: What an overflowing layer moves to: `'float32'` (the default:
            exact), `'bfloat16'` (float32's range in 16 bits: Keras's
            `'mixed_bfloat16'`, its variables float32; fast where the
            machine computes bfloat16 natively, emulated and slow where it
            does not), or `'auto'`: bfloat16 where this machine's `'auto'`
            policy is bfloat16 (native bfloat16 math: GPUs of compute
            capability 8.0 and up, TPUs, CPUs with AVX512-BF16 or AMX),
            float32 elsewhere. bfloat16 has float32's range, not its
            precision: a layer that overflows float16 because it cancels
            large values (`E[x²] - E[x]²`) trains worse in bfloat16.
            `kmp.debug.precision_audit(model, sample=batch,
            policy="mixed_bfloat16")` tells such a layer apart.
        path: A JSON file the moves are written to as they happen (its
            folder must exist), and read back at the start of each `fit`: a
            run resumed in a fresh process (`keras.callbacks.BackupAndRestore`
            restores weights and optimizer state, not policies) on the model
            rebuilt by your code starts with the same layers moved, before
            its first step. A recorded move the model's step cannot be
            traced with (another version of the model) is taken back, with
            a warning. None (the default): not kept.

    Attributes:
        heals: The `Heal`s so far, in order.
        forward_overflows: Steps skipped because the forward pass overflowed.
        gave_up: Whether it met an overflow no move fixes (outside every
            layer, or in a layer already in float32): it then warned, and
            forward overflows lower the loss scale again, as without it.

    Example:

    >>> kmp.set_policy("mixed_float16")
    <Policy "mixed_float16": ...>
    >>> inputs = keras.Input((4,))
    >>> h = keras.layers.Dense(8, name="up")(inputs)
    >>> h = keras.layers.LayerNormalization(name="norm")(h)
    >>> model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
    >>> up = model.get_layer("up")
    >>> up.kernel.assign(up.kernel * 1e5)  # its output overflows float16
    <...>
    >>> model = kmp.compile(model, optimizer="adam", loss="mse")
    >>> healer = kmp.callbacks.OverflowHealer(overflows=1, verbose=0)
    >>> _ = model.fit(np.ones((64, 4)), np.ones((64, 1)), batch_size=8,
    ...               callbacks=[healer], verbose=0)
    >>> [h.layer for h in healer.heals], healer.forward_overflows
    (['up'], 2)
    >>> model.get_layer("up").compute_dtype
    'float32'
    """

    def __init__(
        self,
        overflows: int = 3,
        window: int = 20,
        verbose: int = 1,
        to: str = "float32",
        path: str | os.PathLike | None = None,
    ):
        backends.require_tensorflow(
            "kmp.callbacks.OverflowHealer",
            "Find the layer with kmp.debug.find_nonfinite(model, x_batch), "
            "then kmp.set_layer_policy('name:<layer>', 'float32') and "
            "kmp.compile the model again.",
        )
        super().__init__()
        self.path = None if path is None else os.fspath(path)
        if self.path is not None and not os.path.isdir(
            os.path.dirname(os.path.abspath(self.path))
        ):
            raise ValueError(
                "OverflowHealer(path=...) is a JSON file to keep the moves in; "
                f"its folder does not exist. Received: {self.path!r}. Create "
                "the folder first (os.makedirs(folder, exist_ok=True))."
            )
        if to not in _TARGETS:
            raise ValueError(
                "OverflowHealer(to=...) is what an overflowing layer moves to: "
                f"one of {', '.join(repr(t) for t in _TARGETS)}. Received: {to!r}."
            )
        self.to = to
        self._target = "float32"
        if not (isinstance(overflows, int) and overflows >= 1):
            raise ValueError(
                "OverflowHealer(overflows=...) is how many forward overflows of "
                "one layer move it to float32: an int of at least 1. Received: "
                f"{overflows!r}."
            )
        if not (isinstance(window, int) and window >= overflows):
            raise ValueError(
                "OverflowHealer(window=...) is the number of steps overflows are "
                f"counted in: an int of at least overflows ({overflows}). "
                f"Received: {window!r}."
            )
        self.overflows = overflows
        self.window = window
        self.verbose = verbose
        self.heals: list[Heal] = []
        self.forward_overflows = 0
        self._state = WATCHING
        self._probe: probe_lib.ForwardProbe | None = None
        self._seen: dict[str, list[int]] = {}
        self._last_overflow = 0
        self._step = 0
        self._batches = 0  # steps run in this epoch, as Keras counts them
        self._counter: Any = None  # an int64 variable (graph.counter)
        self._counted = 0
        self._unattributed = 0
        self._unmeasured: tuple | None = None  # (heal's index, layer)
        self._restored: list[tuple] = []  # moves made again, no step run yet
        self.gave_up = False

    def _optimizer(self) -> optimizer_lib.LossScaleOptimizer:
        opt = optimizer_lib.of_model(self.model)
        if opt is None:
            raise ValueError(
                "OverflowHealer needs the model compiled with a "
                "kmp.LossScaleOptimizer, which records whether each step's loss "
                "was finite. Received a model whose optimizer is "
                f"{type(getattr(self.model, 'optimizer', None)).__name__}: "
                "compile it with kmp.compile(model, ...)."
            )
        return opt

    def on_train_begin(self, logs=None):
        if distribute.under_strategy(self.model):
            raise ValueError(
                "OverflowHealer does not run under a tf.distribute strategy yet: "
                "its probe records one replica's forward pass. Train without the "
                "strategy to find the layers, or pin them to float32 yourself: "
                "kmp.set_layer_policy('name:PATH', 'float32') before kmp.compile."
            )
        if self.model.run_eagerly:
            raise ValueError(
                "OverflowHealer finds the overflowing layer in the traced "
                "training step, and this model runs eagerly (run_eagerly=True). "
                "Compile it without run_eagerly to use the healer."
            )
        opt = self._optimizer()
        self._target = self.to
        if self.to == "auto":
            bfloat16 = machine.resolve_auto().policy == "mixed_bfloat16"
            self._target = "bfloat16" if bfloat16 else "float32"
        if not isinstance(self.model.train_function, train_function.TrainFunction):
            # kmp's train function ends the watch of a fit that ends without
            # on_train_end, and takes back a move whose step cannot trace.
            attach_lib.attach(self.model)
        if self._counter is None:
            self._counter = graph.counter()
        self._counted = int(self._counter.numpy())
        forward_watch.watch(opt, keeps_scale=not self.gave_up, counter=self._counter)
        self._state = WATCHING
        self._step = 0
        self._last_overflow = 0
        self._unattributed = 0
        self._seen.clear()
        restored = self._restore()
        self._restored = restored
        if not restored:
            train_function.retrace(self.model)
            return
        # The forward pass was read before the moves; a train_step of the
        # model's own is not, and its first step says so if it fails.
        paths = ", ".join(repr(heal.layer) for heal, _ in restored)
        train_function.retrace(
            self.model,
            f"OverflowHealer's record {self.path!r} moved {paths} of "
            f"{self.model.name!r} again, and the model's training step joins "
            "a moved output with a 16-bit tensor in raw TensorFlow, which "
            "does not mix dtypes. kmp reads the forward pass before a move, "
            "not a train_step's own code. Cast in the step "
            "(keras.ops.cast(y, h.dtype)), or delete the record to train "
            "without those moves.",
        )

    def _restore(self) -> list[tuple]:
        """Moves again the layers `path` records (a resumed run); returns
        (heal, what `_move` moved) for each move it made."""
        if self.path is None or not os.path.exists(self.path):
            return []
        try:
            with open(self.path, encoding="utf-8") as f:
                kept = [Heal(**entry) for entry in json.load(f)["heals"]]
            unknown = sorted({h.dtype for h in kept} - set(_POLICIES))
            if unknown:
                raise ValueError(
                    f"a move to {unknown[0]!r}, where moves are to "
                    f"{' or '.join(repr(d) for d in _POLICIES)}"
                )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"OverflowHealer could not read its moves from {self.path!r} "
                f"({type(e).__name__}: {e}). Expected the JSON file an "
                "OverflowHealer wrote; delete it to start without them."
            ) from e
        layers = {site.path: site.layer for site in traversal.walk(self.model)}
        missing = [h.layer for h in kept if h.layer not in layers]
        # Read from one trace before anything moves: the moves whose output
        # code outside the layer would join with a 16-bit tensor.
        forward = tracing.forward(self.model)
        refused = {}
        for h in kept:
            if h.layer in layers and not forward.error:
                meets = tracing.float32_output_mixes(
                    self.model, forward, layers[h.layer]
                )
                if meets is not None:
                    refused[h.layer] = meets
        if refused:
            _warn.warn(
                f"kmp: OverflowHealer's record {self.path!r} moves layers of "
                f"{self.model.name!r} whose moved output code outside them "
                "would join with a 16-bit tensor: "
                + ", ".join(f"{p!r} ({m})" for p, m in refused.items())
                + ". Those moves are left out. Is it the record of another "
                "version of the model?"
            )
            kept = [h for h in kept if h.layer not in refused]
        if missing:
            _warn.warn(
                f"kmp: OverflowHealer's record {self.path!r} moves layers that "
                f"{self.model.name!r} does not have: {', '.join(missing)}. Those "
                "moves are left out; is it the record of another model?"
            )
        restored = []
        for heal in kept:
            layer = layers.get(heal.layer)
            if layer is None:
                continue
            unit = _unit(layer) if heal.sublayers else [layer]
            moved = _move(unit, heal.dtype, str(heal))
            if heal not in self.heals:
                self.heals.append(heal)
            if not moved:
                continue  # moved already (this process)
            restored.append((heal, moved))
            if self.verbose:
                print(f"kmp: {heal.layer!r} moved to {heal.dtype} again ({heal})")
        if restored:
            saved.write(self.model)
        if refused:
            self._write()  # without the moves left out
        return restored

    def _write(self) -> None:
        """Writes the moves to `path` (whole, or not at all)."""
        if self.path is None:
            return
        entries = [dataclasses.asdict(h) for h in self.heals]
        temporary = f"{self.path}.tmp"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({"heals": entries}, f, indent=1)
        os.replace(temporary, self.path)

    def on_train_end(self, logs=None):
        if self._unmeasured is not None:
            # A move after the last step: said without its magnitude.
            if self.verbose:
                print(f"kmp: {self.heals[self._unmeasured[0]]}")
            self._unmeasured = None
        forward_watch.end(self._optimizer())
        self._state = WATCHING
        train_function.retrace(self.model)

    def on_epoch_begin(self, epoch, logs=None):
        self._batches = 0

    def on_train_batch_begin(self, batch, logs=None):
        # Before every call of the train function, the one that meets the
        # end of a dataset of unknown length too (Keras calls no batch end
        # for it).
        forward_watch.renew(self._optimizer())

    def on_train_batch_end(self, batch, logs=None):
        # `batch` is the last step of the call (steps_per_execution may be
        # more than one), counted in the epoch from 0.
        self._step += max(1, batch + 1 - self._batches)
        self._batches = batch + 1
        opt = self._optimizer()
        count = int(self._counter.numpy())
        overflows, self._counted = count - self._counted, count
        self.forward_overflows += overflows
        if self._unmeasured is not None:
            self._record_magnitude()
        if self._restored:
            # The moves made again at the start ran a step: recorded.
            for heal, moved in self._restored:
                _ran([part for part, _ in moved], heal)
            self._restored = []
        if self.gave_up:
            return
        if not opt._loss_recorded:
            raise ValueError(
                f"OverflowHealer reads each step's loss, and the training step of "
                f"{self.model.name!r} gave none to its kmp.LossScaleOptimizer: "
                "it never calls optimizer.scale_loss(loss) (Keras's own "
                "train_step does) or a kmp.ScaledGradientTape. Call "
                "self.optimizer.scale_loss(loss) in train_step before taking the "
                "gradients, and apply them with optimizer.apply(grads, vars)."
            )
        forward = overflows > 0
        if forward:
            self._last_overflow = self._step
        if self._state == WATCHING:
            if forward:
                self._diagnose(opt, True)
            return
        if forward:
            self._attribute()
        elif self._step - self._last_overflow >= self.window:
            self._diagnose(opt, False)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["healed_layers"] = float(len(self.heals))

    def _diagnose(self, opt, on: bool) -> None:
        if on and self._probe is None:
            self._probe = probe_lib.ForwardProbe()
        self._state = DIAGNOSING if on else WATCHING
        self._seen.clear()
        forward_watch.watch(
            opt, self._probe if on else None, keeps_scale=True, counter=self._counter
        )
        train_function.retrace(self.model)

    def _attribute(self) -> None:
        found = self._probe.layer_at(self.model)
        self._probe.reset()
        if found is None:
            # The loss is non-finite but no 16-bit op of the traced step is:
            # a float32 op (log(0) in the loss), or a step the probe is not
            # traced into (a custom train_step with a tape).
            self._unattributed += 1
            if self._unattributed >= self.window:
                self._give_up(
                    f"kmp: {self._unattributed} forward overflows of "
                    f"{self.model.name!r} with no 16-bit op of its traced step "
                    "overflowing: the loss is non-finite from a float32 op (a "
                    "log(0), a division by zero), or the step does not hand its "
                    "loss to optimizer.scale_loss. kmp.debug.find_nonfinite(model, "
                    "x, y) on a failing batch shows where."
                )
            return
        op_name, chain = found
        if not chain:
            self._give_up(
                f"kmp: the forward pass overflowed float16 at {op_name!r}, outside "
                f"every layer of {self.model.name!r} (the loss, or the model's "
                "own code): OverflowHealer moves layers only. Compute the loss "
                "from float32 predictions, or that code in float32."
            )
            return
        layer = chain[-1]
        path = _path_of(self.model, layer)
        steps = [s for s in self._seen.get(path, []) if s > self._step - self.window]
        steps.append(self._step)
        self._seen[path] = steps
        if len(steps) < self.overflows:
            return
        unit = _unit(layer)
        if not any(part.compute_dtype == "float16" for part in unit):
            self._give_up(
                f"kmp: {path!r} computes in {layer.compute_dtype} and still "
                f"overflows at {op_name!r}: its values exceed float16's range "
                "where they leave it. Check its weights and inputs for exploding "
                "values."
            )
            return
        self._seen.clear()
        self._heal(chain, op_name, len(steps))

    def _heal(self, chain: list, op_name: str, overflows: int) -> None:
        """Moves the innermost layer of `chain` (with the layers inside it
        where it holds any) and has the step traced again. Where code
        outside the layer would meet its moved output with a 16-bit tensor
        (read from one trace of the forward pass, before anything moves),
        the enclosing layer, whose code that is, moves instead; where there
        is none, the healer gives up."""
        depth = len(chain) - 1
        tried: list[str] = []
        forward = tracing.forward(self.model)
        while not forward.error:
            meets = tracing.float32_output_mixes(self.model, forward, chain[depth])
            if meets is None:
                break
            tried.append(_path_of(self.model, chain[depth]))
            if depth == 0:
                paths = ", then ".join(repr(p) for p in tried)
                self._give_up(
                    f"kmp: moving {paths} to {self._target} would leave code "
                    f"outside the layer ({meets}) joining its output with a "
                    "16-bit tensor in raw TensorFlow: no layer of "
                    f"{self.model.name!r} can move. It keeps its precision."
                )
                return
            depth -= 1
        layer = chain[depth]
        path = _path_of(self.model, layer)
        unit = _unit(layer)
        heal = Heal(
            path,
            self._step,
            op_name,
            overflows,
            dtype=self._target,
            sublayers=len(unit) > 1,
        )
        _move(unit, self._target, str(heal))
        saved.write(self.model)  # so that model.save keeps the move
        self.heals.append(heal)
        # The next step (traced again, with the probe) measures what the
        # layer's activations reach after the move.
        self._probe.measure(self.model, [layer])
        self._unmeasured = (len(self.heals) - 1, layer)
        self._write()
        # A train_step of the model's own is not read before the move: its
        # next step says so if it fails.
        record = f" The move is in {self.path!r}." if self.path else ""
        train_function.retrace(
            self.model,
            f"OverflowHealer moved {path!r} of {self.model.name!r} to "
            f"{self._target} after it overflowed float16, and the model's "
            "training step joins its output with a 16-bit tensor in raw "
            "TensorFlow, which does not mix dtypes. kmp reads the forward "
            "pass before a move, not a train_step's own code. Cast in the "
            f"step (keras.ops.cast(y, h.dtype)) and fit again.{record}",
        )

    def _record_magnitude(self) -> None:
        index, layer = self._unmeasured
        self._unmeasured = None
        peak = float(self._probe.peak.numpy())
        self._probe.measure(self.model, [])  # at the next trace
        heal = self.heals[index]
        if peak > 0:
            heal = dataclasses.replace(heal, magnitude=peak)
            self.heals[index] = heal
            self._write()
        _ran(_unit(layer) if heal.sublayers else [layer], heal)
        if self.verbose:
            print(f"kmp: {heal}")

    def _give_up(self, message: str) -> None:
        """An overflow no move fixes: said once, and from then on forward
        overflows lower the loss scale again, as without the healer, so that
        a collapse is seen (`NonFiniteGuard`, `LossScaleMonitor`)."""
        _warn.warn(
            f"{message} Forward overflows now lower the loss scale again, as "
            "without OverflowHealer."
        )
        self.gave_up = True
        self._state = WATCHING
        forward_watch.watch(self._optimizer(), counter=self._counter)
        train_function.retrace(self.model)


def _unit(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """What moves when an op of `layer`'s own call overflows: the layer,
    and with it every layer inside it. An op of a block's own code joins
    its sublayers' outputs (a gate times a projection, a residual add): in
    float32 only if they are."""
    return [layer] + [site.layer for site in traversal.walk(layer)]


def _move(unit: list, dtype: str, text: str) -> list[tuple]:
    """Moves the layers of `unit` that compute in float16 to `dtype`, each
    recorded as healed with `text`; returns (layer, its policy before)."""
    moved = []
    for part in unit:
        if part.compute_dtype != "float16":
            continue
        moved.append((part, quantization.snapshot(part)))
        quantization.set_float_part(part, _POLICIES[dtype])
        applied_lib.note_heal(part, quantization.float_part(part), text)
    return moved


def _ran(parts: list, heal: Heal) -> None:
    """Records that a training step ran with `heal`'s move of `parts` (what
    LossScaleMonitor records), with its text as it now is."""
    for part in parts:
        if part in applied_lib.healed:
            applied_lib.note_heal(
                part, quantization.float_part(part), str(heal), ran=True
            )


def _path_of(model: keras.layers.Layer, layer: keras.layers.Layer) -> str:
    for site in traversal.walk(model):
        if site.layer is layer:
            return site.path
    return layer.name
