"""The fused optimizer update: a Keras optimizer's `apply` as one XLA program.

Mixed precision keeps float32 master weights, so every step ends with a
float32 update of every weight, and that update does not get faster with
16-bit math. Keras's optimizers write the update as separate elementwise
ops (Adam: about a dozen passes over the weights, the moments and the
gradients); on a CPU those passes are memory-bound, and for a 3 x Dense(2048)
MLP under bfloat16 they were about a quarter of the step. Running
the same `apply` under `tf.function(jit_compile=True)` lets XLA fuse the
passes into a few loops over the data: the same formulas, about 3x faster
for Adam on a CPU. This is the job NVIDIA Apex's FusedAdam does
for PyTorch AMP, done for Keras optimizers through TensorFlow's public API.

Only the update is compiled, not the model: compiling the whole bfloat16
step with XLA (`jit_compile=True`) loses oneDNN's bfloat16 matmuls: it ran
1.7x slower than fusing only the update on an Intel Xeon with AMX. That is
also why kmp fuses by default only on machines without GPUs or TPUs: on a
GPU machine Keras's `jit_compile="auto"` (the default) compiles the whole
training step with XLA, update included, when every layer supports it,
while on a CPU-only machine it turns XLA off.

Fusing pays only when the update is large: an XLA program costs a fixed
~0.1-0.5 ms per call and one compilation before the first step (under a
second for a few variables, several seconds for a model with hundreds), and
saves time in proportion to the weights it updates. Measured for Adam
inside kmp's optimizer on a CPU: slower below ~100 K float32 weights,
0.1-0.6 ms faster at 300 K, up to 2.4x faster from 1 M (less when the
weights are spread over many variables). In a whole training step, though,
fusing a small CNN's 0.3 M-weight update made the step slower, by more than
the update takes on the same CPU: so the default fuses an update of at
least `MIN_WEIGHTS` (1 M) weights, counted from the variables it updates,
where the whole step was measured faster. The decision depends on the model
and the machine only, never on a timing, and is the same on every run.

A sparse gradient (`tf.IndexedSlices`, an `Embedding`'s) is made dense
before it enters the XLA program: XLA compiles one program per input
shape, and a sparse gradient's shape follows the batch (a last, smaller
batch or a new sequence length would compile the whole update again,
~1 s each). The numbers are the same: Keras's Adam (and the other updates
that subtract or square the gradient) makes it dense as well; plain SGD
without momentum would have written only the batch's rows, so for it the
fused update passes over the whole table.

`kmp.LossScaleOptimizer(fused_update=...)` decides, under any policy:
`None` (the default) fuses the Keras optimizers in `TESTED` (each tested to
compute the same numbers fused; not their subclasses) on machines without
GPUs or TPUs (where it was measured), when the update has at least
`MIN_WEIGHTS` weights, outside tf.distribute strategies (an update that
all-reduces across replicas cannot run inside one XLA program here),
unless op determinism is enabled (as Keras, which then keeps XLA off), and
unless the optimizer accumulates gradients (Keras's accumulation, compiled
into the program, held about three times the gradients' size more than
unfused, and ran no faster);
`True` and `False` force it, `True` also for other optimizer classes and
for small updates. `kmp.compile` wraps every optimizer (to skip non-finite
steps) with this default, under every policy: float32 models keep float32
weights too, and kmp's skip costs Keras's unfused update a few percent that
fusing more than wins back. `kmp doctor` states this rule.

Memory: the program updates the variables in place (XLA reuses their
buffers), so the fused update holds fewer tensors than Keras's unfused one,
which makes a temporary per elementwise pass. What it costs is the memory
of XLA's compiler, which the process keeps; `fit` therefore compiles the
program before the first step (`compile_ahead`), when that
memory can be reused by the step, not beside the step's activations.
The source tree's benchmarks measure both kinds of memory.
"""

from __future__ import annotations

from typing import Any

import keras

from kmp.backend import machine
from kmp.internals import tensorflow_private

# The optimizer classes `fused_update=None` fuses (tests/test_fused.py checks
# each against its unfused update). Not Muon (its update is mostly matmuls,
# not elementwise passes; not measured) nor MultiOptimizer (its parts may be
# any class).
TESTED = tuple(
    getattr(keras.optimizers, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad",
        "Adadelta", "Adafactor", "Ftrl", "Lamb", "Lion",
    )
)  # fmt: skip


# The smallest update (in weights, summed over its variables) that
# `fused_update=None` fuses; see the module docstring for the measurement.
MIN_WEIGHTS = 1_000_000


def default_for_machine() -> bool:
    """Whether `fused_update=None` fuses on this machine: on a machine
    without GPUs or TPUs, where it was measured to help."""
    caps = machine.capabilities()
    return not caps.gpus and not caps.tpus


def check_setting(value: Any) -> bool | None:
    """Validates a `fused_update` argument (None, True or False)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(
            "fused_update must be None (fuse where it helps: machines without "
            "GPUs or TPUs), True or False. Received: "
            f"{value!r} (of type {type(value).__name__})."
        )
    return value


def is_tested(optimizer: Any) -> bool:
    """Whether `optimizer` (or the optimizer a name such as `'adam'` stands
    for) is of a class in `TESTED` (exactly: not a subclass).

    Example:

    >>> kmp.backend.fused.is_tested("adam")
    True
    >>> class MyAdam(keras.optimizers.Adam):
    ...     pass
    >>> kmp.backend.fused.is_tested(MyAdam())
    False
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    cls = type(optimizer)
    # kmp's own optimizers (kmp.optimizers) say so on their class itself.
    return cls in TESTED or bool(vars(cls).get("_kmp_fused_tested", False))


def weights_of(variables: Any) -> int | None:
    """The number of weights in `variables` (the sum of their sizes), or
    None when a shape is not fully known (such an update is not fused by
    default: XLA needs static shapes)."""
    import tensorflow as tf

    total = 0
    for variable in variables:
        shape = tf.TensorShape(variable.shape)
        if not shape.is_fully_defined():
            return None
        total += shape.num_elements()
    return total


def rule() -> str:
    """The default rule in one sentence, as `kmp doctor` prints it."""
    if keras.backend.backend() != "tensorflow":
        return (
            f"Not used on Keras's {keras.backend.backend()} backend, which "
            "compiles the whole training step with XLA."
        )
    if not default_for_machine():
        return (
            "The optimizer update is not fused by default here: on a machine "
            "with GPUs or TPUs, Keras's jit_compile='auto' compiles the whole "
            "step with XLA where it can."
        )
    return (
        "kmp fuses the float32 optimizer update with XLA when it updates at "
        f"least {MIN_WEIGHTS:,} weights (Keras's "
        "own optimizer classes; not under a tf.distribute strategy, with op "
        "determinism or with gradient accumulation): below that size fusing "
        "was measured to save little, "
        "and to slow a small CNN's whole step. fused_update=True/False "
        "forces it."
    )


def resolve(setting: bool | None, optimizer: Any = None, variables: Any = None) -> bool:
    """Whether an apply with this `fused_update` setting fuses, here and now
    (called when the update is traced, so it sees the strategy in force).
    With `setting=None`, only the classes in `TESTED` are fused, and only
    updates of at least `MIN_WEIGHTS` weights when `variables` are given.

    Example:

    >>> from kmp.backend.fused import resolve, default_for_machine
    >>> resolve(True), resolve(False)  # no strategy here
    (True, False)
    >>> resolve(None) == default_for_machine()
    True
    >>> small = [keras.Variable(np.zeros((1000, 100)))]  # 100 K weights
    >>> resolve(None, "adam", small)
    False
    >>> large = [keras.Variable(np.zeros((1000, 1000)))]  # 1 M weights
    >>> resolve(None, "adam", large) == default_for_machine()
    True
    >>> resolve(None, keras.optimizers.Adam(gradient_accumulation_steps=2), large)
    False
    """
    if setting is False:
        return False
    if keras.backend.backend() != "tensorflow":
        if setting:
            raise ValueError(
                "fused_update=True fuses the optimizer update into one XLA "
                "program on TensorFlow. On "
                f"{keras.backend.backend()}, Keras compiles the whole training "
                "step with XLA already, the update included. Pass "
                "fused_update=None (the default) or False."
            )
        return False
    import tensorflow as tf

    if tf.distribute.has_strategy():
        if setting:
            raise ValueError(
                "fused_update=True cannot be used under a tf.distribute "
                f"strategy ({type(tf.distribute.get_strategy()).__name__}): "
                "the update all-reduces the gradients across replicas, which "
                "cannot run inside one XLA program. Pass fused_update=None "
                "(the default, which does not fuse under a strategy) or False; "
                "for a loaded model, set model.optimizer.fused_update = None "
                "before training, or load it with compile=False and compile "
                "it again."
            )
        return False
    if setting:
        return True
    return (
        default_for_machine()
        and not tensorflow_private.op_determinism_enabled()
        and (optimizer is None or is_tested(optimizer))
        and not getattr(optimizer, "gradient_accumulation_steps", None)
        and (variables is None or (weights_of(variables) or 0) >= MIN_WEIGHTS)
    )


class FusedApply:
    """Calls `optimizer.apply(grads, variables)` as one XLA program.

    One compiled function per list of variables (a model trains one list;
    a custom loop may train several). The optimizer must be built first:
    XLA programs cannot create variables. Sparse gradients are made dense
    first, so that the program's input shapes are the variables' shapes
    and it is compiled once, whatever the batch. The program takes a
    boolean `run` beside the gradients: with `run` False it leaves every
    variable as it is, so that it can be compiled before training
    (`compile_ahead`).
    """

    def __init__(self, optimizer: Any):
        self._optimizer = optimizer
        self._functions: dict[tuple[int, ...] | None, Any] = {}

    def __call__(self, grads: list, variables: list | None, run: Any = True) -> None:
        import tensorflow as tf

        function = self._function(variables)
        shapes = [None] * len(grads) if variables is None else variables
        function(
            [_dense_gradient(g, v) for g, v in zip(grads, shapes, strict=True)],
            tf.convert_to_tensor(run, tf.bool),
        )

    def compile_ahead(self, variables: list) -> bool:
        """Compiles the update of `variables` now, changing nothing: the
        program runs once with zero gradients and its `run` flag off.
        Returns whether it compiled (False where it was compiled already).

        Compiled inside the first training step instead, XLA's compiler
        works beside that step's activations, and the process keeps much of
        the memory it used there for the rest of training; compiled before
        it, that memory is reused by the step (the source tree's benchmarks
        measure both). Eager only.
        """
        import tensorflow as tf

        key = tuple(id(v) for v in variables)
        if key in self._functions:
            return False
        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        self(zeros, variables, run=False)
        return True

    def _function(self, variables: list | None) -> Any:
        import tensorflow as tf

        key = None if variables is None else tuple(id(v) for v in variables)
        function = self._functions.get(key)
        if function is None:
            optimizer = self._optimizer

            def update(grads, run):
                # `run` False leaves every variable as it is: the program
                # can be compiled ahead of training (`compile_ahead`).
                tf.cond(run, lambda: optimizer.apply(grads, variables), lambda: None)

            # The closure keeps `variables` alive, so their ids stay theirs.
            function = tf.function(update, jit_compile=True, reduce_retracing=True)
            self._functions[key] = function
        return function


def compile_ahead(optimizer: Any, variables: Any) -> bool:
    """Compiles the fused update of `variables` now, where `optimizer` (a
    `kmp.LossScaleOptimizer`) fuses it (its `fused_update`), before the
    first step that applies them. It builds the optimizer for them first,
    as its first `apply` would, and updates nothing. Eager only.

    `fit` calls it before the first step of Keras's own `train_step`.

    Returns:
        Whether it compiled: False where the update is not fused here, or
        was compiled already.
    """
    if keras.backend.backend() != "tensorflow":
        return False
    import tensorflow as tf

    variables = list(variables)
    if not (
        variables
        and tf.executing_eagerly()
        and resolve(optimizer.fused_update, optimizer.inner_optimizer, variables)
    ):
        return False
    if not optimizer.built:
        optimizer.build(variables)
    return optimizer._fused_apply.compile_ahead(variables)


def _dense_gradient(gradient: Any, variable: Any = None) -> Any:
    """A sparse gradient (`tf.IndexedSlices`) as the dense tensor Keras's
    own optimizers turn it into (rows summed per index), of `variable`'s
    static shape when given; any other gradient as it is."""
    import tensorflow as tf

    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    dense = tf.convert_to_tensor(gradient)
    if variable is not None and not tf.executing_eagerly():
        dense.set_shape(variable.shape)
    return dense
