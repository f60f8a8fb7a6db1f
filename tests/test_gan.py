"""keras-io's WGAN-GP (examples/generative/wgan_gp.py) run as written plus
kmp's two lines: a subclassed model with no call, its own `compile` with two
optimizers, a `train_step` with a nested `GradientTape` for the gradient
penalty and its own logs. Random data with Fashion-MNIST's shape; the
filters cut by 8 and a few steps, for speed."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras import layers

import kmp

IMG_SHAPE = (28, 28, 1)
NOISE_DIM = 128
WIDTH = 8  # keras-io's filters divided by this


def conv_block(x, filters, activation, kernel_size=(3, 3), strides=(1, 1),
               padding="same", use_bias=True, use_bn=False, use_dropout=False,
               drop_value=0.5):  # fmt: skip
    x = layers.Conv2D(
        filters, kernel_size, strides=strides, padding=padding, use_bias=use_bias
    )(x)
    if use_bn:
        x = layers.BatchNormalization()(x)
    x = activation(x)
    if use_dropout:
        x = layers.Dropout(drop_value)(x)
    return x


def get_discriminator_model():
    img_input = layers.Input(shape=IMG_SHAPE)
    x = layers.ZeroPadding2D((2, 2))(img_input)
    x = conv_block(x, 64 // WIDTH, kernel_size=(5, 5), strides=(2, 2),
                   use_bn=False, use_bias=True, activation=layers.LeakyReLU(0.2),
                   use_dropout=False, drop_value=0.3)  # fmt: skip
    x = conv_block(x, 128 // WIDTH, kernel_size=(5, 5), strides=(2, 2),
                   use_bn=False, activation=layers.LeakyReLU(0.2), use_bias=True,
                   use_dropout=True, drop_value=0.3)  # fmt: skip
    x = conv_block(x, 256 // WIDTH, kernel_size=(5, 5), strides=(2, 2),
                   use_bn=False, activation=layers.LeakyReLU(0.2), use_bias=True,
                   use_dropout=True, drop_value=0.3)  # fmt: skip
    x = conv_block(x, 512 // WIDTH, kernel_size=(5, 5), strides=(2, 2),
                   use_bn=False, activation=layers.LeakyReLU(0.2), use_bias=True,
                   use_dropout=False, drop_value=0.3)  # fmt: skip
    x = layers.Flatten()(x)
    x = layers.Dropout(0.2)(x)
    x = layers.Dense(1)(x)
    return keras.models.Model(img_input, x, name="discriminator")


def upsample_block(x, filters, activation, kernel_size=(3, 3), strides=(1, 1),
                   up_size=(2, 2), padding="same", use_bn=False, use_bias=True,
                   use_dropout=False, drop_value=0.3):  # fmt: skip
    x = layers.UpSampling2D(up_size)(x)
    x = layers.Conv2D(
        filters, kernel_size, strides=strides, padding=padding, use_bias=use_bias
    )(x)
    if use_bn:
        x = layers.BatchNormalization()(x)
    if activation:
        x = activation(x)
    if use_dropout:
        x = layers.Dropout(drop_value)(x)
    return x


def get_generator_model():
    noise = layers.Input(shape=(NOISE_DIM,))
    x = layers.Dense(4 * 4 * 256 // WIDTH, use_bias=False)(noise)
    x = layers.BatchNormalization()(x)
    x = layers.LeakyReLU(0.2)(x)
    x = layers.Reshape((4, 4, 256 // WIDTH))(x)
    x = upsample_block(x, 128 // WIDTH, layers.LeakyReLU(0.2), strides=(1, 1),
                       use_bias=False, use_bn=True, padding="same",
                       use_dropout=False)  # fmt: skip
    x = upsample_block(x, 64 // WIDTH, layers.LeakyReLU(0.2), strides=(1, 1),
                       use_bias=False, use_bn=True, padding="same",
                       use_dropout=False)  # fmt: skip
    x = upsample_block(
        x, 1, layers.Activation("tanh"), strides=(1, 1), use_bias=False, use_bn=True
    )
    x = layers.Cropping2D((2, 2))(x)
    return keras.models.Model(noise, x, name="generator")


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim,
                 discriminator_extra_steps=3, gp_weight=10.0):  # fmt: skip
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        alpha = tf.random.normal([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff
        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            pred = self.discriminator(interpolated, training=True)
        grads = gp_tape.gradient(pred, [interpolated])[0]
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        gp = tf.reduce_mean((norm - 1.0) ** 2)
        return gp

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]
        batch_size = tf.shape(real_images)[0]
        for i in range(self.d_steps):  # noqa: B007 (keras-io's code)
            random_latent_vectors = tf.random.normal(
                shape=(batch_size, self.latent_dim)
            )
            with tf.GradientTape() as tape:
                fake_images = self.generator(random_latent_vectors, training=True)
                fake_logits = self.discriminator(fake_images, training=True)
                real_logits = self.discriminator(real_images, training=True)
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                d_loss = d_cost + gp * self.gp_weight
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables)  # noqa: B905
            )
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            generated_images = self.generator(random_latent_vectors, training=True)
            gen_img_logits = self.discriminator(generated_images, training=True)
            g_loss = self.g_loss_fn(gen_img_logits)
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        self.g_optimizer.apply_gradients(
            zip(gen_gradient, self.generator.trainable_variables)  # noqa: B905
        )
        return {"d_loss": d_loss, "g_loss": g_loss}


def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


@functools.cache
def float32_reference():
    return train_wgan("float32")[1]


def train_wgan(policy):
    keras.utils.set_random_seed(0)
    kmp.set_policy(policy)
    wgan = WGAN(
        discriminator=get_discriminator_model(),
        generator=get_generator_model(),
        latent_dim=NOISE_DIM,
        discriminator_extra_steps=3,
    )
    kmp.compile(
        wgan,
        d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
        g_loss_fn=generator_loss,
        d_loss_fn=discriminator_loss,
    )
    images = np.random.RandomState(0).randint(0, 256, (64, 28, 28)).astype("uint8")
    images = (images.reshape(-1, *IMG_SHAPE).astype("float32") - 127.5) / 127.5
    history = wgan.fit(images, batch_size=32, epochs=2, verbose=0)
    return wgan, history.history


@pytest.mark.slow
@pytest.mark.xdist_group("wgan")  # one worker trains the float32 reference once
@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_io_wgan_gp_trains_as_written_like_float32(policy):
    reference = float32_reference()
    with (
        pytest.warns(UserWarning, match="never scaled")
        if policy == ("mixed_float16")
        else _nothing()
    ):
        wgan, logs = train_wgan(policy)
    # The generator's and the discriminator's outputs reach the train_step
    # (fake_images - real_images) and the loss functions in float32.
    assert wgan.generator.layers[-1].compute_dtype == "float32"
    assert wgan.discriminator.layers[-1].compute_dtype == "float32"
    for key in ("d_loss", "g_loss"):
        # Within a tenth of the size of float32's losses, step by step.
        size = float(np.max(np.abs(reference[key])))
        np.testing.assert_allclose(logs[key], reference[key], atol=0.1 * size)
    # Both optimizers' telemetry, added to the train_step's own dict.
    prefix = ["d_optimizer_", "g_optimizer_"]
    for p in prefix:
        assert logs[f"{p}skipped_steps"][-1] == 0
        assert (f"{p}loss_scale" in logs) == (policy == "mixed_float16")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
