"""model.fit on digits with 4 MPI ranks for every aggregation algorithm (one mpirun launch that
trains them sequentially, tests/workers/fit_worker.py), compared with dense allreduce; and
the DensitySchedule callback (gTop-k's warm-up, gtopk-ssgd-shi2019 §IV-B)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from mpi_harness import mpirun

ALGOS = ("dense", "topk", "gtopk", "oktopk", "dgc", "gaussiank", "dragonn")
SPARSE = ALGOS[1:]
DENSITY = 0.05
EPOCHS = 30  # long enough that every algorithm has converged on digits
HALF_WIRES = ("float16", "bfloat16")
# (algorithm, density, options): CSC at 15 % of 32-element chunks (151 chunks of this 4,810-parameter
# model; GradientFlow's 32K chunks would make one), the others at density 0.01
RECIPE = [("csc", 0.15, {"chunk_size": 32}), ("topk", 0.01, {}), ("gtopk", 0.01, {}), ("oktopk", 0.01, {}),
          ("dgc", 0.01, {}), ("dragonn", 0.01, {})]
# DRAGONN's efficiency-aware selection (dragonn-wang2022 §4.2) and DGC's local clipping, both routes
COST_MODEL = [{"algo": "dragonn", "route": "strategy", "epochs": 2, "density": 0.01, "validate": True,
               "options": {"selection": "cost_model"}},
              {"algo": "dgc", "route": "optimizer", "epochs": 2, "density": 0.01, "validate": True,
               # a stated 100 Mbit/s link:
               "options": {"selection": {"alpha": 2e-4, "beta": 12.5e6, "comp_fixed": 1e-4,  # the 64x64 kernel
                                         "comp_per_element": 2e-9}, "clip_norm": 5.0}}]  # compressed, the rest dense


@pytest.fixture(scope="module")
def fits():
    runs = [{"algo": a, "route": "strategy", "epochs": EPOCHS, "density": DENSITY} for a in ALGOS]
    runs += [{"algo": a, "route": "optimizer", "epochs": 2, "density": DENSITY} for a in SPARSE]
    runs += [{"algo": "gtopk", "route": "optimizer", "epochs": 5, "density": DENSITY, "schedule": True}]
    runs += [{"algo": a, "route": "strategy", "epochs": EPOCHS, "density": DENSITY, "wire": w}
             for a in ("dense", "topk") for w in HALF_WIRES]
    runs += [{"algo": "oktopk", "route": "optimizer", "epochs": 2, "density": DENSITY, "wire": "int8",
              "bucket_bytes": 1024}]
    runs += [{"algo": "dense", "route": "strategy", "epochs": EPOCHS, "density": DENSITY, "wire": "int4"}]
    # GradientFlow's / DGC's recipe: momentum correction + dense warm-up, at the densities
    runs += [{"algo": a, "route": "strategy", "epochs": EPOCHS, "density": d, "memory": "momentum",
              "warmup_epochs": 2, "options": o} for a, d, o in RECIPE]
    runs += [{"algo": "csc", "route": "optimizer", "epochs": 2, "density": 0.15, "memory": "momentum",
              "options": {"chunk_size": 32, "chunk_selection": "previous"}}]
    runs += COST_MODEL
    results, text = mpirun(4, "fit_worker.py", json.dumps(runs), timeout=720)
    for key, run in results[0]["runs"].items():  # shown with pytest -s
        print(f"{key:<26} accuracy {run['accuracy']:.4f}  bytes/step {run['comm_bytes']:9.1f}  "
              f"density {run['density']:.4f}  {run['seconds']:5.1f} s")
    return results, text


@pytest.mark.mpi
@pytest.mark.parametrize("algo", SPARSE)
def test_accuracy_within_two_points_of_dense(fits, algo):
    results, text = fits
    runs = results[0]["runs"]
    dense = runs["dense/strategy"]["accuracy"]
    got = runs[f"{algo}/strategy"]["accuracy"]
    assert dense > 0.9, text[-3000:]
    assert got >= dense - 0.02, (algo, got, dense)
    for r in results:  # replicas identical, and every rank measured the same accuracy
        assert r["runs"][f"{algo}/strategy"]["identical"]
        assert r["runs"][f"{algo}/strategy"]["accuracy"] == got
    assert runs[f"{algo}/strategy"]["comm_bytes"] < runs["dense/strategy"]["comm_bytes"]


@pytest.mark.mpi
@pytest.mark.parametrize("algo", SPARSE)
def test_distributed_optimizer_route(fits, algo):
    results, _ = fits
    for r in results:
        run = r["runs"][f"{algo}/optimizer"]
        assert run["identical"] and run["accuracy"] > 0.5
        assert 0 < run["density"] < 0.5


@pytest.mark.mpi
@pytest.mark.parametrize("wire", HALF_WIRES)
@pytest.mark.parametrize("algo", ["dense", "topk"])
def test_half_precision_wire_accuracy_within_one_point(fits, algo, wire):
    """GradientFlow's fp16 / Pipe-SGD's 16-bit truncation on the wire: digits accuracy within
    1 point of the float32 wire, half the bytes per step, replicas identical."""
    results, _ = fits
    runs = results[0]["runs"]
    f32, half = runs[f"{algo}/strategy"], runs[f"{algo}/strategy+{wire}"]
    assert half["accuracy"] >= f32["accuracy"] - 0.01, (algo, wire, half["accuracy"], f32["accuracy"])
    # dense: half the bytes; topk: 2-byte blocked indices + 2-byte values against + 4-byte values
    assert half["comm_bytes"] == pytest.approx(f32["comm_bytes"] * (0.5 if algo == "dense" else 2 / 3), rel=0.02)
    for r in results:
        assert r["runs"][f"{algo}/strategy+{wire}"]["identical"]


@pytest.mark.mpi
def test_int4_wire_accuracy_within_one_point(fits):
    """Dense over int4 (15 levels per 512 values, error feedback keeping what it rounds off):
    digits accuracy within 1 point of the float32 wire for an eighth of its bytes (and the
    scales), replicas identical."""
    results, _ = fits
    runs = results[0]["runs"]
    f32, int4 = runs["dense/strategy"], runs["dense/strategy+int4"]
    assert int4["accuracy"] >= f32["accuracy"] - 0.01, (int4["accuracy"], f32["accuracy"])
    assert int4["comm_bytes"] == pytest.approx(f32["comm_bytes"] / 8 * (1 + 8 / 512), rel=0.02)
    for r in results:
        assert r["runs"]["dense/strategy+int4"]["identical"]


@pytest.mark.mpi
@pytest.mark.parametrize("key,densities", [("oktopk/optimizer+int8+b1024", (0.0, 0.5)),  # int8 wire, buckets
                                           ("csc/optimizer+mc", (0.1, 0.2))])  # CSC's previous-step choice
def test_more_options_through_the_optimizer(fits, key, densities):
    results, _ = fits
    for r in results:
        run = r["runs"][key]
        assert run["identical"] and run["accuracy"] > 0.5
        assert densities[0] < run["density"] < densities[1]


@pytest.mark.mpi
@pytest.mark.parametrize("algo", [a for a, _, _ in RECIPE])
def test_momentum_correction_and_warmup_reach_dense_accuracy(fits, algo):
    """GradientFlow §3.2 / DGC: momentum correction + dense warm-up at low density, within 3
    points of dense (the benchmark, tools/bench_convergence.py, measures 1.5); the first steps
    are dense, later ones at the target density; replicas identical."""
    results, text = fits
    runs = results[0]["runs"]
    dense = runs["dense/strategy"]["accuracy"]
    run = runs[f"{algo}/strategy+mc+warmup"]
    assert run["accuracy"] >= dense - 0.03, (algo, run["accuracy"], dense)
    target = dict((a, d) for a, d, _ in RECIPE)[algo]
    assert run["densities"][0] > 0.5  # the warm-up's first epoch: dense, then ramping
    assert run["densities"][-1] == pytest.approx(target, rel=0.15, abs=0.01)
    for r in results:
        assert r["runs"][f"{algo}/strategy+mc+warmup"]["identical"]



def check_cost_model_runs(results, P):
    """Every rank trained to identical weights, with identical per-tensor decisions (buckets)."""
    for key in ("dragonn/strategy+cm", "dgc/optimizer+cm+clip"):
        runs = [r["runs"][key] for r in results]
        assert len(results) == P
        for run in runs:
            assert run["identical"] and run["accuracy"] > 0.5, (key, run)
            assert run["buckets"] == runs[0]["buckets"]
        covered = sorted((first, last) for first, last, _ in runs[0]["buckets"])
        assert covered[0][0] == 0 and covered[-1][1] == 4 and all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        assert {alg for *_, alg in runs[0]["buckets"]} <= {"dense", key.split("/")[0]}
    # Eq. 1 under the stated model: the 64x64 kernel alone is compressed, the other three fused dense
    assert sorted(results[0]["runs"]["dgc/optimizer+cm+clip"]["buckets"]) == [[0, 1, "dgc"], [1, 4, "dense"]]


def check_sharded_evaluation(results) -> None:
    """Every rank evaluating its shard of the test rows (``tfsparse.data.shard(...,
    drop_remainder=False)``) logs the accuracy of the whole set, as when each evaluates all of
    them: the ranks average the metric states, whose ratio is then the whole set's (to float32
    rounding where P is not a power of two), the same on every rank.  On the optimizer route, and
    in runs with ``validate`` (which validate every epoch) on either route, also where the shards
    have one batch and two: accuracy and loss both the whole set's, in evaluate and (``validate``)
    in fit's validation of the last epoch."""
    for key in results[0]["runs"]:
        seen = [r["runs"][key]["sharded_accuracy"] for r in results]
        assert len(set(seen)) == 1, (key, seen)
        assert abs(seen[0] - results[0]["runs"][key]["accuracy"]) <= 1e-6, (key, seen[0])
        # shards of one batch and two: the ranks with one average with the others' second
        uneven = [r["runs"][key]["uneven"] for r in results]
        assert (uneven[0] is not None) == ("/optimizer" in key or key.startswith("dragonn/strategy+cm")), key
        if uneven[0] is not None:
            assert all(u == uneven[0] for u in uneven), (key, uneven)
            for whole, sharded in uneven[0]:
                assert abs(sharded - whole) <= 1e-6 * max(1.0, abs(whole)), (key, uneven[0])


@pytest.mark.mpi
def test_cost_model_selection_in_fit(fits):
    check_cost_model_runs(fits[0], 4)


@pytest.mark.mpi
def test_sharded_evaluation_is_the_whole_sets(fits):
    check_sharded_evaluation(fits[0])


@pytest.mark.mpi
@pytest.mark.parametrize("P", [2, 3])
def test_cost_model_selection_in_fit_small_worlds(P):
    results, _ = mpirun(P, "fit_worker.py", json.dumps(COST_MODEL), timeout=300)
    check_cost_model_runs(results, P)
    check_sharded_evaluation(results)


@pytest.mark.mpi
def test_density_schedule_in_fit(fits):
    results, _ = fits
    for r in results:
        run = r["runs"]["gtopk/optimizer+schedule"]
        # gTop-k's warm-up 0.25, 0.0725, 0.015, 0.004 -- never below the target 0.05
        assert run["densities_set"] == [0.25, 0.0725, 0.05, 0.05, 0.05]
        assert run["identical"]


# -- DensitySchedule without MPI -------------------------------------------------------------

def _model(density):
    ex = SimpleNamespace(density=density, comm=SimpleNamespace(rank=0))
    return SimpleNamespace(optimizer=SimpleNamespace(exchange=ex)), ex


def _drive(cb, model, epochs):
    cb.set_model(model)
    cb.on_train_begin()
    seen = []
    for e in range(epochs):
        cb.on_epoch_begin(e)
        seen.append(model.optimizer.exchange.density)
    return seen


def test_density_schedule_default_is_gtopk_warmup():
    from tfsparse.keras.callbacks import DensitySchedule

    model, _ = _model(0.001)
    assert _drive(DensitySchedule(), model, 6) == [0.25, 0.0725, 0.015, 0.004, 0.001, 0.001]
    model, _ = _model(0.01)  # a warm-up value below the target is raised to the target
    assert _drive(DensitySchedule(), model, 5) == [0.25, 0.0725, 0.015, 0.01, 0.01]


def test_density_schedule_user_schedules():
    from tfsparse.keras.callbacks import DensitySchedule

    model, _ = _model(0.02)
    assert _drive(DensitySchedule([0.5, 0.001]), model, 4) == [0.5, 0.001, 0.02, 0.02]
    model, _ = _model(0.02)
    assert _drive(DensitySchedule(lambda e: 0.1 / (e + 1)), model, 3) == [0.1, 0.05, 0.1 / 3]
    model, _ = _model(0.02)
    assert _drive(DensitySchedule([0.3], target=0.004), model, 3) == [0.3, 0.004, 0.004]


@pytest.mark.parametrize("kwargs,words", [
    ({"schedule": [0.1, 0.0]}, ["schedule[1]=0.0", "(0, 1]"]),
    ({"schedule": "fast"}, ["schedule='fast'"]),
    ({"target": 2.0}, ["target=2.0", "(0, 1]"]),
])
def test_density_schedule_bad_input(kwargs, words):
    from tfsparse.keras.callbacks import DensitySchedule

    with pytest.raises(ValueError) as e:
        DensitySchedule(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_density_schedule_bad_callable_and_no_exchange():
    from tfsparse.keras.callbacks import DensitySchedule

    model, _ = _model(0.02)
    cb = DensitySchedule(lambda e: 1.5)
    cb.set_model(model)
    cb.on_train_begin()
    with pytest.raises(ValueError, match=r"schedule\(0\)=1.5"):
        cb.on_epoch_begin(0)
    cb = DensitySchedule()
    cb.set_model(SimpleNamespace(optimizer=None, distribute_strategy=None))
    with pytest.raises(ValueError, match="SparseStrategy"):
        cb.on_train_begin()
