"""How kmp computes the scores of Keras's attention layers under 16-bit
policies: one process-wide mode (`kmp.rules.set_attention_scores`), read by
the plan."""

from __future__ import annotations

ATTENTION_MODES = ("auto", "float32", "compute")


_attention_mode = "auto"


def set_attention_scores(mode: str) -> None:
    """Sets how kmp computes the scores of Keras's attention layers
    (`MultiHeadAttention`, `GroupQueryAttention`) under 16-bit policies.

    * `'auto'` (default): `'float32'` under float16 (16-bit logits overflow
      to inf, then NaN), `'compute'` under bfloat16 (float32's range; the
      speed of Keras's own attention).
    * `'float32'`: the query and key projections, the scores and the softmax
      compute in float32; the value and output projections and dropout stay
      16-bit, so the layer still returns the compute dtype. (Where the layer
      hands its scores to your code, `return_attention_scores=True`, they
      keep their dtype: the softmax there stays 16-bit.) Under bfloat16
      this keeps the attention output within about 0.4% of float32 at any
      input scale (Keras's bfloat16 attention: 5% at scale 10, about 10% at 30),
      at the cost of two float32 projections.
    * `'compute'`: Keras's attention as it is, also under float16.

    Args:
        mode: `'auto'`, `'float32'` or `'compute'`.

    Raises:
        ValueError: for any other mode.

    Example:

    >>> kmp.rules.set_attention_scores("float32")
    >>> kmp.set_policy("mixed_bfloat16")
    <Policy "mixed_bfloat16": ...>
    >>> inputs = keras.Input((6, 16))
    >>> attention = keras.layers.MultiHeadAttention(2, 8)
    >>> outputs = keras.layers.Dense(2)(attention(inputs, inputs))
    >>> model = kmp.prepare(keras.Model(inputs, outputs))
    >>> attention.query_dense.compute_dtype, attention.value_dense.compute_dtype
    ('float32', 'bfloat16')
    >>> kmp.rules.set_attention_scores("auto")
    """
    global _attention_mode
    if mode not in ATTENTION_MODES:
        raise ValueError(
            f"Unknown attention scores mode {mode!r}. Expected one of "
            f"{', '.join(repr(m) for m in ATTENTION_MODES)}: 'float32' computes "
            "query/key projections, scores and softmax in float32; 'compute' "
            "leaves Keras's attention as it is; 'auto' picks 'float32' under "
            "float16 and 'compute' under bfloat16."
        )
    _attention_mode = mode


def attention_scores(compute_dtype: str | None = None) -> str:
    """The attention scores mode in force; with a compute dtype, what
    `'auto'` resolves to for it (`'float32'` or `'compute'`).

    Example:

    >>> from kmp.precision.attention import attention_scores
    >>> attention_scores(), attention_scores("float16")
    ('auto', 'float32')
    """
    if compute_dtype is None or _attention_mode != "auto":
        return _attention_mode
    return "float32" if compute_dtype == "float16" else "compute"
