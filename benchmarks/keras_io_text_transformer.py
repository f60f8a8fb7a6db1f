"""keras-io's "Text classification with Transformer" (Apoorv Nandan): its two
layers and its model as written there, registered for saving, and with
`**kwargs` passed on by the layers' constructors (which Keras needs to load
them from a file), so that a `.keras` file of it can be benchmarked against
plain Keras:

    cd benchmarks
    ../.venv/bin/python keras_io_text_transformer.py text_transformer.keras
    ../.venv/bin/kmp bench --model text_transformer.keras \\
        --import keras_io_text_transformer --keras --batch-size 64

tests/test_real_code.py trains the same model under kmp.compile.
"""

import sys

import keras
from keras import layers
from keras import ops

# --- keras-io: "Text classification with Transformer" (Apoorv Nandan), -------
# its two layers and its model exactly as written there.


@keras.saving.register_keras_serializable("keras_io")
class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [
                layers.Dense(ff_dim, activation="relu"),
                layers.Dense(embed_dim),
            ]
        )
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


@keras.saving.register_keras_serializable("keras_io")
class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def keras_io_text_transformer(vocab_size=20000, maxlen=200):
    embed_dim = 32  # Embedding size for each token
    num_heads = 2  # Number of attention heads
    ff_dim = 32  # Hidden layer size in feed forward network inside transformer

    inputs = layers.Input(shape=(maxlen,))
    embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim)
    x = embedding_layer(inputs)
    transformer_block = TransformerBlock(embed_dim, num_heads, ff_dim)
    x = transformer_block(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(0.1)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(0.1)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


if __name__ == "__main__":
    keras_io_text_transformer().save(
        sys.argv[1] if len(sys.argv) > 1 else "text_transformer.keras"
    )
