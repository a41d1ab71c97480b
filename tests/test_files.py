"""tfsparse.files: a file is replaced whole or not at all, and a truncated Keras file says so."""
import zipfile

import pytest

from tfsparse import files


def test_replacing_renames_only_a_complete_file(tmp_path):
    path = tmp_path / "sub" / "result.json"
    files.write_text(path, "old")
    with pytest.raises(RuntimeError, match="writer failed"):
        with files.replacing(path) as tmp:
            tmp.write_text("half of the ne")
            raise RuntimeError("writer failed")
    assert path.read_text() == "old"
    assert not files.partial_path(path).exists()  # the partial file is removed
    files.write_bytes(path, b"new")
    assert path.read_bytes() == b"new" and sorted(p.name for p in path.parent.iterdir()) == ["result.json"]


def test_a_failed_flush_leaves_the_old_file(tmp_path, monkeypatch):
    """fsync's EIO or ENOSPC (a network file system may report a failed write-back only there)
    keeps the old file and says so; a file system that cannot fsync (EINVAL) is not an error."""
    import errno
    import os

    path = tmp_path / "latest.weights.h5"
    files.write_bytes(path, b"good")
    real = os.fsync
    for code in (errno.EIO, errno.ENOSPC):
        def failing(fd, code=code):
            raise OSError(code, os.strerror(code))
        monkeypatch.setattr(os, "fsync", failing)
        with pytest.raises(OSError, match="may not be on disk") as info:
            files.write_bytes(path, b"damaged")
        assert info.value.errno == code
        assert path.read_bytes() == b"good" and sorted(p.name for p in tmp_path.iterdir()) == [path.name]

    def unsupported(fd):
        raise OSError(errno.EINVAL, "Invalid argument")
    monkeypatch.setattr(os, "fsync", unsupported)
    files.write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    monkeypatch.setattr(os, "fsync", real)


def test_the_temporary_file_keeps_the_destinations_suffixes(tmp_path):
    assert files.partial_path(tmp_path / "ckpt.weights.h5").name.endswith(".weights.h5")
    assert files.partial_path(tmp_path / "a.keras").parent == tmp_path
    with pytest.raises(FileNotFoundError, match="nothing was written"):
        with files.replacing(tmp_path / "a.keras"):
            pass


def test_check_saved_file_tells_truncated_from_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        files.check_saved_file(tmp_path / "missing.keras")
    good = tmp_path / "good.keras"
    with zipfile.ZipFile(good, "w") as z:
        z.writestr("config.json", "{}" * 5000)
    files.check_saved_file(good)
    cut = tmp_path / "cut.keras"
    cut.write_bytes(good.read_bytes()[:300])
    with pytest.raises(files.TruncatedFile, match=r"cut.keras \(300 bytes\) is not a complete .keras file"):
        files.check_saved_file(cut)
    other = tmp_path / "w.weights.h5"
    other.write_bytes(b"not hdf5")
    with pytest.raises(files.TruncatedFile, match="is not an HDF5 file"):
        files.check_saved_file(other)


def test_loading_a_truncated_checkpoint_says_so(tmp_path):
    import keras

    import tfsparse.keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.save(tmp_path / "m.keras")
    model.save_weights(tmp_path / "m.weights.h5")
    assert isinstance(tfsparse.keras.load_model(tmp_path / "m.keras"), keras.Model)
    for name, load in (("m.keras", tfsparse.keras.load_model),
                       ("m.weights.h5", lambda p: tfsparse.keras.load_weights(model, p))):
        cut = tmp_path / f"cut-{name}"
        cut.write_bytes((tmp_path / name).read_bytes()[:3119])
        with pytest.raises(files.TruncatedFile, match="3119 bytes"):
            load(cut)

