"""Every private attribute of Keras, KerasHub and TensorFlow that kmp reads,
one module per library, where no public API gives the same.

Each accessor fails closed: where the installed version no longer has what
it reads, it raises `InternalsChanged` naming the attribute and the version,
never a default that silently changes what kmp does. `tests/test_internals.py`
checks every one of them against the installed versions.
"""
