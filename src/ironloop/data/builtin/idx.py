"""Fashion-MNIST as IDX files, read with numpy only (no torchvision).

IDX is the format Yann LeCun's MNIST used and Fashion-MNIST copied: two zero bytes, a dtype code,
the number of dims, one big-endian uint32 per dim, then the raw big-endian payload. Reading it
ourselves keeps torchvision out of the dependency tree, and checking the header against the
payload size turns a half-downloaded file into a clear error instead of a reshape traceback.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.request
import zlib
from pathlib import Path

import numpy as np

from ironloop.errors import DataError

# IDX dtype code -> numpy dtype (always big-endian on disk).
_CODES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_GZIP_MAGIC = b"\x1f\x8b"

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
MD5 = {
    "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
    "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
    "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
}
MIRRORS = [
    "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
]
_REDOWNLOAD = "the file is truncated or damaged, delete it and download again"


def read_idx(path: Path) -> np.ndarray:
    """Read a raw or gzipped IDX file into a native-byte-order array.

    Gzip is detected by its magic bytes, not the suffix, because people gunzip files and keep
    the name (or the reverse). Every failure is a DataError naming the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            gzipped = f.read(2) == _GZIP_MAGIC
        with (gzip.open(path, "rb") if gzipped else open(path, "rb")) as f:
            data = f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise DataError(f"{path}: cannot decompress ({e}); {_REDOWNLOAD}") from None
    except OSError as e:  # missing, a directory, no permission
        raise DataError(f"{path}: cannot read ({e.strerror or e}); check the path") from None
    if len(data) < 4:
        raise DataError(f"{path}: not an IDX file (only {len(data)} bytes, shorter than the header)"
                        f"; {_REDOWNLOAD}")
    code, ndim = data[2], data[3]
    if data[:2] != b"\0\0" or code not in _CODES or not 1 <= ndim <= 4:
        magic = int.from_bytes(data[:4], "big")
        raise DataError(f"{path}: not an IDX file (bad magic number 0x{magic:08x}); "
                        "point the config at a Fashion-MNIST IDX file")
    start = 4 + 4 * ndim
    if len(data) < start:
        raise DataError(f"{path}: wrong size: header is cut short ({len(data)} bytes); "
                        + _REDOWNLOAD)
    dims = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    dtype = np.dtype(_CODES[code])
    want = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    have = len(data) - start
    if want != have:
        raise DataError(f"{path}: wrong size: header says dims {dims} = {want} bytes of data, "
                        f"file has {have}; {_REDOWNLOAD}")
    array = np.frombuffer(data, dtype=dtype, offset=start).reshape(dims)
    return array.astype(dtype.newbyteorder("="))  # a native, writable copy


def write_idx(path: Path, array: np.ndarray, gz: bool | None = None) -> None:
    """Write `array` as IDX (the inverse of read_idx); gzip when gz, by default when path ends .gz.

    Written to a temp file and renamed, so a crash never leaves a half file that looks valid.
    The gzip mtime is fixed at 0 so the same array always gives the same bytes (stable MD5).
    """
    path, array = Path(path), np.asarray(array)
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _CODES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None or not 1 <= array.ndim <= 4:
        raise ValueError(f"{path}: IDX cannot hold dtype {array.dtype} with {array.ndim} dims; "
                         f"use one of {sorted(str(d) for d in codes)} with 1 to 4 dims")
    gz = path.suffix == ".gz" if gz is None else gz
    payload = bytes([0, 0, code, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    payload += np.ascontiguousarray(array, dtype=np.dtype(_CODES[code])).tobytes()
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        if gz:
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as g:
                g.write(payload)
        else:
            f.write(payload)
    os.replace(tmp, path)


def _dirs(root: Path) -> list[Path]:
    """Where we look: the flat layout, then torchvision's `FashionMNIST/raw/` (reuse its cache)."""
    return [root, root / "FashionMNIST" / "raw"]


def find_file(root: Path, stem: str) -> Path | None:
    """First of stem, stem.gz in root, then in root/FashionMNIST/raw; None if none exists.

    Within one folder the raw file wins over the .gz: it is the same data and faster to read
    (torchvision keeps both after extracting).
    """
    for d in _dirs(Path(root)):
        for name in (stem, stem + ".gz"):
            if (d / name).is_file():
                return d / name
    return None


def md5_file(path: Path, chunk: int = 1 << 20) -> str:
    """MD5 hex digest of a file, read in chunks so large files do not sit in memory."""
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download(root: Path, timeout: float = 30.0) -> None:
    """Download the Fashion-MNIST .gz files that find_file cannot find under root.

    Each mirror is tried in turn; the file goes to a temp file in root, its MD5 is checked, and
    only then is it renamed into place, so a bad or partial download never sits under the real
    name. A checksum mismatch on one mirror moves on to the next (one mirror may be corrupt).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for name, expected in MD5.items():
        if find_file(root, name[: -len(".gz")]) is not None:
            continue
        failures = []
        for mirror in MIRRORS:
            url = mirror + name
            fd, tmp = tempfile.mkstemp(dir=root, prefix=name + ".", suffix=".part")
            try:
                with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as r:
                    while block := r.read(1 << 20):
                        out.write(block)
                got = md5_file(Path(tmp))
                if got == expected:
                    os.replace(tmp, root / name)
                    break
                failures.append(f"{url} (checksum mismatch: expected MD5 {expected}, got {got})")
            except (OSError, http.client.HTTPException) as e:  # URLError, timeouts, refusals
                failures.append(f"{url} ({getattr(e, 'reason', None) or e})")
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        else:
            by_hand = ", ".join(" or ".join(m + n for m in MIRRORS) for n in MD5)
            raise DataError(f"{root / name}: could not download {name}: " + "; ".join(failures)
                            + f". Download the four files by hand into {root}: {by_hand}")


def load_fashion_mnist(root: Path, download: bool = False) -> dict[str, np.ndarray]:
    """Load Fashion-MNIST from root as {"x_train", "y_train", "x_test", "y_test"}.

    Images are uint8 (N, H, W); labels are int64 (N,), ready for cross-entropy. Files may be
    raw or gzipped, flat in root or in torchvision's FashionMNIST/raw. When download is true,
    missing files are fetched first. Shapes and label ranges are checked so a mismatched pair
    of files fails here, naming them, rather than as an index error mid-epoch.
    """
    root = Path(root)
    paths = {k: find_file(root, stem) for k, stem in FILES.items()}
    if download and None in paths.values():
        globals()["download"](root)  # the parameter shadows the function
        paths = {k: find_file(root, stem) for k, stem in FILES.items()}
    missing = [FILES[k] + "[.gz]" for k, p in paths.items() if p is None]
    if missing:
        looked = " and ".join(str(d) for d in _dirs(root))
        raise DataError(f"{root}: Fashion-MNIST files missing: {', '.join(missing)} "
                        f"(looked in {looked}); put the four IDX files (gzipped or raw) there, "
                        "or set data.download=true")
    out = {}
    for split in ("train", "test"):
        xp, yp = paths[f"{split}_images"], paths[f"{split}_labels"]
        assert xp is not None and yp is not None  # found above, or DataError
        x, y = read_idx(xp), read_idx(yp)
        if x.ndim != 3 or y.ndim != 1 or x.shape[0] != y.shape[0] or y.shape[0] == 0:
            raise DataError(f"{xp} and {yp} do not match: images have shape {x.shape}, labels "
                            f"{y.shape}; expected (N, H, W) and (N,) with N > 0, replace them "
                            "with a matching pair of Fashion-MNIST files")
        if x.dtype != np.uint8 or not np.issubdtype(y.dtype, np.integer):
            raise DataError(f"{xp} and {yp}: expected uint8 images and integer labels, got "
                            f"{x.dtype} and {y.dtype}; replace them with Fashion-MNIST files")
        if y.min() < 0 or y.max() >= 10:
            raise DataError(f"{yp}: labels must be 0..9, found {int(y.min())}..{int(y.max())}; "
                            "this is not a Fashion-MNIST label file, replace it")
        out[f"x_{split}"], out[f"y_{split}"] = x, y.astype(np.int64)
    return out
