"""Fault tolerance on real mpirun: tfsparse.keras.callbacks.BackupAndRestore resumes an interrupted
fit bit-identically to an uninterrupted one for every algorithm (P = 3, and P = 2), ranks that
would resume from different backups raise the same error instead of hanging, and
``tfsparse-run --max-restarts 1`` relaunches a job whose rank was killed, which resumes from the
backup and ends with an uninterrupted run's weights."""
from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest

from mpi_harness import REPO, launcher, mpirun, run_locked
from test_resume_mpi import OPTIONS
from tfsparse.aggregators.registry import available_aggregators
from workers.resume_cases import key
from tfsparse.keras.callbacks import BackupAndRestore

GRADIENTFLOW = {"wire": "float16", "memory": "momentum", "momentum": 0.9, "bucket_bytes": 1024,
                "options": {"chunk_size": 16, "chunk_selection": "previous"}}
CASES = ([{"algo": a, "route": "strategy", "options": OPTIONS.get(a, {}),
           **({"wire": "float16"} if a == "dense" else {})} for a in ("dense", "topk", "gtopk", "oktopk", "dgc",
                                                                      "gaussiank", "dragonn")]
         + [{"algo": "csc", "route": "strategy", **GRADIENTFLOW},                       # GradientFlow's recipe
            {"algo": "dense", "route": "strategy", "wire": "int8", "pipeline": 2},      # Pipe-SGD, K = 2
            {"algo": "topk", "route": "strategy", "pipeline": 2},
            {"algo": "topk", "route": "optimizer"}])
E, K = 4, 2  # tests/workers/backup.py: 4 epochs of 6 steps, interrupted after epoch 2


@pytest.mark.parametrize("kwargs, words", [
    ({"backup_dir": ""}, ["backup_dir=''", "a non-empty path"]),
    ({"backup_dir": None}, ["backup_dir=None", "a non-empty path"]),
    ({"backup_dir": "b", "save_freq": 0}, ["save_freq=0", "an integer >= 1", "'epoch'"]),
    ({"backup_dir": "b", "save_freq": "batch"}, ["save_freq='batch'", "an integer >= 1", "'epoch'"]),
    ({"backup_dir": "b", "delete_checkpoint": "yes"}, ["delete_checkpoint='yes'", "True or False"]),
    ({"backup_dir": "b", "double_checkpoint": 1}, ["double_checkpoint=1", "True or False"]),
])
def test_bad_arguments_name_the_argument_and_what_is_accepted(kwargs, words):
    with pytest.raises(ValueError) as info:
        BackupAndRestore(**kwargs)
    for word in words:
        assert word in str(info.value), str(info.value)


def check_resumed(results, cases):
    for r, res in enumerate(results):
        for case in cases:
            k = key(case)
            info = res["info"][k]
            assert info["saved"]["epoch"] == K and info["saved"]["batch"] == 0, (k, r, info)
            assert info["restored"] == {"file": BackupAndRestore.LATEST, **info["saved"]}, (k, r, info)
            assert info["epochs_run"] == E - K and info["iterations"] == 6 * E, (k, r, info)
            assert not info["live_dir_left"] and not info["backup_dir_left"], (k, r, info)  # deleted at the end
            np.testing.assert_array_equal(res[f"{k}/resumed"], res[f"{k}/live"], err_msg=f"{k} on rank {r}")
            np.testing.assert_array_equal(res[f"{k}/live"], results[0][f"{k}/live"])


@pytest.mark.mpi
def test_resumed_training_is_bit_identical_for_every_algorithm_p3(tmp_path):
    results, _ = mpirun(3, "backup.py", tmp_path, "resume", json.dumps(CASES), timeout=540)
    check_resumed(results, CASES)
    assert {case["algo"] for case in CASES} == set(available_aggregators())


@pytest.mark.mpi
def test_resumed_training_is_bit_identical_p2(tmp_path):
    cases = [c for c in CASES if c["algo"] == "oktopk"]
    results, _ = mpirun(2, "backup.py", tmp_path, "resume", json.dumps(cases), timeout=240)
    check_resumed(results, cases)


@pytest.mark.mpi
def test_ranks_that_would_resume_from_different_epochs_raise_the_same_error(tmp_path):
    results, _ = mpirun(3, "backup.py", tmp_path, "mismatch", json.dumps(CASES[1]), timeout=300)
    good, empty, stale = (str(tmp_path / name) for name in ("good", "empty", "stale"))
    for name, words in (("empty", [f"rank 1: no backup in {empty}", f"rank 0: epoch 2, batch 0 (latest.weights.h5 in "
                                                                     f"{good}"]),
                        ("stale", [f"rank 2: epoch 1, batch 0 (latest.weights.h5 in {stale}",
                                   f"rank 1: epoch 2, batch 0 (latest.weights.h5 in {good}"])):
        errors = [res["info"]["errors"][name] for res in results]
        assert errors[0] is not None and all(e == errors[0] for e in errors), errors  # the same on every rank
        assert errors[0]["type"] == "ConfigurationMismatch", errors[0]
        for word in ["would resume from different backups", "the same backup_dir", *words]:
            assert word in errors[0]["text"], errors[0]["text"]
    for res in results:  # the backup was left alone: every rank on it then resumes at epoch 2
        assert [saved["epoch"] for saved in res["info"]["saved"]] == [2, 1]
        assert res["info"]["restored"]["epoch"] == 2 and res["info"]["epochs_run"] == E - 2
        assert not res["info"]["good_left"]


@pytest.mark.mpi
@pytest.mark.parametrize("nproc", [2, 3])
def test_max_restarts_relaunches_a_killed_job_which_resumes_from_its_backup(tmp_path, nproc):
    """``tfsparse-run -np 2|3 --max-restarts 1``: rank 1 kills itself in epoch 2 of the first launch;
    the relaunched job resumes from the backup of epoch 2 and ends with the weights of a job that
    was never killed."""
    worker = str(REPO / "tests" / "workers" / "backup_restart.py")
    runs = {}
    for name in ("kill", "nokill"):
        (tmp_path / name).mkdir()
        runs[name] = run_locked([launcher("tfsparse-run"), "-np", str(nproc), "--max-restarts", "1", sys.executable,
                                 worker, str(tmp_path / name), name], timeout=300, env={"TF_CPP_MIN_LOG_LEVEL": "3"})
    killed, clean = runs["kill"], runs["nokill"]
    assert "rank 1: kills itself in epoch 2" in killed, killed[-3000:]
    restarts = [line for line in killed.splitlines() if line.startswith("tfsparse-run:")]
    assert len(restarts) == 1 and re.fullmatch(r"tfsparse-run: the job failed \(exit status \d+\); restart 1 of 1",
                                               restarts[0]), killed[-3000:]
    assert (tmp_path / "kill" / "launches.txt").read_text() == "started at epoch 0\nstarted at epoch 2\n"
    assert killed.count("fit returned after 2 epochs") == nproc, killed[-3000:]  # the relaunch ran epochs 2 and 3
    assert "tfsparse-run:" not in clean and clean.count("fit returned after 4 epochs") == nproc, clean[-3000:]
    assert (tmp_path / "nokill" / "launches.txt").read_text() == "started at epoch 0\n"
    for rank in range(nproc):
        np.testing.assert_array_equal(np.load(tmp_path / "kill" / f"weights{rank}.npy"),
                                      np.load(tmp_path / "nokill" / f"weights{rank}.npy"), err_msg=f"rank {rank}")
    for name in ("kill", "nokill"):
        assert not (tmp_path / name / "backup").exists()  # deleted when fit completed


# -- one process (P = 1): what the backup holds and which one is restored -----------------------

def _one_process_fit(directory, epochs_before_crash=None, steps_per_execution=1, **kwargs):
    """A fresh model in a fresh SparseStrategy (P = 1), fit for 4 epochs of 6 steps with a
    BackupAndRestore on ``directory``; interrupted after ``epochs_before_crash`` epochs when given.
    Returns (callback, weights, epochs run)."""
    import keras

    import tfsparse

    class Crash(Exception):
        pass

    class CrashAfter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 == epochs_before_crash:
                raise Crash()

    rng = np.random.default_rng(0)
    x, y = rng.random((96, 12), dtype=np.float32), rng.integers(0, 5, 96)
    keras.utils.set_random_seed(7)
    with tfsparse.SparseStrategy("topk", 0.1, communicator=tfsparse.init()).scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(5)])
        model.compile(keras.optimizers.SGD(0.05, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=steps_per_execution)
    callback = BackupAndRestore(directory, **kwargs)
    try:
        history = model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0,
                            callbacks=[callback, CrashAfter()])
    except Crash:
        return callback, None, None
    return callback, np.concatenate([w.ravel() for w in model.get_weights()]), len(history.history["loss"])


def _progress(path):
    import h5py

    with h5py.File(path, "r") as f:
        return json.loads(f.attrs[BackupAndRestore.ATTRIBUTE])


def test_double_checkpoint_restores_the_previous_backup_when_the_latest_is_damaged(tmp_path):
    backup = tmp_path / "backup"
    _one_process_fit(backup, 2, double_checkpoint=True)
    latest, previous = backup / BackupAndRestore.LATEST, backup / BackupAndRestore.PREVIOUS
    assert _progress(latest)["epoch"] == 2 and _progress(previous)["epoch"] == 1
    latest.write_bytes(latest.read_bytes()[:2000])  # cut short
    # resumed from the previous one, and stopped again after its first epoch's backup: the damaged
    # latest one is replaced, not moved over the good previous one
    callback, _, _ = _one_process_fit(backup, 2, double_checkpoint=True)
    assert callback.restored["file"] == BackupAndRestore.PREVIOUS and callback.restored["epoch"] == 1
    assert _progress(latest)["epoch"] == 2 and _progress(previous)["epoch"] == 1
    latest.write_bytes(latest.read_bytes()[:2000])
    callback, _, epochs_run = _one_process_fit(backup, double_checkpoint=True)
    assert callback.restored["file"] == BackupAndRestore.PREVIOUS and callback.restored["epoch"] == 1
    assert epochs_run == 3 and not backup.exists()  # epochs 1 to 3, then deleted


def test_an_unreadable_backup_is_an_error_not_a_fresh_start(tmp_path):
    backup = tmp_path / "backup"
    _one_process_fit(backup, 1)
    latest = backup / BackupAndRestore.LATEST
    latest.write_bytes(latest.read_bytes()[:2000])
    with pytest.raises(OSError, match=r"the backup cannot be read on any rank: .*latest.weights.h5.*2000 bytes"):
        _one_process_fit(backup)


def test_batch_backups_record_the_batch_and_one_on_an_epochs_last_batch_resumes_exactly(tmp_path):
    _, live, _ = _one_process_fit(tmp_path / "live")
    backup = tmp_path / "backup"
    _one_process_fit(backup, 2, save_freq=4)  # backups after batches 4, 8, 12 of 6-batch epochs
    assert {k: v for k, v in _progress(backup / BackupAndRestore.LATEST).items() if k in ("epoch", "batch")} == \
        {"epoch": 2, "batch": 0}  # batch 12: the end of epoch 2
    callback, resumed, epochs_run = _one_process_fit(backup, save_freq=4, delete_checkpoint=False)
    assert callback.restored["epoch"] == 2 and epochs_run == 2
    np.testing.assert_array_equal(resumed, live)
    last = _progress(backup / BackupAndRestore.LATEST)  # kept (delete_checkpoint=False): the end of epoch 4
    assert (last["epoch"], last["batch"], last["id"]) == (4, 0, callback.restored["id"])


def test_batch_backups_count_batches_not_calls_under_steps_per_execution(tmp_path):
    """steps_per_execution=2: Keras calls on_train_batch_end once per two batches (indices 1, 3,
    5); save_freq=4 counts batches, as Keras does: backups after batches 4, 8 and 12 (the end of
    epoch 2), not after every 4th call (which left epoch 1, batch 1 -- a call count -- as the last)."""
    backup = tmp_path / "backup"
    _one_process_fit(backup, 2, steps_per_execution=2, save_freq=4)
    assert {k: v for k, v in _progress(backup / BackupAndRestore.LATEST).items() if k in ("epoch", "batch")} == \
        {"epoch": 2, "batch": 0}


def test_model_checkpoint_gathers_where_keras_saves_under_steps_per_execution(tmp_path, monkeypatch):
    """tfsparse's ModelCheckpoint gathers every rank's exchange state at exactly the batches where
    rank 0's Keras ModelCheckpoint saves, with an integer save_freq and steps_per_execution > 1."""
    import keras

    import tfsparse
    from tfsparse.keras.callbacks import ModelCheckpoint

    events = []
    monkeypatch.setattr(ModelCheckpoint, "_gather", lambda self: events.append("gather"))
    monkeypatch.setattr(keras.callbacks.ModelCheckpoint, "_save_model",
                        lambda self, epoch, batch, logs: events.append("save"))
    rng = np.random.default_rng(0)
    x, y = rng.random((96, 12), dtype=np.float32), rng.integers(0, 5, 96)
    with tfsparse.SparseStrategy("topk", 0.1, communicator=tfsparse.init()).scope():
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(5)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), steps_per_execution=2)
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
              callbacks=[ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=4)])
    # 18 batches in 9 calls: saves after batches 4, 8, 12, 16 -- each preceded by its gather
    assert events == ["gather", "save"] * 4

