"""The remote checkpoint folder (``checkpoint.remote``) as a store: its names, and the few
operations the mirror and the resume use, with every store error but a missing object turned
into one StoreUnavailable naming the URL. fsspec (and s3fs, gcsfs) are imported only here."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import uuid
from pathlib import Path
from typing import Any

from ironloop.errors import CheckpointError, UserError
from ironloop.extras import require

from .manifest import checked

MANIFESTS = "manifests"
LOGS_DIR = "logs"  # logs/step-N/<name>: the log snapshot of step N's checkpoint
# ASCII digits only: \d matches any Unicode digit and int() reads them, so a stray
# "step-٠٠٠٠٠٥٤٦.json" named step 546, whose read then failed
_MANIFEST_RE = re.compile(r"^step-([0-9]+)\.json$")
_STEP_OBJECT_RE = re.compile(r"^step-([0-9]+)\.(pt|dcp)$")
_LOG_STEP_RE = re.compile(r"^step-([0-9]+)$")
#: the most a manifest (or a rank's marker) and a lease may hold: every read of one is bounded,
#: so an object that is huge (or a file:// link to /dev/zero) is damage, not a MemoryError
MANIFEST_CAP = 16 << 20
LEASE_CAP = 64 << 10
#: errors a write to the local disk raises: a ``get`` that meets one failed on run.dir's side
#: (reading a store never raises them), so it is passed on as it is, not as a store outage
LOCAL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def is_remote(location: str | Path) -> bool:
    return isinstance(location, str) and "://" in location


# ----------------------------------------------------------------------------------- store --
#: Protocols whose top folder is a bucket: it must exist (a typo must not create a new one),
#: and objects need no parent folders.
_BUCKETED = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}


class StoreUnavailable(UserError):
    """``checkpoint.remote`` cannot be reached or used: the network, the endpoint, the
    credentials or the permissions. Not damage: a resume never falls back past it."""


class StoreLink(CheckpointError):
    """A ``file://`` store holds a symbolic link (or a device, a FIFO) where ironloop keeps a
    file or folder of its own: never followed, on a write or a read. Followed, an upload
    overwrote whatever file the link pointed to, outside the store."""


class Remote:
    """One remote checkpoint folder: paths relative to it, and the few operations used. Any
    store error but a missing object is a StoreUnavailable naming the URL."""

    def __init__(self, fs: Any, root: str, url: str):
        self.fs, self.root, self.url = fs, root.rstrip("/"), url.rstrip("/")
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else [fs.protocol]
        self.bucketed = bool(_BUCKETED & set(protocols))
        self.in_place = bool({"file", "local"} & set(protocols))  # writes truncate, then write

    @contextlib.contextmanager
    def _reaching(self, local: Path | None = None):
        """Any error of the store as a StoreUnavailable; with ``local`` (a download's
        target), a local disk error (LOCAL_DISK_ERRNOS) on that path is passed on as it is:
        the disk the download writes to failed, not the store."""
        try:
            yield
        except (FileNotFoundError, UserError):
            raise
        except OSError as e:
            if local is None or e.errno not in LOCAL_DISK_ERRNOS or not _names_local(e, local):
                raise StoreUnavailable(self._unusable(e)) from e
            raise
        except Exception as e:  # botocore, aiohttp, gcsfs: any error type of theirs
            raise StoreUnavailable(self._unusable(e)) from e

    def _unusable(self, e: BaseException) -> str:
        return (f"checkpoint.remote {self.url} cannot be used ({type(e).__name__}: "
                f"{short_error(e)}); check its endpoint, credentials and network")

    def require_bucket(self) -> None:
        """A bucket that does not exist is an error naming it: it is never created."""
        if not self.bucketed:
            return
        bucket = self.root.split("/", 1)[0]
        try:  # not fs.exists: s3fs answers False for a store it cannot reach
            with self._reaching():
                self.fs.ls(bucket, detail=False)
        except FileNotFoundError:
            raise UserError(f"checkpoint.remote {self.url}: the bucket {bucket!r} does not "
                            f"exist (or these credentials cannot see it); ironloop never "
                            f"creates one: create it, or fix the URL") from None

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def show(self, rel: str) -> str:
        """``rel`` as the user's URL spells it, for messages."""
        return f"{self.url}/{rel}"

    def _parent(self, rel: str) -> None:
        if not self.bucketed:  # s3fs's makedirs would create a missing bucket
            self.fs.makedirs(self.path(rel).rsplit("/", 1)[0], exist_ok=True)

    def put(self, local: Path, rel: str) -> None:
        with self._reaching():
            if self.in_place:  # beside it, then renamed over it: a link there is replaced
                self._replace(rel, lambda tmp: self.fs.put_file(str(local), tmp))
                return
            self._parent(rel)
            self.fs.put_file(str(local), self.path(rel))

    def write(self, rel: str, data: bytes) -> None:
        """``data`` as the object ``rel``, whole: a reader (or a second writer) never meets half
        of it. An object store's put replaces an object whole; a local (or network-mounted)
        file's write truncates it first, so there it is written beside ``rel`` and renamed
        over it (two runs claiming a ``file://`` prefix at once left their two leases
        interleaved in one file, and both were refused)."""
        with self._reaching():
            if not self.in_place:
                self._parent(rel)
                self.fs.pipe_file(self.path(rel), data)
                return
            self._replace(rel, lambda tmp: self.fs.pipe_file(tmp, data))

    def _replace(self, rel: str, write) -> None:
        """A file:// object written to a fresh name beside ``rel`` and renamed over it: the
        rename replaces a link planted at ``rel`` rather than writing through it, and no folder
        on the way may be a link (``_unlinked``)."""
        folder, _, name = rel.rpartition("/")
        tmp = f"{folder}/.{name}.tmp-{uuid.uuid4().hex}" if folder else \
            f".{name}.tmp-{uuid.uuid4().hex}"
        os.makedirs(self.root, exist_ok=True)  # the root the user named may be a link
        self._unlinked(rel, create=True)
        try:
            write(self.path(tmp))
            self._unlinked(rel)  # again: a folder swapped for a link meanwhile is refused
            # not fs.mv (shutil.move): onto a link to a folder, it moves the file into it
            os.replace(self.path(tmp), self.path(rel))
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(self.path(tmp))
            raise

    def _unlinked(self, rel: str, create: bool = False, last: bool = False) -> None:
        """file://: every folder of ``rel`` under the store's root (and with ``last``, ``rel``
        itself) is a real folder (a regular file), never a link; StoreLink naming it otherwise.
        With ``create``, missing folders are made, one at a time, each checked."""
        parts = rel.split("/")
        at = self.root
        for i, part in enumerate(parts if last else parts[:-1]):
            at = f"{at}/{part}"
            try:
                mode = os.lstat(at).st_mode
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(at)
                mode = os.lstat(at).st_mode
            folder = i < len(parts) - 1
            if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
                what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular " + (
                    "folder" if folder else "file")
                raise StoreLink(f"{self.show('/'.join(parts[:i + 1]))} is {what}; ironloop "
                                f"never writes or reads through one (it could reach a file "
                                f"outside the store): remove it")

    def read(self, rel: str, cap: int = MANIFEST_CAP) -> bytes:
        """The object ``rel``, at most ``cap`` bytes: a larger one is a CheckpointError."""
        with self._reaching():
            if self.in_place:
                self._unlinked(rel, last=True)
            data = self.fs.cat_file(self.path(rel), start=0, end=cap + 1)
        if len(data) > cap:
            raise CheckpointError(f"{self.show(rel)} is larger than {cap} bytes, which no "
                                  f"object ironloop writes there is")
        return data

    def get(self, rel: str, local: Path, size: int | None = None) -> None:
        """The object ``rel`` into ``local``; with ``size`` (its manifest's), one of any other
        size is a CheckpointError before a byte is copied."""
        with self._reaching(local):
            if self.in_place:
                self._unlinked(rel, last=True)
            if size is not None and self.fs.size(self.path(rel)) != size:
                # as the digest check after the copy says it: never a copy of unbounded size
                raise CheckpointError(f"{rel} checksum mismatch")
            self.fs.get_file(self.path(rel), str(local))

    def delete(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError), self._reaching():
            if not self.in_place:
                self.fs.rm(self.path(rel), recursive=True)
                return
            try:
                self._unlinked(rel)
            except StoreLink:  # under a link: not in the store, and nothing of ours to delete
                return
            path = self.path(rel)
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path)  # unlinks the links inside, never follows them
            else:
                os.unlink(path)  # a file, or a link planted in its place: the link goes

    def names(self, rel: str = "") -> list[str]:
        """The base names directly under ``rel`` ([] when it does not exist)."""
        self.fs.invalidate_cache()  # another process (another rank, another node) writes too
        try:
            with self._reaching():
                found = self.fs.ls(self.path(rel) if rel else self.root, detail=False)
        except FileNotFoundError:
            return []
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in found]

    def manifests(self) -> list[int]:
        """The steps with a complete checkpoint (a manifest), oldest first."""
        return sorted(int(m.group(1)) for m in map(_MANIFEST_RE.match, self.names(MANIFESTS))
                      if m)

    def manifest(self, step: int) -> dict:
        """The manifest of ``step``, its shape checked (``remote_manifest.checked``): a
        CheckpointError naming what is wrong otherwise."""
        return checked(self.read(f"{MANIFESTS}/step-{step:08d}.json"), step)

    def step_objects(self) -> dict[int, list[str]]:
        """step -> what its checkpoint holds besides the manifest: ``step-N.pt`` or
        ``step-N.dcp`` at the remote's top, and its log snapshot ``logs/step-N``."""
        found: dict[int, list[str]] = {}
        for name in self.names():
            m = _STEP_OBJECT_RE.match(name)
            if m:
                found.setdefault(int(m.group(1)), []).append(name)
        for name in self.names(LOGS_DIR):
            m = _LOG_STEP_RE.match(name)
            if m:
                found.setdefault(int(m.group(1)), []).append(f"{LOGS_DIR}/{name}")
        return found

    def remove_checkpoint(self, step: int) -> None:
        """Manifest first: from then on the checkpoint does not count, whatever is left."""
        self.delete(f"{MANIFESTS}/step-{step:08d}.json")
        for name in self.names(MANIFESTS):
            if name.startswith(f"step-{step:08d}.rank"):
                self.delete(f"{MANIFESTS}/{name}")
        for name in self.step_objects().get(step, []):
            self.delete(name)


def open_remote(url: str, options: dict | None = None) -> Remote:
    """The fsspec filesystem for ``url``; fsspec (and s3fs, gcsfs) are imported only here."""
    fsspec = require("fsspec", "remote", f"checkpoint.remote={url}")
    try:
        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    except ImportError as e:  # fsspec names the package: "Install s3fs to access S3"
        raise UserError(f"checkpoint.remote={url} needs a package that is not installed "
                        f"({str(e).splitlines()[0]}): pip install 'ironloop[remote]'") from None
    except (ValueError, TypeError) as e:
        raise UserError(f"checkpoint.remote={url} cannot be opened ({e}); check the URL and "
                        f"checkpoint.remote_options") from None
    except OSError as e:  # ftp://, sftp:// connect in the constructor: ConnectionRefusedError
        raise StoreUnavailable(f"checkpoint.remote {url} cannot be used ({type(e).__name__}: "
                               f"{short_error(e)}); check its endpoint, credentials and "
                               f"network") from e
    _refuse_unknown_options(fs, url, options or {})
    return Remote(fs, root, url)


def _refuse_unknown_options(fs, url: str, options: dict) -> None:
    """A local filesystem takes any keyword and ignores it: ``remote_options={nonsense_kw: 5}``
    on file:// was accepted, and a typo (``auto_mkdirs``) did nothing, silently. Other stores
    pass their keywords on to clients of their own, so only the local one is checked."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        return
    import inspect

    known = {n for cls in type(fs).__mro__ if "__init__" in vars(cls)
             for n, p in inspect.signature(vars(cls)["__init__"]).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"}
    known.add("skip_instance_cache")  # fsspec's instance cache reads it, not the constructor
    unknown = sorted(set(options) - known)
    if unknown:
        raise UserError(f"checkpoint.remote_options: {', '.join(unknown)} not a keyword of "
                        f"{type(fs).__name__} (checkpoint.remote={url}); it takes "
                        f"{', '.join(sorted(known)) or 'none'}: remove the key or fix its name")


def _names_local(e: OSError, local: Path) -> bool:
    """Whether an OSError is the local target's: it names ``local`` (shutil names the source
    and the target of a copy) or no path at all (a write into an open file)."""
    paths = [os.fsdecode(p) for p in (e.filename, e.filename2) if isinstance(p, (str, bytes))]
    return not paths or os.path.abspath(local) in map(os.path.abspath, paths)


def short_error(e: BaseException) -> str:
    if isinstance(e, StoreUnavailable) and e.__cause__ is not None:  # the store's own words
        e = e.__cause__
    text = (str(e).strip().splitlines() or [""])[0] or type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
