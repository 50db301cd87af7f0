"""Tests for ironloop.data.builtin.idx: IDX parsing, Fashion-MNIST loading, download (local
server only)."""

from __future__ import annotations

import functools
import gzip
import http.server
import threading
from pathlib import Path

import numpy as np
import pytest

from ironloop.data.builtin import idx
from ironloop.data.builtin.idx import (
    FILES,
    MD5,
    find_file,
    load_fashion_mnist,
    md5_file,
    read_idx,
    write_idx,
)
from ironloop.errors import DataError, UserError

# The two official label files (MIT licence, Zalando SE) ship with the tests: a fresh clone
# needs nothing beside it.
LABELS = Path(__file__).resolve().parent / "fashion-mnist"


# --- round trips and the on-disk format -------------------------------------------------------

@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("array", [
    np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28),
    np.array([0, 9, 3, 255], dtype=np.uint8),
    np.linspace(-1.5, 2.5, 12, dtype=np.float32).reshape(3, 4),
    np.array([[-300, 7], [32000, -1]], dtype=np.int16),
    np.array([-5, 0, 2**31 - 1], dtype=np.int32),
    np.array([1e-300, -2.5], dtype=np.float64),
    np.array([-128, 127], dtype=np.int8),
], ids=["u8-3d", "u8-1d", "f32-2d", "i16", "i32", "f64", "i8"])
def test_round_trip(tmp_path, array, gz):
    path = tmp_path / ("a.idx.gz" if gz else "a.idx")
    write_idx(path, array)
    assert (path.read_bytes()[:2] == b"\x1f\x8b") == gz  # gz defaults from the suffix
    back = read_idx(path)
    assert back.dtype == array.dtype and back.dtype.isnative
    assert back.shape == array.shape
    np.testing.assert_array_equal(back, array)
    back[...] = 0  # writable: not a view on an immutable buffer


def test_header_bytes_are_big_endian_idx(tmp_path):
    write_idx(tmp_path / "x", np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8))
    assert (tmp_path / "x").read_bytes() == bytes.fromhex("00000802 00000002 00000003 010203040506")
    # a hand-made int32 file: values must come out big-endian-decoded
    (tmp_path / "y").write_bytes(bytes.fromhex("00000c01 00000002 00000001 fffffffe"))
    np.testing.assert_array_equal(read_idx(tmp_path / "y"), np.array([1, -2], dtype=np.int32))


def test_gzip_detected_by_magic_not_suffix(tmp_path):
    a = np.arange(10, dtype=np.uint8)
    write_idx(tmp_path / "gz-without-suffix", a, gz=True)
    write_idx(tmp_path / "raw-with-suffix.gz", a, gz=False)
    # an explicit gz wins over the name's suffix
    assert (tmp_path / "gz-without-suffix").read_bytes()[:2] == b"\x1f\x8b"
    assert (tmp_path / "raw-with-suffix.gz").read_bytes()[:4] == bytes([0, 0, 8, 1])
    np.testing.assert_array_equal(read_idx(tmp_path / "gz-without-suffix"), a)
    np.testing.assert_array_equal(read_idx(tmp_path / "raw-with-suffix.gz"), a)


def test_gzip_output_is_reproducible(tmp_path):
    write_idx(tmp_path / "a.gz", np.arange(5, dtype=np.uint8))
    assert (tmp_path / "a.gz").read_bytes()[4:8] == bytes(4)  # gzip mtime 0: stable MD5


def test_write_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="IDX cannot hold"):
        write_idx(tmp_path / "x", np.zeros(3, dtype=np.uint32))
    with pytest.raises(ValueError, match="IDX cannot hold"):
        write_idx(tmp_path / "x", np.zeros((1,) * 5, dtype=np.uint8))


# --- damaged files ------------------------------------------------------------------------------

@pytest.mark.parametrize("head,magic", [
    (bytes.fromhex("12340801 00000001 00"), "0x12340801"),   # first two bytes not zero
    (bytes.fromhex("00000701 00000001 00"), "0x00000701"),   # unknown dtype code
    (bytes.fromhex("00000800 00"), "0x00000800"),            # ndim 0
    (bytes.fromhex("00000805") + bytes(20), "0x00000805"),   # ndim 5
])
def test_bad_magic(tmp_path, head, magic):
    path = tmp_path / "bad-magic-idx"
    path.write_bytes(head)
    want = (f"bad-magic-idx: not an IDX file \\(bad magic number {magic}\\); point the config "
            "at a Fashion-MNIST IDX file$")
    with pytest.raises(DataError, match=want):
        read_idx(path)


def test_too_short_for_header(tmp_path):
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "cut-dims").write_bytes(bytes.fromhex("00000803 00000002"))
    with pytest.raises(DataError, match="empty: not an IDX file"):
        read_idx(tmp_path / "empty")
    with pytest.raises(DataError, match="cut-dims: wrong size"):
        read_idx(tmp_path / "cut-dims")


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_payload(tmp_path, gz):
    raw = tmp_path / "imgs"
    write_idx(raw, np.ones((5, 28, 28), dtype=np.uint8), gz=False)
    data = raw.read_bytes()[:-100]
    path = tmp_path / ("short-idx3-ubyte" + (".gz" if gz else ""))
    path.write_bytes(gzip.compress(data) if gz else data)  # a complete gzip of a short payload
    with pytest.raises(DataError) as e:
        read_idx(path)
    msg = str(e.value)
    assert str(path) in msg and "wrong size" in msg
    assert "(5, 28, 28) = 3920 bytes of data, file has 3820" in msg
    assert "delete it and download again" in msg
    assert isinstance(e.value, UserError)



def test_each_dimension_is_read_as_a_whole_32_bit_big_endian_count(tmp_path):
    # A count of 2**24 + 1 has a byte beyond the low three: a parser that dropped the top byte
    # would read 1 item and take this one-byte file as complete.
    path = tmp_path / "huge-count-idx1-ubyte"
    path.write_bytes(bytes.fromhex("00000801") + (2**24 + 1).to_bytes(4, "big") + b"\x07")
    with pytest.raises(DataError, match=r"dims \(16777217,\) = 16777217 bytes of data, file has 1"):
        read_idx(path)

def test_truncated_gz(tmp_path):
    path = tmp_path / "cut-idx3-ubyte.gz"
    rng = np.random.default_rng(0)
    write_idx(path, rng.integers(0, 256, (20, 28, 28), dtype=np.uint8))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DataError, match="cut-idx3-ubyte.gz: cannot decompress"):
        read_idx(path)


def test_missing_file_is_data_error(tmp_path):
    with pytest.raises(DataError, match="nope-idx: cannot read"):
        read_idx(tmp_path / "nope-idx")


# --- the real official label files ---------------------------------------------------------------

@pytest.mark.parametrize("name,n", [("train-labels-idx1-ubyte.gz", 60000),
                                    ("t10k-labels-idx1-ubyte.gz", 10000)])
def test_real_label_files(name, n):
    path = LABELS / name
    assert path.is_file(), f"{path} missing: the official label files must sit in {LABELS}"
    assert md5_file(path) == MD5[name]
    assert md5_file(path, chunk=4096) == MD5[name]  # chunking does not change the digest
    y = read_idx(path)
    assert y.dtype == np.uint8 and y.shape == (n,)
    np.testing.assert_array_equal(np.bincount(y, minlength=10), [n // 10] * 10)


# --- load_fashion_mnist ------------------------------------------------------------------------

def make_dataset(root: Path, gz: bool, n_train=50, n_test=20, seed=0) -> dict[str, np.ndarray]:
    """Write a small synthetic Fashion-MNIST to root; return the arrays."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    root.mkdir(parents=True, exist_ok=True)
    for key, a in arrays.items():
        write_idx(root / (FILES[key] + (".gz" if gz else "")), a)
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("sub", ["", "FashionMNIST/raw"], ids=["flat", "torchvision"])
def test_load(tmp_path, sub, gz):
    arrays = make_dataset(tmp_path / sub, gz)
    d = load_fashion_mnist(tmp_path)
    assert set(d) == {"x_train", "y_train", "x_test", "y_test"}
    assert d["x_train"].shape == (50, 28, 28) and d["x_train"].dtype == np.uint8
    assert d["x_test"].shape == (20, 28, 28)
    assert d["y_train"].shape == (50,) and d["y_train"].dtype == np.int64
    np.testing.assert_array_equal(d["x_train"], arrays["train_images"])
    np.testing.assert_array_equal(d["y_train"], arrays["train_labels"])
    np.testing.assert_array_equal(d["x_test"], arrays["test_images"])
    np.testing.assert_array_equal(d["y_test"], arrays["test_labels"])


def test_find_file_order(tmp_path):
    stem = FILES["train_labels"]
    assert find_file(tmp_path, stem) is None
    raw = tmp_path / "FashionMNIST" / "raw"
    make_dataset(raw, gz=True)
    assert find_file(tmp_path, stem) == raw / (stem + ".gz")
    make_dataset(raw, gz=False)
    assert find_file(tmp_path, stem) == raw / stem  # raw beats .gz in the same folder
    make_dataset(tmp_path, gz=True)
    assert find_file(tmp_path, stem) == tmp_path / (stem + ".gz")  # root beats FashionMNIST/raw


def test_missing_files(tmp_path):
    make_dataset(tmp_path, gz=True)
    (tmp_path / (FILES["test_images"] + ".gz")).unlink()
    with pytest.raises(DataError) as e:
        load_fashion_mnist(tmp_path, download=False)
    msg = str(e.value)
    assert "t10k-images-idx3-ubyte" in msg and "train-images-idx3-ubyte" not in msg
    assert str(tmp_path) in msg and str(tmp_path / "FashionMNIST" / "raw") in msg
    assert "data.download=true" in msg and "\n" not in msg


def test_empty_root_lists_all_four(tmp_path):
    with pytest.raises(DataError) as e:
        load_fashion_mnist(tmp_path / "nothing")
    assert all(stem in str(e.value) for stem in FILES.values())


@pytest.mark.parametrize("key,array,bad", [
    ("train_labels", np.zeros(49, np.uint8), "train-labels"),          # N differs
    ("train_images", np.zeros((50, 784), np.uint8), "train-images"),   # not (N, H, W)
    ("test_labels", np.zeros((20, 1), np.uint8), "t10k-labels"),       # not 1-D
    ("test_images", np.zeros((20, 28, 28), np.float32), "t10k-images"),  # not uint8
])
def test_inconsistent_pair(tmp_path, key, array, bad):
    make_dataset(tmp_path, gz=False)
    write_idx(tmp_path / FILES[key], array)
    split = key.split("_")[0]
    with pytest.raises(DataError) as e:
        load_fashion_mnist(tmp_path)
    msg = str(e.value)
    assert bad in msg
    assert FILES[f"{split}_images"] in msg and FILES[f"{split}_labels"] in msg
    assert msg.endswith("replace them with Fashion-MNIST files" if array.dtype != np.uint8
                        else "replace them with a matching pair of Fashion-MNIST files")


def test_label_out_of_range(tmp_path):
    make_dataset(tmp_path, gz=False)
    labels = np.zeros(20, np.uint8)
    labels[3] = 10
    write_idx(tmp_path / FILES["test_labels"], labels)
    with pytest.raises(DataError) as e:
        load_fashion_mnist(tmp_path)
    assert str(e.value).endswith("t10k-labels-idx1-ubyte: labels must be 0..9, found 0..10; "
                                 "this is not a Fashion-MNIST label file, replace it")


def test_load_does_not_download_when_present(tmp_path, monkeypatch):
    make_dataset(tmp_path, gz=True)
    monkeypatch.setattr(idx, "download", lambda *a, **k: pytest.fail("download called"))
    assert load_fashion_mnist(tmp_path, download=True)["x_test"].shape == (20, 28, 28)


# --- download, against a local server only ----------------------------------------------------

@pytest.fixture
def server(tmp_path, monkeypatch):
    """An HTTP server on 127.0.0.1 serving tmp_path/served; yields (base_url, served_dir)."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def test_download_ok(tmp_path, server, monkeypatch):
    url, served = server
    arrays = make_dataset(served, gz=True)
    monkeypatch.setattr(idx, "MD5", {n: md5_file(served / n) for n in MD5})
    monkeypatch.setattr(idx, "MIRRORS", ["http://127.0.0.1:1/", url])  # first refuses: fall back
    root = tmp_path / "root"
    d = load_fashion_mnist(root, download=True)
    assert sorted(p.name for p in root.iterdir()) == sorted(MD5)  # nothing else (no .part)
    for n in MD5:
        assert md5_file(root / n) == idx.MD5[n]
    np.testing.assert_array_equal(d["x_train"], arrays["train_images"])
    np.testing.assert_array_equal(d["y_test"], arrays["test_labels"])


def test_download_fetches_only_missing(tmp_path, server, monkeypatch):
    url, served = server
    make_dataset(served, gz=True)
    monkeypatch.setattr(idx, "MD5", {n: md5_file(served / n) for n in MD5})
    monkeypatch.setattr(idx, "MIRRORS", [url])
    root = tmp_path / "root"
    make_dataset(root / "FashionMNIST" / "raw", gz=False, seed=1)
    (root / "FashionMNIST" / "raw" / FILES["test_labels"]).unlink()
    idx.download(root, timeout=5)
    assert [p.name for p in root.iterdir() if p.is_file()] == ["t10k-labels-idx1-ubyte.gz"]


def test_download_checksum_mismatch(tmp_path, server, monkeypatch):
    url, served = server
    make_dataset(served, gz=True)
    monkeypatch.setattr(idx, "MIRRORS", [url])  # real MD5s: the synthetic files cannot match
    root = tmp_path / "root"
    with pytest.raises(DataError) as e:
        idx.download(root, timeout=5)
    msg = str(e.value)
    assert "checksum mismatch" in msg and "train-images-idx3-ubyte.gz" in msg
    assert MD5["train-images-idx3-ubyte.gz"] in msg
    assert md5_file(served / "train-images-idx3-ubyte.gz") in msg
    assert list(root.iterdir()) == []  # the bad download was deleted


@pytest.mark.parametrize("mirror", ["http://127.0.0.1:1/", "served-404"])
def test_download_unreachable(tmp_path, server, monkeypatch, mirror):
    url, _ = server  # serves an empty folder: every file is a 404
    mirror = url if mirror == "served-404" else mirror
    monkeypatch.setattr(idx, "MIRRORS", [mirror])
    root = tmp_path / "root"
    with pytest.raises(DataError) as e:
        idx.download(root, timeout=5)
    msg = str(e.value)
    name = "train-images-idx3-ubyte.gz"
    assert f"could not download {name}: {mirror}{name}" in msg
    assert f"by hand into {root}" in msg
    assert all(mirror + n in msg for n in MD5)  # lists every URL to fetch by hand
    assert list(root.iterdir()) == []


def test_a_failed_download_names_each_mirrors_reason_and_makes_a_nested_root(tmp_path,
                                                                             monkeypatch):
    import http.client
    import urllib.error

    errors = iter([urllib.error.URLError("connection refused"),
                   http.client.RemoteDisconnected("closed early")])

    def urlopen(url, timeout):
        raise next(errors)

    monkeypatch.setattr(idx.urllib.request, "urlopen", urlopen)
    monkeypatch.setattr(idx, "MIRRORS", ["http://a/", "http://b/"])
    root = tmp_path / "new" / "root"
    with pytest.raises(DataError) as e:
        idx.download(root)
    name = "train-images-idx3-ubyte.gz"
    assert str(e.value).startswith(
        f"{root / name}: could not download {name}: http://a/{name} (connection refused); "
        f"http://b/{name} (closed early). Download the four files by hand into {root}: ")
    assert list(root.iterdir()) == []
