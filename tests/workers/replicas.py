"""Worker: models and workflows users write, trained on every rank; each case saves this rank's
weights and optimizer variables (as raw bits) for the test to compare across ranks.

argv[1:]: the cases, run one after another in this one launch (a launch costs more than a case):

* ``text-<algorithm>-<adam|sgd>``: Embedding(5000, 32) -> pooling -> Dense, 4 classes, under
  SparseStrategy at density 0.01 (the model of the regression: Adam wrote into the result
  vectors that the exchange refilled);
* ``transformer-<float32|mixed_bfloat16>``: Embedding + MultiHeadAttention + LayerNormalization,
  AdamW with a cosine-decay schedule and clipnorm, top-k (over a bfloat16 wire under
  mixed_bfloat16);
* ``finetune-<strategy|optimizer>``: the Keras guide's transfer learning on MobileNetV2 (no
  weights): frozen base, compile, fit; base unfrozen, compile again with a small learning rate,
  fit -- under SparseStrategy, or through a new DistributedOptimizer per compile;
* ``refit-<strategy|optimizer>[-2]``: a model whose trainable set changes between fits (a layer
  frozen, then unfrozen) and a second fit with another optimizer (``-2``: Pipe-SGD's pipeline=2);
* ``unused-<strategy|optimizer>``: a model with a head the loss never reaches (its variables' gradients
  are None), Adam over gTop-k (``<case>_info``: Keras' warning seen, the head's weights unchanged under
  SparseStrategy, the losses);
* ``gan-<strategy|optimizer>``: a generator and a discriminator, each with its own optimizer, in
  one custom ``train_step`` under SparseStrategy (or each a DistributedOptimizer);
* ``diverge-<strategy|optimizer>[-validation]``: rank 1 alone nudges a weight during the first
  epoch (``-validation``: the second, with validation data of another length); the replica check
  must raise on every rank (saved: the message, the epoch that had begun and its batches ended);
* ``optimizers-<strategy|optimizer>``: the text classifier under eight more Keras optimizers
  -- Lion, Adafactor, Muon, ScheduleFreeAdamW, Adam with an EMA of the weights, Adam
  accumulating gradients over two steps, RMSprop with momentum, Nadam -- each over a sparse
  algorithm in turn (topk, gtopk, oktopk), one fit each (the bits of all of them, concatenated;
  ``<case>_info``: the optimizers this Keras lacks);
* ``auto-<strategy|optimizer>-<measured|candidate>``: the text classifier with SGD and momentum
  under ``algorithm="auto"``: the choice measured, or the named candidate forced in place of the
  measured one (the measurement's collectives still run), so that the switch from the measured
  rounds to a sparse algorithm mid-epoch is exercised (saved as well: ``<case>_info``, the choice,
  the settings run and the lines printed).
"""
import contextlib
import io
import sys

import numpy as np
import keras
import tensorflow as tf

import tfsparse
from mpi_harness import save_result

tfsparse.init(backend="mpi")
rank = tfsparse.rank()
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def bits(model, *optimizers) -> np.ndarray:
    """Every weight of ``model`` and every variable of ``optimizers``, as uint32 bits (float32
    values; float16/bfloat16 widened exactly)."""
    parts = [v.numpy() for v in model.weights]
    for opt in optimizers:
        parts += [v.numpy() for v in opt.variables]
    return np.concatenate([np.asarray(p, np.float32).reshape(-1).view(np.uint32) for p in parts])


def text_data(n=512, seq=20):
    rng = np.random.default_rng(100 + rank)
    return rng.integers(0, 5000, (n, seq)).astype(np.int32), rng.integers(0, 4, n)


def text_model(dim):
    """The text classifier: Embedding(5000, ``dim``) -> pooling -> Dense, 4 classes."""
    return keras.Sequential([keras.Input((20,), dtype="int32"), keras.layers.Embedding(5000, dim),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(4)])


def text_case(algorithm, opt_name):
    x, y = text_data()
    keras.utils.set_random_seed(rank)  # different initial weights: the strategy starts them from rank 0
    with tfsparse.SparseStrategy(algorithm, 1.0 if algorithm == "dense" else 0.01):
        model = text_model(32)
        opt = keras.optimizers.Adam(1e-3) if opt_name == "adam" else keras.optimizers.SGD(0.1)
        model.compile(opt, LOSS)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    return bits(model, model.optimizer)


def transformer(seq=16, vocab=2000, dim=32):
    tokens = keras.Input((seq,), dtype="int32")
    h = keras.layers.Embedding(vocab, dim)(tokens)
    a = keras.layers.MultiHeadAttention(num_heads=2, key_dim=16)(h, h)
    h = keras.layers.LayerNormalization()(h + a)
    f = keras.layers.Dense(dim)(keras.layers.Dense(64, activation="relu")(h))
    h = keras.layers.LayerNormalization()(h + f)
    out = keras.layers.Dense(4, dtype="float32")(keras.layers.GlobalAveragePooling1D()(h))
    return keras.Model(tokens, out)


def transformer_case(precision):
    rng = np.random.default_rng(200 + rank)
    x, y = rng.integers(0, 2000, (192, 16)).astype(np.int32), rng.integers(0, 4, 192)
    keras.mixed_precision.set_global_policy(precision)
    try:
        wire = "bfloat16" if precision == "mixed_bfloat16" else "float32"
        with tfsparse.SparseStrategy("topk", 0.01, wire_dtype=wire):
            model = transformer()
            lr = keras.optimizers.schedules.CosineDecay(1e-3, decay_steps=40)
            model.compile(keras.optimizers.AdamW(lr, clipnorm=1.0), LOSS)
        model.fit(x, y, batch_size=32, epochs=2, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return bits(model, model.optimizer)


def image_data(n=48):
    rng = np.random.default_rng(300 + rank)
    return rng.random((n, 32, 32, 3), dtype=np.float32), rng.integers(0, 10, n)


def finetune_case(route):
    """keras.io's transfer-learning guide, with a base of random weights (nothing downloads)."""
    x, y = image_data()
    keras.utils.set_random_seed(7)

    def compile_with(model, optimizer):
        if route == "optimizer":
            optimizer = tfsparse.keras.DistributedOptimizer(optimizer, "topk", 0.01)
        model.compile(optimizer, LOSS)

    strategy = tfsparse.SparseStrategy("topk", 0.01) if route == "strategy" else None
    with strategy.scope() if strategy else _nothing():
        base = keras.applications.MobileNetV2(input_shape=(32, 32, 3), include_top=False, weights=None, alpha=0.35)
        base.trainable = False
        inputs = keras.Input((32, 32, 3))
        h = base(inputs, training=False)
        h = keras.layers.GlobalAveragePooling2D()(h)
        model = keras.Model(inputs, keras.layers.Dense(10)(h))
        compile_with(model, keras.optimizers.Adam(1e-3))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    base.trainable = True
    with strategy.scope() if strategy else _nothing():
        compile_with(model, keras.optimizers.Adam(1e-5))
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return bits(model, model.optimizer)


def refit_case(route, pipeline="1"):
    """Freeze a layer, fit; unfreeze it, fit with another optimizer (SGD, then Adam)."""
    rng = np.random.default_rng(400 + rank)
    x, y = rng.random((96, 12), dtype=np.float32), rng.integers(0, 3, 96)
    keras.utils.set_random_seed(8)

    def opt(inner):
        return tfsparse.keras.DistributedOptimizer(inner, "gtopk", 0.05, pipeline=int(pipeline)) \
            if route == "optimizer" else inner

    strategy = tfsparse.SparseStrategy("gtopk", 0.05, pipeline=int(pipeline)) if route == "strategy" else None
    with strategy.scope() if strategy else _nothing():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        model.compile(opt(keras.optimizers.SGD(0.05)), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ran = [model.optimizer.exchange if strategy is None else strategy.exchange]
    model.layers[0].trainable = False
    with strategy.scope() if strategy else _nothing():
        model.compile(opt(keras.optimizers.SGD(0.05, momentum=0.9)), LOSS)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ran.append(model.optimizer.exchange if strategy is None else strategy.exchange)
    model.layers[0].trainable = True
    with strategy.scope() if strategy else _nothing():
        model.compile(opt(keras.optimizers.Adam(1e-3)), LOSS)  # often born in the first SGD's memory
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    ran.append(model.optimizer.exchange if strategy is None else strategy.exchange)
    distinct = len({id(e) for e in ran})  # (ran holds them: their ids are their own)
    if distinct != 3:
        raise AssertionError(f"the three fits ran {distinct} exchanges, not one each")
    return bits(model, model.optimizer)


#: (name, arguments): Keras optimizers beside Adam and SGD; one the installed Keras lacks
#: (ScheduleFreeAdamW and Muon are recent) is left out and named in the result
OPTIMIZERS = (("Lion", dict(learning_rate=1e-4)), ("Adafactor", dict(learning_rate=1e-2)),
              ("Muon", dict(learning_rate=1e-3)), ("ScheduleFreeAdamW", dict(learning_rate=1e-3)),
              ("Adam", dict(learning_rate=1e-3, use_ema=True, ema_overwrite_frequency=5)),
              ("Adam", dict(learning_rate=1e-3, gradient_accumulation_steps=2)),
              ("RMSprop", dict(learning_rate=1e-3, momentum=0.5)), ("Nadam", dict(learning_rate=1e-3)))


def optimizers_case(route):
    """Each of :data:`OPTIMIZERS` trains the text classifier for one epoch (an optimizer's own
    state -- Lion's sign, Adafactor's factored moments, Muon's orthogonalised update, the EMA and
    the accumulators -- is computed by every rank from the exchanged gradient alone)."""
    x, y = text_data(256)
    parts, missing = [], []
    for i, (name, kwargs) in enumerate(OPTIMIZERS):
        if not hasattr(keras.optimizers, name):
            missing.append(name)
            continue
        make = lambda: getattr(keras.optimizers, name)(**kwargs)  # noqa: E731
        algorithm = ("topk", "gtopk", "oktopk")[i % 3]
        keras.utils.set_random_seed(rank)
        if route == "strategy":
            with tfsparse.SparseStrategy(algorithm, 0.01):
                model = text_model(16)
                model.compile(make(), LOSS)
            callbacks = []
        else:
            model = text_model(16)
            model.compile(tfsparse.keras.DistributedOptimizer(make(), algorithm, 0.01), LOSS)
            callbacks = [tfsparse.keras.callbacks.BroadcastInitialState()]
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=callbacks)
        parts.append(bits(model, model.optimizer))
    return np.concatenate(parts), {"missing": missing}


class TwoHeads(keras.Model):
    """The text classifier with a second head that the loss never reaches: its kernel and bias get no
    gradient (None), as in a multi-task model trained on one task."""

    def __init__(self):
        super().__init__()
        self.body = text_model(16)
        self.spare = keras.layers.Dense(3, name="spare_head")

    def call(self, x):
        logits = self.body(x)
        self.spare(logits)  # built and called, but not in the output: no gradient reaches it
        return logits


def unused_case(route):
    """A model of which two variables get no gradient (None): Keras skips them with a warning; they
    are not exchanged, stay as rank 0 started them, and the rest trains identically (Adam, gTop-k)."""
    x, y = text_data(256)
    keras.utils.set_random_seed(rank)
    strategy = tfsparse.SparseStrategy("gtopk", 0.01) if route == "strategy" else None
    with strategy.scope() if strategy else _nothing():
        model = TwoHeads()
        model(x[:1])
        opt = keras.optimizers.Adam(1e-3)
        model.compile(opt if strategy else tfsparse.keras.DistributedOptimizer(opt, "gtopk", 0.01), LOSS)
    start = [v.numpy().copy() for v in model.spare.weights]
    callbacks = [] if strategy else [tfsparse.keras.callbacks.BroadcastInitialState()]
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hist = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=callbacks)
    kept = all(np.array_equal(a, v.numpy()) for a, v in zip(start, model.spare.weights)) if strategy else None
    warned = any("Gradients do not exist for variables" in str(w.message) and "spare_head" in str(w.message)
                 for w in caught)
    return bits(model, model.optimizer), {"warned": warned, "spare_kept": kept,
                                          "loss": [float(v) for v in hist.history["loss"]]}


class GAN(keras.Model):
    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator

    def call(self, x):
        return self.discriminator(x)

    def compile(self, g_opt, d_opt):
        super().compile()
        self.g_opt, self.d_opt = g_opt, d_opt
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True, reduction="sum")

    def train_step(self, real):
        batch = tf.shape(real)[0]
        scale = 1.0 / (tf.cast(batch, tf.float32) * tf.distribute.get_strategy().num_replicas_in_sync)
        noise = tf.random.stateless_normal((batch, 8), seed=[1, 2])
        with tf.GradientTape() as tape:
            fake = self.generator(noise)
            logits = tf.concat([self.discriminator(real), self.discriminator(fake)], 0)
            labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], 0)
            d_loss = self.bce(labels, logits) * scale
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_opt.apply_gradients(zip(grads, self.discriminator.trainable_weights))
        with tf.GradientTape() as tape:
            g_loss = self.bce(tf.ones((batch, 1)), self.discriminator(self.generator(noise))) * scale
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_opt.apply_gradients(zip(grads, self.generator.trainable_weights))
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan_case(route):
    rng = np.random.default_rng(500 + rank)
    real = rng.standard_normal((64, 6)).astype(np.float32)
    keras.utils.set_random_seed(9)

    def opt():
        inner = keras.optimizers.Adam(1e-3)
        return tfsparse.keras.DistributedOptimizer(inner, "topk", 0.1) if route == "optimizer" else inner

    strategy = tfsparse.SparseStrategy("topk", 0.1) if route == "strategy" else None
    with strategy.scope() if strategy else _nothing():
        generator = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(6)])
        discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                          keras.layers.Dense(1)])
        gan = GAN(generator, discriminator)
        gan.compile(opt(), opt())
    gan.fit(real, batch_size=16, epochs=2, verbose=0)
    return np.concatenate([bits(generator, gan.g_opt), bits(discriminator, gan.d_opt)])


class Nudge(keras.callbacks.Callback):
    """Rank 1 adds 1e-3 to the last layer's bias after the third batch of epoch ``epoch`` (a
    divergence no exchange made); records the epochs begun and the batches ended in the last."""

    def __init__(self, epoch=1):
        super().__init__()
        self.epoch, self.epochs, self.batches = epoch, 0, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs, self.batches = epoch + 1, 0

    def on_train_batch_end(self, batch, logs=None):
        self.batches = batch + 1
        if rank == 1 and self.epochs == self.epoch and batch == 2:
            bias = self.model.layers[-1].bias
            bias.assign(bias + 1e-3)


def diverge_case(route, validation=None):
    """``validation``: validation data of 5 batches beside the 16 training batches, and the nudge
    in the second epoch, after the first validation (the check must still run at the epoch's end,
    not every 5 batches)."""
    x, y = text_data()
    nudge = Nudge(2 if validation else 1)
    extra = {"validation_data": text_data(160)} if validation else {}
    if route == "strategy":
        with tfsparse.SparseStrategy("topk", 0.01):
            model = text_model(8)
            model.compile(keras.optimizers.SGD(0.1), LOSS)
    else:
        model = text_model(8)
        model.compile(tfsparse.keras.DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.01), LOSS)
    try:
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[nudge], **extra)
    except Exception as e:  # noqa: BLE001  (what reaches the caller: its type and text are the result)
        caught = f"{type(e).__name__}: {e}"
    else:
        caught = None
    sync = getattr(tfsparse.keras.ownership.exchange_of(model), "sync_points", None)
    return {"caught": caught, "epochs": nudge.epochs, "batches": nudge.batches, "sync_steps": sync and sync[1]}


def auto_case(route, choice):
    from tfsparse import auto

    x, y = text_data()
    real = auto.decide
    if choice != "measured":
        forced = next(i for i, c in enumerate(auto.CANDIDATES) if c.algorithm == choice)

        def decide(*args, **kwargs):
            d = real(*args, **kwargs)
            return auto.Decision(forced, d.compute_s, d.link, d.predictions)
        auto.decide = decide
    keras.utils.set_random_seed(rank)
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            if route == "strategy":
                with tfsparse.SparseStrategy("auto"):
                    model = text_model(16)
                    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
                    model.compile(sgd, LOSS)
            else:
                model = text_model(16)
                model.compile(tfsparse.keras.DistributedOptimizer(sgd, "auto"), LOSS)
            hist = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                             callbacks=[tfsparse.keras.callbacks.CommunicationStats()])
    finally:
        auto.decide = real
    ex = tfsparse.keras.ownership.exchange_of(model)
    info = {"choice": None if ex.auto_choice is None else ex.auto_choice.algorithm, "settings": ex.settings.config(),
            "printed": [line for line in printed.getvalue().splitlines()
                        if "algorithm='auto' chose" in line or "algorithm='auto' kept" in line],
            "density": hist.history["density"], "comm_bytes": hist.history["comm_bytes"],
            "velocity": bool(ex.get_state()["velocity"].any()),
            "sgd_momentum": [float(sgd.momentum), bool(any(np.any(m.numpy()) for m in sgd.momentums))]}
    return bits(model, model.optimizer), info


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def run(case: str) -> np.ndarray:
    kind, *args = case.split("-")
    return {"text": text_case, "transformer": transformer_case, "finetune": finetune_case,
            "refit": refit_case, "optimizers": optimizers_case, "unused": unused_case, "gan": gan_case, "diverge": diverge_case, "auto": auto_case}[kind](*args)


results = {}
for case in sys.argv[1:]:
    out = run(case)
    if isinstance(out, tuple):
        results[case.replace("-", "_")], results[case.replace("-", "_") + "_info"] = out
    else:
        results[case.replace("-", "_")] = out
save_result(rank, **results)
