"""tfsparse.horovod.tensorflow's process queries and collectives on real ranks, each against
its numpy reference (every rank knows what every rank holds), eagerly, inside a tf.function
and through their gradients; its errors; for tests/test_horovod_api_mpi.py.  Launched by
mpirun or horovodrun."""
import functools
import operator

import numpy as np
import keras
import tensorflow as tf

import tfsparse.horovod.tensorflow as hvd
from mpi_harness import error_of, save_result

failures = []


def check(name, got, want):
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        failures.append(f"{name}: got {got.dtype}{list(got.shape)} {got.tolist()}, want {want.dtype}{list(want.shape)} "
                        f"{want.tolist()}")


before_init = error_of(hvd.rank)
hvd.init()
hvd.init()  # idempotent
r, P = hvd.rank(), hvd.size()
queries = [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size(),
           hvd.is_initialized()]
# Horovod's questions about the build and the job
built = {name: getattr(hvd, name)() for name in ("is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built",
                                                  "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
                                                  "rocm_built")}
built["cuda_built"] = type(hvd.cuda_built()).__name__
# Python objects: rank 1's dict everywhere (a lambda inside where cloudpickle is installed, as with
# Horovod; else a partial, which the standard pickle takes); every rank's, in rank order
try:
    import cloudpickle  # noqa: F401
    scale = lambda v, k=r + 2: v * k  # noqa: E731
except ImportError:
    scale = functools.partial(operator.mul, r + 2)
sent = hvd.broadcast_object({"epoch": 7 + r, "scale": scale} if r == 1 else None, root_rank=1)
objects = {"broadcast": [sent["epoch"], sent["scale"](10)],
           "gathered": hvd.allgather_object({"rank": r, "rows": list(range(r + 1))}),
           "in_function": error_of(lambda: tf.function(lambda: hvd.broadcast_object(1) or tf.constant(0))())}


def data(q, dtype=np.float32):
    """Rank q's tensor: integer-valued, so every sum and mean below is exact in float32."""
    return (np.arange(6).reshape(2, 3) * (q + 1) + 4 * q).astype(dtype)


everyone = np.stack([data(q) for q in range(P)])
mine = tf.constant(data(r))

# allreduce, eagerly: every op, Horovod's default (Average), average=False, the scale factors
check("average", hvd.allreduce(mine), (everyone.sum(0) / np.float32(P)).astype(np.float32))
check("sum", hvd.allreduce(mine, op=hvd.Sum), everyone.sum(0))
check("average=False", hvd.allreduce(mine, average=False), everyone.sum(0))
check("min", hvd.allreduce(mine, op=hvd.Min), everyone.min(0))
check("max", hvd.allreduce(tf.Variable(data(r)), op=hvd.Max), everyone.max(0))
check("scaled", hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5), everyone.sum(0))
ints = np.stack([data(q, np.int32) for q in range(P)])
check("int average", hvd.allreduce(tf.constant(data(r, np.int32))), np.trunc(ints.sum(0) / P).astype(np.int32))
check("fp16", hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16), everyone.sum(0))
check("fp16 dtype", hvd.allreduce(tf.constant(data(r, np.float16)), op=hvd.Sum).dtype.name, "float16")

# allgather: first dimensions differ by rank
rows = lambda q: np.full((q + 1, 2), q, np.int64)  # noqa: E731
check("allgather", hvd.allgather(tf.constant(rows(r))), np.concatenate([rows(q) for q in range(P)]))
# broadcast from the last rank
check("broadcast", hvd.broadcast(mine, root_rank=P - 1), data(P - 1))

# IndexedSlices (an Embedding's gradient): gathered, the values averaged
sl = hvd.allreduce(tf.IndexedSlices(tf.constant([[float(r + 1)]]), tf.constant([r], tf.int64),
                                    tf.constant([P, 1], tf.int64)))
check("slices values", sl.values, np.array([[q + 1.0] for q in range(P)], np.float32) / np.float32(P))
check("slices indices", sl.indices, np.arange(P, dtype=np.int64))


# inside a tf.function: several collectives, written in one order, run in that order on every rank
@tf.function
def several(x):
    a = hvd.allreduce(x, op=hvd.Sum)
    b = hvd.allgather(x)
    c = hvd.broadcast(x, root_rank=0)
    d = hvd.allreduce(x, op=hvd.Max)
    return a, b, c, d


for _ in range(2):
    a, b, c, d = several(mine)
    check("fn sum", a, everyone.sum(0))
    check("fn allgather", b, everyone.reshape(-1, 3))
    check("fn broadcast", c, data(0))
    check("fn max", d, everyone.max(0))

# gradients, Horovod's
w = tf.constant(data(r) + 1.0)  # each rank its own weights on the output
ws = everyone + 1.0
x = tf.constant(data(r))
with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    l_sum = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum) * w)
    l_avg = tf.reduce_sum(hvd.allreduce(x) * w)
    l_bc = tf.reduce_sum(hvd.broadcast(x, root_rank=1) * w)
    gathered = hvd.allgather(x)  # rows of every rank, weighted alike on every rank
    l_ag = tf.reduce_sum(gathered * tf.reshape(tf.range(tf.size(gathered), dtype=tf.float32), tf.shape(gathered)))
check("grad allreduce sum", tape.gradient(l_sum, x), ws.sum(0))
check("grad allreduce average", tape.gradient(l_avg, x), ws.sum(0) / np.float32(P))
check("grad broadcast", tape.gradient(l_bc, x), ws.sum(0) / np.float32(P) * (1.0 if r == 1 else 0.0))
weights = np.arange(6 * P, dtype=np.float32).reshape(-1, 3)
check("grad allgather", tape.gradient(l_ag, x), weights[2 * r:2 * r + 2])

# broadcast_variables: eagerly (one broadcast per dtype) and inside a tf.function
keras.utils.set_random_seed(100 + r)  # different initial weights on every rank
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(2)])
counter = tf.Variable(r, dtype=tf.int64)
hvd.broadcast_variables(model.variables + [counter], root_rank=0)
flat = np.concatenate([v.numpy().reshape(-1) for v in model.variables])
check("counter", counter, np.int64(0))
v = tf.Variable(data(r))


@tf.function
def assign_from(root):
    hvd.broadcast_variables([v], root_rank=root)


assign_from(P - 1)
check("broadcast_variables in a tf.function", v, data(P - 1))

# a custom training loop as Horovod's TF2 examples write it: DistributedGradientTape, and the
# variables broadcast from rank 0 after the first batch (each rank starts from other weights)
keras.utils.set_random_seed(200 + r)
net = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 8), keras.layers.Flatten(),
                        keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
opt = keras.optimizers.SGD(0.1, momentum=0.9)
lossf = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
rng = np.random.default_rng(r)
tokens = rng.integers(0, 50, (64, 5)).astype(np.int32)
labels = (tokens[:, 0] % 3).astype(np.int32)


@tf.function
def training_step(xb, yb, first_batch):
    with tf.GradientTape() as tape:
        loss_value = lossf(yb, net(xb, training=True))
    tape = hvd.DistributedGradientTape(tape)
    grads = tape.gradient(loss_value, net.trainable_variables)
    opt.apply_gradients(zip(grads, net.trainable_variables))
    if first_batch:
        hvd.broadcast_variables(net.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables, root_rank=0)
    return loss_value


losses = []
for epoch in range(12):
    for b in range(4):
        xb, yb = tokens[16 * b:16 * b + 16], labels[16 * b:16 * b + 16]
        losses.append(float(hvd.allreduce(training_step(xb, yb, epoch == 0 and b == 0))))
loop_weights = np.concatenate([v.numpy().reshape(-1) for v in net.variables + opt.variables
                               if "float" in str(v.dtype)])
# the tape's gradient is the mean over the ranks of the local gradients (the Embedding's too)
with tf.GradientTape() as plain:
    local_loss = lossf(labels[:16], net(tokens[:16]))
local = [tf.convert_to_tensor(g) for g in plain.gradient(local_loss, net.trainable_variables)]
with tf.GradientTape() as t2:
    dist_loss = lossf(labels[:16], net(tokens[:16]))
dist = hvd.DistributedGradientTape(t2, sparse_as_dense=True).gradient(dist_loss, net.trainable_variables)
flat_local = np.concatenate([g.numpy().reshape(-1) for g in local])
mean = hvd.allgather(tf.constant(flat_local[None, :])).numpy().astype(np.float64).mean(0)
tape_error = float(np.max(np.abs(np.concatenate([g.numpy().reshape(-1) for g in dist]) - mean)))

errors = {
    "adasum": error_of(lambda: hvd.allreduce(mine, op=hvd.Adasum)),
    "both": error_of(lambda: hvd.allreduce(mine, op=hvd.Sum, average=True)),
    "root": error_of(lambda: hvd.broadcast(mine, root_rank=P)),
    "process_set": error_of(lambda: hvd.allreduce(mine, process_set=object())),
    "missing": error_of(lambda: hvd.join()),
    "scalar": error_of(lambda: hvd.allgather(tf.constant(1.0))),
    "groups": error_of(lambda: hvd.DistributedGradientTape(tf.GradientTape(), num_groups=2)),
}


def shapes_error() -> str:
    """allgather, in a tf.function, of tensors whose dimensions after the first differ between
    ranks: TensorFlow raises the collective's ValueError as its own error, on every rank."""
    try:
        tf.function(hvd.allgather)(tf.zeros([2, r + 1]))
    except tf.errors.InvalidArgumentError as e:
        return f"{type(e).__name__}: {e.message}"
    return ""


errors["shapes"] = error_of(lambda: hvd.allgather(tf.zeros([2, r + 1])))  # eagerly: the ValueError itself
errors["shapes_graph"] = shapes_error()
errors["reduce_shapes"] = error_of(lambda: hvd.allreduce(tf.zeros([r + 1])))
errors["reduce_dtypes"] = error_of(lambda: hvd.allreduce(tf.zeros([2], tf.float64 if r == 0 else tf.float32)))
errors["gather_dtypes"] = error_of(lambda: hvd.allgather(tf.zeros([r + 1], tf.int32 if r == 1 else tf.int64)))
errors["bcast_shapes"] = error_of(lambda: hvd.broadcast(tf.zeros([1, r + 1]), root_rank=0))
errors["after_shapes"] = hvd.allgather(tf.constant([float(r)])).numpy().tolist()  # still in step
hvd.shutdown()
after_shutdown = error_of(hvd.size)
save_result(r, queries=queries, built=built, objects=objects, failures=failures, weights=flat, errors=errors,
            before_init=before_init,
            losses=losses, loop_weights=loop_weights, tape_error=tape_error,
            after_shutdown=after_shutdown, backend=__import__("tfsparse").runtime.backend())
