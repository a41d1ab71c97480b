"""A device-resident GradientExchange under Numba's CUDA simulator, against the host exchange.

Usage: ``NUMBA_ENABLE_CUDASIM=1 python device_exchange.py [names...]`` (``--gpu`` instead of
the variable on a machine with a GPU: tools/gpu_check.sh); prints one JSON object
``{check name: "ok" | traceback}`` as the last line (tests/test_exchange_device.py starts it).
One process, one rank: the exchange runs its collectives inline, so no two simulated kernels
ever run at once (the simulator swaps module globals per launch).
"""
from __future__ import annotations

import functools
import sys
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ops_cuda_workers.sim_check import Skipped, _dev, _host, _same_bits, _setup, main, simulated  # noqa: E402

SHAPES = [(20, 6), (9,), (3, 5, 2), ()]  # 192 elements, one of them a scalar
N = sum(int(np.prod(s)) for s in SHAPES)

CONFIGS = {
    "topk": ("topk", {}),
    "gtopk": ("gtopk", {}),
    "dragonn": ("dragonn", {"min_samples": 16, "sample_ratio": 0.1}),
    "oktopk": ("oktopk", {}),                      # a host copy of the bucket (selects on the host)
    "dgc": ("dgc", {"seed": 3}),
    "csc": ("csc", {"chunk_size": 32}),
    "dense_int8": ("dense", {"wire_dtype": "int8"}),
    "dense_bf16_ring": ("dense", {"wire_dtype": "bfloat16", "reduce_scatter": "ring"}),
    "topk_momentum": ("topk", {"memory": "momentum"}),
    "topk_none": ("topk", {"memory": "none"}),
    "gtopk_per_tensor": ("gtopk", {"plan": "per_tensor"}),
    "dragonn_bf16": ("dragonn", {"wire_dtype": "bfloat16", "min_samples": 16}),
}


def _devs(arrays):
    from numba import cuda

    return [cuda.to_device(np.asarray(x)) for x in arrays]  # keeps the scalar 0-d


def _grads(step, nonfinite=False):
    rng = np.random.default_rng(100 + step)
    g = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    if nonfinite:
        g[1][4] = np.nan
    return g


def _pair(algorithm, options, density=0.1):
    from tfsparse.exchange import GradientExchange
    from tfsparse.pipelined import Pipelined

    return Pipelined(GradientExchange(algorithm, density, **options)), \
        Pipelined(GradientExchange(algorithm, density, **options))


def _same_list(host, dev):
    assert len(host) == len(dev)
    for h, d in zip(host, dev):
        from tfsparse.ops import device_kind

        assert device_kind(d) == "cuda", type(d)
        assert tuple(d.shape) == h.shape, (d.shape, h.shape)
        _same_bits(_host(d).reshape(h.shape), h)


def _same_state(host, dev):
    hs, ds = host.get_state(), dev.get_state()
    assert sorted(hs) == sorted(ds), (sorted(hs), sorted(ds))
    for key in hs:
        a, b = np.asarray(hs[key]), np.asarray(ds[key])
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), key


def _check_config(name):
    def check():
        _setup()
        algorithm, options = CONFIGS[name]
        host, dev = _pair(algorithm, options)
        for step in range(4):
            g = _grads(step)
            _same_list(host.engine.exchange_numpy(g), dev.engine.exchange_numpy(_devs(g)))
        assert dev.space.on_device and not host.space.on_device
        _same_state(host, dev)
    return check


def check_selection_on_device_only_payload_to_host():
    """topk, gtopk and dragonn select on the device: no CPU selection kernel runs and the bucket
    vector is never copied to the host (the fallback of the other algorithms)."""
    from tfsparse import space
    from tfsparse.ops import cpu

    from tfsparse.exchange_build import _warm_kernels

    _setup()
    _warm_kernels()  # the CPU kernels compiled first (the other algorithms' fallback needs them)
    saved = {name: getattr(cpu, name) for name in ("topk_abs", "hash_select", "sample_threshold", "kth_largest_abs")}
    to_host = space.CudaSpace.to_host

    def refuse(*args, **kwargs):
        raise AssertionError("the bucket left the device")

    for name in saved:
        setattr(cpu, name, refuse)
    space.CudaSpace.to_host = refuse
    try:
        for algorithm, options in (("topk", {}), ("gtopk", {}), ("dragonn", {"min_samples": 16}),
                                   ("dragonn", {"min_samples": 100000})):  # exact k-th threshold
            from tfsparse.exchange import GradientExchange

            ex = GradientExchange(algorithm, 0.1, **options)
            for step in range(2):
                ex.exchange_numpy(_devs(_grads(step)))
    finally:
        for name, fn in saved.items():
            setattr(cpu, name, fn)
        space.CudaSpace.to_host = to_host


def check_host_algorithms_copy_each_gradient_to_the_host_once():
    """dense (int8, ring), Ok-Topk and DGC take no device vector: their error feedback runs on the
    host (the bucket's memory lives there), the gradients copied once into the bucket's host
    staging vector, and the bucket vector never copied to the host afterwards; the result is a
    device array, the host exchange's bit for bit (the same_as_host_* checks)."""
    from tfsparse import space

    _setup()
    to_host = space.CudaSpace.to_host

    def refuse(*args, **kwargs):
        raise AssertionError("a bucket vector was copied to the host")

    space.CudaSpace.to_host = refuse
    try:
        for algorithm, options in (("dense", {"wire_dtype": "int8"}), ("dense", {"reduce_scatter": "ring"}),
                                   ("oktopk", {}), ("dgc", {"seed": 3})):
            host, dev = _pair(algorithm, options)
            for step in range(2):
                g = _grads(step)
                _same_list(host.engine.exchange_numpy(g), dev.engine.exchange_numpy(_devs(g)))
            buckets = dev.engine.bucket_states
            assert dev.space.on_device and all(not b.memory.space.on_device for b in buckets), algorithm
            assert all(b._staging is not None and b._staging.size == b.spec.size for b in buckets), algorithm
    finally:
        space.CudaSpace.to_host = to_host


def check_device_result_stays_on_device_flat():
    _setup()
    host, dev = _pair("topk", {})
    for step in range(2):
        flat = np.concatenate([x.reshape(-1) for x in _grads(step)])
        out = dev.engine.exchange_numpy(_dev(flat))
        assert out.shape == (N,)
        _same_bits(out, host.engine.exchange_numpy(flat))


def check_pipelined_steps():
    _setup()
    host, dev = _pair("dragonn", {"pipeline": 2, "min_samples": 16})
    for step in range(4):
        g = _grads(step)
        _same_list(host.step(g), dev.step(_devs(g)))
    host.flush()
    dev.flush()
    _same_state(host, dev)  # the pending result, held on the device, saved to the host


def check_nonfinite_round_skipped_on_device():
    _setup()
    host, dev = _pair("gtopk", {})
    for step in range(3):
        g = _grads(step, nonfinite=step == 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = dev.engine.exchange_numpy(_devs(g))
            _same_list(host.engine.exchange_numpy(g), out)
        if step == 1:
            assert any("not finite" in str(w.message) for w in caught)
            assert all(not np.any(_host(o)) for o in out)
    _same_state(host, dev)


def check_state_restored_onto_device():
    _setup()
    host, dev = _pair("topk", {"memory": "momentum"})
    for step in range(2):
        g = _grads(step)
        host.engine.exchange_numpy(g)
        dev.engine.exchange_numpy(_devs(g))
    saved = dev.get_state()
    from tfsparse.exchange import GradientExchange

    resumed = GradientExchange("topk", 0.1, memory="momentum")
    resumed.set_state(saved)
    for step in range(2, 4):
        g = _grads(step)
        _same_list(host.engine.exchange_numpy(g), resumed.exchange_numpy(_devs(g)))
    _same_state(host, resumed)


def check_clip_norm_on_device():
    _setup()
    host, dev = _pair("topk", {"clip_norm": 2.0})
    for step in range(3):
        g = _grads(step)
        h, d = host.engine.exchange_numpy(g), dev.engine.exchange_numpy(_devs(g))
        for a, b in zip(h, d):  # the float64 norm is summed in another order: not bit for bit
            np.testing.assert_allclose(_host(b).reshape(a.shape), a, rtol=1e-5, atol=1e-6)


def check_host_exchange_takes_device_arrays():
    _setup()
    host, other = _pair("topk", {})
    g = _grads(0)
    out = other.engine.exchange_numpy(g)  # built on the host
    got = other.engine.exchange_numpy(_devs(_grads(1)))
    assert all(isinstance(o, np.ndarray) for o in got + out)
    host.engine.exchange_numpy(g)
    for a, b in zip(host.engine.exchange_numpy(_grads(1)), got):
        _same_bits(b, a)


def _tf_pair(algorithm, options):
    """Two exchanges called inside tf.functions: one built on the "cuda" path of the TF glue
    (tf.py_function, the gradients viewed on the device, a CudaSpace), one on the host path."""
    import tensorflow as tf

    from tfsparse.ops import tf as ops_tf
    from tfsparse.tf_glue import exchange_tensors

    out = []
    for path, ex in zip(("cpu", "cuda"), _pair(algorithm, options)):
        ops_tf.set_path(path)  # read when the exchange is built (its first trace)
        fn = tf.function(functools.partial(exchange_tensors, ex), autograph=False)
        fn([tf.constant(g) for g in _grads(0)])
        out.append((ex, fn))
    ops_tf.set_path(None)
    return out


def check_tf_glue_pipelined_on_the_cuda_path():
    """The TF glue's cuda path, pipelined (the result owed to the next step held on the device),
    gives the host path's tensors and state bit for bit; its graph runs EagerPyFunc ops."""
    import tensorflow as tf

    _setup()
    (host, host_fn), (dev, dev_fn) = _tf_pair("dragonn", {"pipeline": 2, "min_samples": 16})
    assert dev.space.on_device and not host.space.on_device
    for step in range(1, 4):
        g = [tf.constant(x) for x in _grads(step)]
        h, d = host_fn(g), dev_fn(g)
        for a, b in zip(h, d):
            assert a.shape == b.shape and a.dtype == b.dtype == tf.float32
            _same_bits(b.numpy(), a.numpy())
    kinds = {op.type for op in dev_fn.get_concrete_function(g).graph.get_operations()}
    assert "EagerPyFunc" in kinds and "PyFunc" not in kinds, kinds
    host.flush()
    dev.flush()
    _same_state(host, dev)


def check_keras_fit_on_the_cuda_path():
    """model.fit with tfsparse.keras.DistributedOptimizer: built on the cuda path of the TF glue,
    its exchange lives on the device, and training gives the host path's weights bit for bit."""
    import keras
    import tensorflow as tf

    from tfsparse.keras import DistributedOptimizer
    from tfsparse.ops import tf as ops_tf

    _setup()
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((32, 6)).astype(np.float32), rng.integers(0, 3, 32)
    weights, spaces = [], []
    for path in ("cpu", "cuda"):
        ops_tf.set_path(path)
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
        opt = DistributedOptimizer(keras.optimizers.SGD(0.1), "topk", 0.1)
        model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        initial = [w.numpy() for w in model.weights]
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        weights.append([w.numpy() for w in model.weights])
        assert any(not np.array_equal(a, b) for a, b in zip(initial, weights[-1])), "fit changed nothing"
        spaces.append(opt.exchange.space.name)
    ops_tf.set_path(None)
    assert spaces == ["host", "cuda"], spaces
    for a, b in zip(*weights):
        _same_bits(b, a)
    assert tf.executing_eagerly()


def check_space_of_the_gpu_the_arrays_name():
    """A DLPack producer's device ordinal picks the CudaSpace (one per GPU); a Numba array (which
    names none) gets the current device's; the space makes its GPU current while active."""
    from numba import cuda

    from tfsparse.space import CudaSpace, cuda_space, space_for

    if not simulated() and len(cuda.gpus) < 2:
        raise Skipped("needs a second GPU")

    class OnGpu1:  # what CuPy/PyTorch/TF arrays on GPU 1 say
        __cuda_array_interface__ = {}

        def __dlpack_device__(self):
            return (2, 1)

    one = space_for(OnGpu1())
    assert isinstance(one, CudaSpace) and one.device_id == 1 and one is cuda_space(1)
    zero = space_for(_dev(np.zeros(3, np.float32)))
    assert zero.device_id == 0 and zero is not one
    with zero.active():
        x = zero.full(4, 2.0)
    assert _host(x).tolist() == [2.0] * 4


CHECKS = {**{f"same_as_host_{name}": _check_config(name) for name in CONFIGS},
          **{name[len("check_"):]: fn for name, fn in sorted(globals().items()) if name.startswith("check_")}}
CHECK_NAMES = tuple(CHECKS)

if __name__ == "__main__":
    main(sys.argv[1:], CHECKS)
