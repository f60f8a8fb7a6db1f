"""Where kmp meets the user's training code: `kmp.compile`, the train function,
`kmp.telemetry.attach`, the scaled gradient tape, and tf.keras 2's mixed-
precision surface."""
