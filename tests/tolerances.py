"""One per-dtype tolerance table for the whole suite.

Relative error bounds, as max|y - reference| / max|reference|, for results
computed in the given dtype against a float32 reference. float16 has a 10-bit
mantissa (eps ~ 1e-3), bfloat16 a 7-bit one (eps ~ 8e-3); the bounds leave
room for a few roundings.
"""

import numpy as np

RELATIVE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}


def relative_error(y, reference) -> float:
    y = np.asarray(y, dtype="float32")
    reference = np.asarray(reference, dtype="float32")
    return float(np.max(np.abs(y - reference)) / np.max(np.abs(reference)))
