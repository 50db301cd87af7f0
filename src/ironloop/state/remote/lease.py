"""One writer per ``checkpoint.remote`` prefix: the lease object ``lease.json``.

Two runs writing one prefix delete each other's checkpoints (retention, a resume's discard of
an abandoned future). So rank 0 claims the prefix before it deletes or uploads anything there:

* ``lease.json`` names the lineage (the run as its user knows it, kept across resumes), this
  process's run id, its host and pid, and when it was last refreshed; the mirror refreshes it
  every ``TTL_S / 3`` while the run lives and marks it released at the end (``Lease``);
* a fresh run refuses a prefix whose lease is live (the "already holds a run's checkpoints"
  refusal in prepare.py covers the runs that ended);
* a resume takes over a released or expired lease of its own lineage and keeps it (run.dir
  records the lineage its checkpoints belong to: ``checkpoints/remote-lineage``; a new node
  with an empty run.dir adopts the prefix's). A live one it watches for up to ``TTL_S``: a
  killed run's lease expires (on the same host at once, when its pid is gone), a live run
  refreshes it, and then the resume is refused, naming it. A prefix of another lineage is
  refused: the resume would delete that run's checkpoints past its own step;
* an object store has no compare-and-swap, so after writing its lease a run waits
  ``SETTLE_S`` and reads it back: of two runs that started together, the one whose write
  landed last goes on and the other is refused. That assumes each run's write lands within
  ``SETTLE_S`` of the read that found the prefix free: a run stalled longer in between (a
  swapping host, a store that answers in seconds) can write after the other's read-back, and
  both go on; the first one's refresher then finds the other's lease and deletes nothing more.

Times are each host's wall clock: hosts whose clocks differ by more than ``TTL_S`` can
misjudge a lease. Every byte of ``lease.json`` is untrusted, as a manifest's is (``checked``):
one of the wrong shape names nobody (one line, and the prefix is free); one refreshed more than
``SKEW_S`` ahead of this host's clock (a node whose clock ran ahead, then died) is expired,
saying so; so a resume waits at most ``TTL_S`` for any lease, as the docs promise.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ironloop.errors import CheckpointError, UserError
from ironloop.state.io import write_atomic
from ironloop.state.lock import alive

from .store import LEASE_CAP, Remote, StoreUnavailable

LEASE = "lease.json"
RECORD = "remote-lineage"  # in run.dir/checkpoints: the lineage its checkpoints belong to
TTL_S = 30.0  # a lease not refreshed for this long belongs to a run that is gone
SKEW_S = 5.0  # a lease refreshed further ahead of this host's clock is expired, not live
SETTLE_S = 0.5  # how long two concurrent claims have to both land before either reads back
_POLL_S = 1.0
_live: set[str] = set()  # run ids whose lease this process holds now


@dataclass
class Lease:
    """What ``lease.json`` holds, and (for this process's own) its refresher."""

    lineage: str
    run: str = field(default_factory=lambda: uuid.uuid4().hex)
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    refreshed: float = field(default_factory=time.time)
    released: bool = False

    def ahead(self) -> float:
        """How far ``refreshed`` is ahead of this host's clock (0 when it is not)."""
        return max(0.0, self.refreshed - time.time())

    def who(self) -> str:
        return f"run {self.run[:8]} (pid {self.pid} on {self.host})"

    def live(self) -> bool:
        if self.released or time.time() > self.refreshed + TTL_S or self.ahead() > SKEW_S:
            return False
        if self.host == socket.gethostname() and self.run not in _live:
            return self.pid != os.getpid() and alive(self.pid)  # ours, or killed: gone
        return True


def read(remote: Remote) -> Lease | None:
    """The prefix's lease, or None: none yet, or one too garbled to name anybody (``look``)."""
    return look(remote)[0]


def look(remote: Remote) -> tuple[Lease | None, str]:
    """The prefix's lease, or None and why it names nobody ("" when there is none)."""
    try:
        data = remote.read(LEASE, cap=LEASE_CAP)
    except FileNotFoundError:
        return None, ""
    except CheckpointError as e:  # larger than any lease, or a file:// link
        return None, str(e)
    return checked(data)


def _tell(remote: Remote, found: Lease | None, say: Callable[[str], object]) -> None:
    """One line for a lease that names nobody, or that was refreshed in this host's future."""
    if found is None:
        why = look(remote)[1]
        if why:
            say(f"notice: {remote.show(LEASE)} names no run ({why}): the prefix is taken as "
                f"free")
    elif found.ahead() > SKEW_S and not found.released:
        say(f"notice: the lease {remote.show(LEASE)} was refreshed {found.ahead():.0f} s ahead "
            f"of this host's clock (its host's clock runs ahead; more than {SKEW_S:g} s is no "
            f"live run's): treated as expired")


_TYPES = {"lineage": str, "run": str, "host": str, "pid": int, "refreshed": float,
          "released": bool}


def checked(data: bytes) -> tuple[Lease | None, str]:
    """``lease.json``'s bytes as a Lease when each key has its type (``refreshed`` a finite
    number, ``pid`` a positive int), else None and what is wrong, in a few words."""
    try:
        found = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None, "it is not JSON"
    if not isinstance(found, dict):
        return None, "it is not a JSON object"
    for key, kind in _TYPES.items():
        if not _fits(found.get(key), kind):
            return None, f"its {key} is {str(found.get(key))[:40]!r}"
    return Lease(**{k: found[k] for k in _TYPES}), ""


def _fits(value: Any, kind: type) -> bool:
    if isinstance(value, bool) or kind is bool:  # JSON's true is no number, nor a pid
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and value > 0
    return isinstance(value, str) and 0 < len(value) <= 255


def claim(remote: Remote, resume: bool, say: Callable[[str], object] = print,
          lineage: str | None = None) -> Holder:
    """Claim ``remote`` for this run (rank 0, before anything there is deleted or uploaded),
    or raise a UserError naming the run that holds it. ``lineage``: a resume's, as run.dir
    recorded it (``recorded``); None for a new node's empty run.dir."""
    earlier = _claimed.get(remote.url)
    if earlier is not None and earlier.started is False:  # a run of this process was refused
        earlier.release()
    found = read(remote)
    _tell(remote, found, say)
    if found is not None and found.live():
        if not resume:
            ago = max(0.0, time.time() - found.refreshed)  # another host's clock may run ahead
            raise UserError(f"checkpoint.remote {remote.url} is in use by {found.who()}, "
                            f"whose lease was refreshed {ago:.0f} s ago; wait for that run to "
                            f"end, or choose another checkpoint.remote")
        _wait_out(remote, found, say)
    if resume and found is not None and lineage is not None and found.lineage != lineage:
        raise UserError(f"checkpoint.remote {remote.url} holds the checkpoints of another run "
                        f"(lineage {found.lineage[:8]}, last written by {found.who()}), not "
                        f"of the run this run.dir resumes (lineage {lineage[:8]}), and the "
                        f"resume would delete its checkpoints past this run's step; resume "
                        f"that run on an empty run.dir, or give this run its own "
                        f"checkpoint.remote")
    if resume and found is not None:
        lineage = found.lineage
    mine = Lease(lineage=lineage if resume and lineage else uuid.uuid4().hex)
    _write(remote, mine)
    time.sleep(SETTLE_S)  # see the module's docstring: the write that landed last wins
    back = read(remote)
    if back is None or back.run != mine.run:
        raise UserError(f"checkpoint.remote {remote.url} was claimed by "
                        f"{back.who() if back else 'another run'} at the same moment as this "
                        f"run; one writer per prefix: choose another checkpoint.remote, or "
                        f"resume that one")
    return Holder(remote, mine)


def _wait_out(remote: Remote, found: Lease, say: Callable[[str], object]) -> None:
    """Until ``found`` expires (its run was killed): or a UserError when it is refreshed, or
    names a process that runs on this host."""
    if found.host == socket.gethostname():  # live() saw its pid running
        raise _in_use(remote, found, "runs on this host")
    until = min(found.refreshed, time.time()) + TTL_S  # never past TTL_S: see live()
    say(f"notice: checkpoint.remote {remote.url} is leased to {found.who()}; waiting up to "
        f"{until - time.time():.0f} s for the lease to expire, as a killed run's does")
    while time.time() <= until:
        time.sleep(_POLL_S)
        now = read(remote)
        if now is None or now.released:
            return
        if now.run != found.run or now.refreshed != found.refreshed:
            raise _in_use(remote, now, "refreshed its lease just now")


def _in_use(remote: Remote, lease: Lease, how: str) -> UserError:
    return UserError(f"checkpoint.remote {remote.url} is in use by {lease.who()}, which {how}; "
                     f"a second writer would delete its checkpoints: wait for it to end (or "
                     f"stop it), or choose another checkpoint.remote")


def _write(remote: Remote, lease: Lease) -> None:
    remote.write(LEASE, json.dumps(asdict(lease)).encode())


class Holder:
    """This run's lease: refreshed in a thread of its own, so the loop never waits on it;
    ``owned`` turns False for good when another run took the prefix over (this one stalled
    past ``TTL_S``): the mirror then deletes nothing there."""

    def __init__(self, remote: Remote, lease: Lease):
        self.remote, self.lease, self.owned = remote, lease, True
        self._stop = threading.Event()
        self.started = False  # the mirror refreshes it: the run got past its start
        _live.add(lease.run)
        _claimed[remote.url] = self

    def start(self, warn: Callable[[str], object]) -> None:
        self.started = True
        threading.Thread(target=self._refresh, args=(warn,), daemon=True,
                         name="ironloop-remote-lease").start()

    def _refresh(self, warn: Callable[[str], object]) -> None:
        while not self._stop.wait(TTL_S / 3):
            try:
                now = read(self.remote)
                if now is not None and now.run != self.lease.run:
                    self.owned = False
                    warn(f"warning: checkpoint.remote {self.remote.url} was taken over by "
                         f"{now.who()}; this run uploads on but deletes nothing there")
                    return
                self.lease.refreshed = time.time()
                _write(self.remote, self.lease)
            except (StoreUnavailable, CheckpointError):
                continue  # the store is down: the next tick tries again

    def release(self, wait_s: float = 10.0) -> None:
        """At the run's end: marked released, so a resume elsewhere may take the prefix at
        once. The write runs in a thread, given ``wait_s`` at most: a stalled store never
        holds the run's end longer (the lease then expires after TTL_S)."""
        self._stop.set()
        _live.discard(self.lease.run)
        _claimed.pop(self.remote.url, None)
        if self.owned:
            self.lease.released = True
            writer = threading.Thread(target=self._write_quietly, daemon=True,
                                      name="ironloop-remote-lease")
            writer.start()
            writer.join(timeout=max(wait_s, 0.0))

    def _write_quietly(self) -> None:
        with contextlib.suppress(StoreUnavailable):
            _write(self.remote, self.lease)


_claimed: dict[str, Holder] = {}  # URL -> the lease this process holds there


def held(url: str) -> Holder | None:
    """The lease this process claimed on ``url`` (for the mirror to refresh), if any."""
    return _claimed.get(url.rstrip("/"))


def recorded(ckpt_dir: Path) -> str | None:
    """The lineage run.dir's checkpoints belong to (``record``), or None: none recorded (a new
    node, a run from before the record) or one too garbled to compare."""
    try:
        text = (ckpt_dir / RECORD).read_text().strip()
    except OSError:
        return None
    return text if len(text) == 32 and all(c in "0123456789abcdef" for c in text) else None


def record(ckpt_dir: Path, lineage: str) -> None:
    """Note in run.dir which lineage its checkpoints belong to (rank 0, once claimed)."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(ckpt_dir / RECORD, lineage + "\n")
