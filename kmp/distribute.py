"""kmp under `tf.distribute`: one finite/non-finite decision for all replicas,
and a check that they agree.

A public module of kmp's: it only re-exports, from where each name lives.
"""

from kmp.backend.distribute import agree
from kmp.backend.distribute import in_multi_replica_context
from kmp.backend.distribute import step_if_finite
from kmp.diagnostics.replicas import ReplicaDivergenceError
from kmp.diagnostics.replicas import verify_replicas

__all__ = [
    "ReplicaDivergenceError",
    "agree",
    "in_multi_replica_context",
    "step_if_finite",
    "verify_replicas",
]
