"""Identical replicas on the models users write, under real mpirun (P = 2 and 3): every weight and
optimizer variable bit for bit equal across ranks after training, for every algorithm, Adam and
SGD (and eight other Keras optimizers), a model with variables the loss never reaches, a Transformer under mixed precision, transfer learning and refits on both routes, a GAN's two
optimizers; and a rank that drifts apart is named, never silent.

One launch per world size runs every case one after another (tests/workers/replicas.py): a
launch costs more than a case."""
import pytest

from mpi_harness import mpirun

ALGORITHMS = ("dense", "topk", "gtopk", "oktopk", "dragonn", "dgc", "gaussiank", "csc")
CASES = {
    2: [f"text-{a}-adam" for a in ALGORITHMS] + ["text-topk-sgd", "text-gtopk-sgd", "transformer-mixed_bfloat16",
                                                 "finetune-strategy", "finetune-optimizer", "refit-strategy", "refit-optimizer", "gan-strategy", "gan-optimizer",
                                                 "diverge-strategy", "diverge-optimizer", "diverge-strategy-validation",
                                                 "auto-strategy-measured", "auto-optimizer-gtopk"],
    3: ["text-topk-adam", "text-gtopk-adam", "text-oktopk-adam", "text-dragonn-adam", "text-oktopk-sgd",
        "transformer-float32", "transformer-mixed_bfloat16", "finetune-strategy", "finetune-optimizer",
        "refit-strategy", "refit-optimizer", "refit-strategy-2", "refit-optimizer-2", "optimizers-strategy", "optimizers-optimizer", "unused-strategy", "unused-optimizer", "gan-strategy",
        "gan-optimizer", "diverge-strategy", "diverge-optimizer", "diverge-strategy-validation", "auto-strategy-measured",
        "auto-optimizer-measured", "auto-strategy-oktopk"],
}
_launched: dict = {}


def launched(nproc: int):
    """Every case of ``CASES[nproc]`` in one launch (once per session); per-rank results."""
    if nproc not in _launched:
        _launched[nproc] = mpirun(nproc, "replicas.py", *CASES[nproc], timeout=900)[0]
    return _launched[nproc]


def same_bits(results, key):
    ref = results[0][key]
    for r, res in enumerate(results):
        diff = (res[key] != ref).nonzero()[0]
        assert diff.size == 0, f"{key}: rank {r} differs from rank 0 at {diff.size} of {ref.size} elements"


TRAINED = [(n, c) for n, cases in CASES.items() for c in cases if not c.startswith("diverge")]


@pytest.mark.mpi
@pytest.mark.timeout(960)
@pytest.mark.parametrize("nproc,case", TRAINED, ids=[f"{n}-{c}" for n, c in TRAINED])
def test_every_rank_ends_with_the_same_bits(nproc, case):
    """The text classifier (Embedding) of the regression with every algorithm and Adam (the
    result vectors Adam's ``gradient - m`` wrote into were refilled at the last indices only),
    the Transformer (MultiHeadAttention, LayerNorm, AdamW with a cosine schedule and clipnorm)
    in float32 and mixed_bfloat16 over a bfloat16 wire, the transfer-learning recipe (freeze,
    fit, unfreeze, compile, fit) under SparseStrategy and through a new DistributedOptimizer per
    compile (BatchNorm's moving statistics averaged at fit's end), refits with another trainable
    set and optimizer (synchronous and Pipe-SGD's pipeline=2), Lion, Adafactor, Muon,
    ScheduleFreeAdamW, Adam's EMA and gradient accumulation, RMSprop and Nadam over the sparse
    algorithms on both routes (P = 3), and a GAN whose two optimizers each
    get an exchange of their own (under SparseStrategy, or each a DistributedOptimizer)."""
    same_bits(launched(nproc), case.replace("-", "_"))
    if case.startswith("unused"):  # a head without gradients: skipped with Keras' warning, the rest trained
        for res in launched(nproc):
            info = res[case.replace("-", "_") + "_info"]
            assert info["warned"] and info["loss"][1] < info["loss"][0], info
            assert info["spare_kept"] in (True, None), info
    if case.startswith("optimizers"):  # only the recent optimizers may be missing (an older Keras)
        for res in launched(nproc):
            assert set(res[case.replace("-", "_") + "_info"]["missing"]) <= {"Muon", "ScheduleFreeAdamW"}


@pytest.mark.mpi
@pytest.mark.timeout(960)
@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("route", ["strategy", "optimizer"])
def test_a_rank_that_drifts_apart_is_named_on_every_rank(nproc, route):
    """Rank 1 alone nudges the last layer's bias in the first epoch: under SparseStrategy every
    rank raises at the end of that epoch, on the optimizer route at the end of fit -- naming the
    variable and the rank."""
    for r, res in enumerate(launched(nproc)):
        caught, epochs = res[f"diverge_{route}"]["caught"], res[f"diverge_{route}"]["epochs"]
        assert caught is not None, f"rank {r} trained on in silence"
        assert "ReplicasDiverged" in caught and "dense" in caught and "/bias' holds other bits on rank 1 " in caught, caught
        assert epochs == (1 if route == "strategy" else 3), (r, epochs)


@pytest.mark.mpi
@pytest.mark.timeout(960)
@pytest.mark.parametrize("nproc", [2, 3])
def test_the_replica_check_runs_at_the_training_epochs_end_whatever_the_validation_data(nproc):
    """Validation data of 5 batches beside 16 training batches, rank 1's nudge in the second
    epoch: the check raises at that epoch's end (its 16th step, the last one whose batch never
    ended), not after 5 batches -- fit's validation data no longer sets the epoch's length (the
    check then ran every 5 steps, and Pipe-SGD's epoch sync points moved with it)."""
    for r, res in enumerate(launched(nproc)):
        got = res["diverge_strategy_validation"]
        assert got["caught"] is not None and "ReplicasDiverged" in got["caught"], (r, got["caught"])
        assert (got["epochs"], got["batches"], got["sync_steps"]) == (2, 15, 16), (r, got)


AUTO = [(n, c) for n, cases in CASES.items() for c in cases if c.startswith("auto")]


@pytest.mark.mpi
@pytest.mark.timeout(960)
@pytest.mark.parametrize("nproc,case", AUTO, ids=[f"{n}-{c}" for n, c in AUTO])
def test_auto_makes_one_choice_on_every_rank(nproc, case):
    """``algorithm="auto"``: the first rounds run dense over float16 and are measured; at round 10
    every rank makes the same choice (measured, or a sparse one forced, so that the switch
    mid-epoch is exercised), rank 0 alone prints it once, and the ranks end bit-identical.  With
    SGD's momentum the exchange applies it (momentum correction) and the optimizer's own momentum
    variables stay zero."""
    results = launched(nproc)
    key = case.replace("-", "_")
    infos = [r[key + "_info"] for r in results]
    forced = case.split("-")[2]
    for info in infos:
        assert info["choice"] == infos[0]["choice"] and info["settings"] == infos[0]["settings"]
        assert info["choice"] == (infos[0]["choice"] if forced == "measured" else forced)
        assert info["settings"]["memory"] == "momentum_rows" and info["settings"]["momentum"] == pytest.approx(0.9)
        assert info["velocity"] and info["sgd_momentum"] == [pytest.approx(0.9), False]
    assert len(infos[0]["printed"]) == 1 and all(not i["printed"] for i in infos[1:])
    assert f"chose " in infos[0]["printed"][0] and "Pin it with algorithm=" in infos[0]["printed"][0]
    # 16 steps per epoch: the first 10 dense (density 1), then the choice
    assert infos[0]["density"][0] > 10 / 16
    if forced != "measured":
        assert infos[0]["density"][-1] <= 0.011 and infos[0]["comm_bytes"][-1] < 0.1 * infos[0]["comm_bytes"][0]
    same_bits(results, key)
