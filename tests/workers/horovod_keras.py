"""tfsparse.horovod.tensorflow.keras on real ranks, scripts written as Horovod's Keras examples
write them: model.fit with DistributedOptimizer and the four callbacks (each rank starting from
its own weights), each step's update against the numpy mean (or sum) of the ranks' own
gradients, accumulation over backward passes, fp16 compression, the learning-rate callbacks'
rates and momentum correction, a sparse algorithm one keyword away, a variable kept local (a
BatchNormalization statistic too), and the errors; for tests/test_horovod_api_mpi.py.  Launched by
mpirun or horovodrun."""
import warnings

import numpy as np
import keras
import tensorflow as tf

import tfsparse.horovod.tensorflow as hvd_tf
import tfsparse.horovod.tensorflow.keras as hvd
from mpi_harness import error_of, save_result

hvd.init()
r, P = hvd.rank(), hvd.size()
VOCAB, LEN, CLASSES = 40, 6, 3


def data(seed, n):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, LEN)).astype(np.int32)
    return tokens, (tokens[:, 0] % CLASSES).astype(np.int32)


def build(seed):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((LEN,), dtype="int32"), keras.layers.Embedding(VOCAB, 8),
                             keras.layers.Flatten(), keras.layers.Dense(24, activation="relu"),
                             keras.layers.Dense(CLASSES)])


lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def flat(variables):
    return np.concatenate([np.asarray(v.numpy(), np.float64).reshape(-1) for v in variables
                           if "float" in str(v.dtype)])


def everyones_mean(vector):
    """The mean over the ranks of each rank's own vector (float64, exact reference)."""
    return hvd.allgather(tf.constant(np.asarray(vector, np.float64)[None, :])).numpy().mean(0)


class Record(keras.callbacks.Callback):
    """The learning rate and SGD velocity at each batch's start, and the epoch logs, as this
    callback sees them (placed before or after the callbacks under test)."""

    def __init__(self):
        super().__init__()
        self.lrs, self.velocity, self.logs = [], [], []

    def on_train_batch_begin(self, batch, logs=None):
        opt = self.model.optimizer
        self.lrs.append(float(keras.ops.convert_to_numpy(opt.learning_rate)))
        inner = opt.inner_optimizer
        self.velocity.append(flat(inner.momentums) if getattr(inner, "momentums", None) else None)

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append({k: float(v) for k, v in sorted(logs.items())})


# 1. Horovod's Keras example: Adam at lr * size, the four callbacks, every rank its own initial
#    weights (the broadcast after the first batch makes them rank 0's)
tokens, labels = data(r, 256)
dataset = tf.data.Dataset.from_tensor_slices((tokens, labels)).repeat().shuffle(256, seed=r).batch(16)
model = build(10 + r)
scaled_lr = 0.005 * hvd.size()
opt = hvd.DistributedOptimizer(keras.optimizers.Adam(scaled_lr))
model.compile(loss=lossf, optimizer=opt, metrics=["accuracy"])
own, seen = Record(), Record()
WARMUP, STEPS, EPOCHS = 2, 8, 5
callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), own, hvd.callbacks.MetricAverageCallback(),
             hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=WARMUP, verbose=1), seen]
history = model.fit(dataset, steps_per_epoch=STEPS, epochs=EPOCHS, callbacks=callbacks, verbose=0).history
fit_weights = flat(model.variables + opt.variables)
own_logs = np.array([[e["loss"], e["accuracy"]] for e in own.logs])
averaged = everyones_mean(own_logs.reshape(-1)).reshape(own_logs.shape)
metric_error = float(np.max(np.abs(np.array([history["loss"], history["accuracy"]]).T - averaged)))
expected_lr = [scaled_lr / P * ((min(e + (b + 1) / STEPS, WARMUP)) * (P - 1) / WARMUP + 1)
               for e in range(EPOCHS) for b in range(STEPS)]  # Horovod's rule; after the warm-up: the last
lr_error = float(np.max(np.abs(np.array(seen.lrs) - np.array(expected_lr)) / scaled_lr))


# 2. one step through fit's train function against the numpy reference: identical initial
#    weights, each rank its own batch, SGD without momentum
def one_update(batches, passes=1, lr=0.5, **kwargs):
    net = build(7)
    o = hvd.DistributedOptimizer(keras.optimizers.SGD(lr), backward_passes_per_step=passes, **kwargs)
    net.compile(loss=lossf, optimizer=o)
    w0 = flat(net.trainable_variables)
    own_sum, unchanged = 0.0, True
    for i, (xb, yb) in enumerate(batches):
        with tf.GradientTape() as tape:
            loss_value = lossf(yb, net(xb, training=True))
        own_sum = own_sum + np.concatenate([np.asarray(tf.convert_to_tensor(g), np.float64).reshape(-1)
                                            for g in tape.gradient(loss_value, net.trainable_variables)])
        net.train_on_batch(xb, yb)
        if i < len(batches) - 1:
            unchanged = unchanged and np.array_equal(flat(net.trainable_variables), w0)
    step = (w0 - flat(net.trainable_variables)) / lr
    return step, own_sum, unchanged, int(o.iterations.numpy())


def relative(got, want):
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


xb, yb = data(100 + r, 16)
xb2, yb2 = data(200 + r, 16)
step, own_g, _, _ = one_update([(xb, yb)])
updates = {"average": relative(step, everyones_mean(own_g))}
step, own_g, _, _ = one_update([(xb, yb)], op=hvd.Sum)
updates["sum"] = relative(step, everyones_mean(own_g) * P)
step, own_g, _, _ = one_update([(xb, yb)], gradient_predivide_factor=4.0)
updates["predivide"] = relative(step, everyones_mean(own_g))
step, own_g, _, _ = one_update([(xb, yb)], compression=hvd.Compression.fp16)
updates["fp16"] = relative(step, everyones_mean(own_g))
step, own_g, unchanged, iterations = one_update([(xb, yb), (xb2, yb2)], passes=2)
updates["passes"] = relative(step, everyones_mean(own_g))  # Horovod's default: the passes summed
step, own_g, unchanged2, iterations2 = one_update([(xb, yb), (xb2, yb2)], passes=2, average_aggregated_gradients=True)
updates["passes averaged"] = relative(step, everyones_mean(own_g) / 2)
passes = [unchanged, iterations, unchanged2, iterations2]

# accumulation with a variable the loss does not reach (its gradient None in every pass): it is left out
# as Horovod leaves it, and the other is accumulated over both passes and exchanged once
used, spare = keras.Variable(np.zeros(3, np.float32)), keras.Variable(np.ones(2, np.float32))
opt3 = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), backward_passes_per_step=2)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # Keras' "Gradients do not exist for variables"
    opt3.apply([tf.constant(np.full(3, r + 1.0, np.float32)), None], [used, spare])
    after_one = used.numpy().tolist()
    opt3.apply([tf.constant(np.full(3, 2.0 * (r + 1), np.float32)), None], [used, spare])
accumulate_none = [after_one, used.numpy().tolist(), spare.numpy().tolist()]

# accumulation through fit: the broadcast after batch 0 leaves each rank's own partial sum, and a
# window still open at the end (3 batches, 2 passes each) is no divergence at fit's replica check
net = build(7)
opt2 = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), backward_passes_per_step=2)
net.compile(loss=lossf, optimizer=opt2)
w0 = flat(net.trainable_variables)
own_g = 0.0
for xb_, yb_ in ((xb, yb), (xb2, yb2)):
    with tf.GradientTape() as tape:
        loss_value = lossf(yb_, net(xb_, training=True))
    own_g = own_g + np.concatenate([np.asarray(tf.convert_to_tensor(g), np.float64).reshape(-1)
                                    for g in tape.gradient(loss_value, net.trainable_variables)])
xb3, yb3 = data(300 + r, 16)
net.fit(np.concatenate([xb, xb2, xb3]), np.concatenate([yb, yb2, yb3]), batch_size=16, shuffle=False, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
updates["passes in fit"] = relative((w0 - flat(net.trainable_variables)) / 0.5, everyones_mean(own_g))

# 3. the schedule callback (staircase, a constant multiplier) with momentum correction, through
#    horovod.tensorflow's DistributedOptimizer (the same wrapper), everyone from one seed
net = build(3)
sgd = hvd_tf.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
net.compile(loss=lossf, optimizer=sgd)
before, after = Record(), Record()
net.fit(dataset, steps_per_epoch=2, epochs=4, verbose=0,
        callbacks=[before, hvd.callbacks.LearningRateScheduleCallback(0.1, multiplier=0.5, start_epoch=1,
                                                                      end_epoch=3), after])
schedule_lrs = after.lrs
# at epoch 2's first batch the rate halves and the velocity with it (Horovod's momentum correction)
correction = relative(after.velocity[4], before.velocity[4] * 0.5)
schedule_weights = flat(net.variables + sgd.variables)

# 4. a tfsparse algorithm one keyword away
net = build(20 + r)
sparse_opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.5, momentum=0.9), algorithm="gtopk", density=0.1)
net.compile(loss=lossf, optimizer=sparse_opt)
sparse_losses = net.fit(dataset, steps_per_epoch=STEPS, epochs=4, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback()]).history["loss"]
sparse_weights = flat(net.variables)

# 5. local_variables: the (frozen) output layer's kernel stays each rank's own -- not broadcast, and
#    left out of the replica check at fit's end (the rest identical on every rank)
net = build(30 + r)
net.layers[-1].trainable = False  # DistributedOptimizer starts every rank from rank 0's trainable ones
net.compile(loss=lossf, optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
head = net.layers[-1].kernel
net.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=head)])
local_head, local_rest = flat([head]), flat([v for v in net.weights if v is not head])

# 6. a BatchNormalization's moving mean kept local: fit's end averages the moving variance over
#    the ranks (each rank's from its own batches) but leaves the local moving mean each rank's own
keras.utils.set_random_seed(40)
net = keras.Sequential([keras.Input((LEN,), dtype="int32"), keras.layers.Embedding(VOCAB, 8), keras.layers.Flatten(),
                        keras.layers.BatchNormalization(), keras.layers.Dense(CLASSES)])
net.compile(loss=lossf, optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)))
bn = net.layers[2]
net.fit(dataset, steps_per_epoch=2, epochs=1, verbose=0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0, local_variables=[bn.moving_mean])])
local_mean, averaged_variance = flat([bn.moving_mean]), flat([bn.moving_variance])


sgd = keras.optimizers.SGD(0.1)
errors = {
    "op": error_of(lambda: hvd.DistributedOptimizer(sgd, op=hvd_tf.Min)),
    "passes": error_of(lambda: hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)),
    "predivide": error_of(lambda: hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)),
    "v1": error_of(lambda: hvd_tf.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1))),
    "missing": error_of(lambda: hvd.callbacks.BestModelCheckpoint),
    "load_model": error_of(lambda: hvd.load_model),
}
save_result(r, accumulate_none=accumulate_none, history=history, fit_weights=fit_weights, metric_error=metric_error,
            lr_error=lr_error,
            lrs=seen.lrs, updates=updates, passes=passes, schedule_lrs=schedule_lrs, correction=correction,
            schedule_weights=schedule_weights, sparse_losses=sparse_losses, sparse_weights=sparse_weights,
            local_head=local_head, local_rest=local_rest, local_mean=local_mean,
            averaged_variance=averaged_variance,
            errors=errors, name=type(opt).__name__, backend=__import__("tfsparse").runtime.backend())
