"""An S3 store's manifest and lease are read with a bound, as a file:// store's are: an object far
larger than any manifest (MANIFEST_CAP) or lease (LEASE_CAP) costs at most that many bytes from
the network (a ranged GET), is refused in one line, and the resume falls back past it; never a
MemoryError. The bytes are counted by a relay between s3fs and moto's server, which passes them
on unchanged."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import socketserver
import threading

import pytest

from ironloop.errors import CheckpointError
from ironloop.outputs.readers import read_jsonl
from ironloop.state.remote import lease as remote_lease
from ironloop.state.remote.store import LEASE_CAP, MANIFEST_CAP, open_remote
from tests.state.test_remote import StopAt, _config, _fit, s3, s3_server

__all__ = ["s3", "s3_server"]  # fixtures shared with test_remote.py

SLACK = 256 << 10  # the requests' headers, the bucket's listing and the like: far below a cap


class _Pipe(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        relay: Relay = self.server  # type: ignore[assignment]
        up = socket.create_connection(relay.upstream)
        back = threading.Thread(target=relay.pump, args=(self.request, up, False), daemon=True)
        back.start()
        relay.pump(up, self.request, True)
        back.join(timeout=10)
        up.close()


class Relay(socketserver.ThreadingTCPServer):
    """127.0.0.1:port -> ``upstream``, counting the bytes the upstream sends back."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]):
        super().__init__(("127.0.0.1", 0), _Pipe)
        self.upstream, self.received, self._lock = upstream, 0, threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def pump(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if counted:
                    with self._lock:
                        self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass  # the other side closed: the connection is over
        finally:
            with contextlib.suppress(OSError):  # already closed
                dst.shutdown(socket.SHUT_WR)


@pytest.fixture
def relay(s3_server):
    host, port = s3_server["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    server = Relay((host, int(port)))
    yield server
    server.shutdown()
    server.server_close()


def _through(url: str, relay: Relay):
    """The store as a run opens it, its requests through the relay."""
    return open_remote(url, {"endpoint_url": relay.url, "skip_instance_cache": True})


def test_an_s3_manifest_far_larger_than_any_is_read_no_further_than_the_cap(s3, relay):
    url, fs = s3
    rel = "manifests/step-00000012.json"
    fs.pipe_file(f"{url}/{rel}", b" " * (2 * MANIFEST_CAP))
    remote = _through(url, relay)
    with pytest.raises(CheckpointError, match=f"is larger than {MANIFEST_CAP} bytes"):
        remote.manifest(12)
    assert MANIFEST_CAP < relay.received < MANIFEST_CAP + SLACK, relay.received


def test_an_s3_lease_far_larger_than_any_names_nobody_after_reading_at_most_the_cap(s3, relay):
    url, fs = s3
    fs.pipe_file(f"{url}/{remote_lease.LEASE}", b" " * (64 * LEASE_CAP))
    lease, why = remote_lease.look(_through(url, relay))
    assert lease is None and f"is larger than {LEASE_CAP} bytes" in why
    assert LEASE_CAP < relay.received < LEASE_CAP + SLACK, relay.received


def test_an_oversized_newest_s3_manifest_is_skipped_in_one_line_and_the_older_one_resumes(
        tmp_path, s3, capsys):
    url, fs = s3
    config = _config(tmp_path, checkpoint__remote=url)
    _fit(config, callbacks=[StopAt(12)])
    steps = open_remote(url).manifests()
    assert steps[-1] == 12 and len(steps) >= 2
    key = f"{url}/manifests/step-00000012.json"
    manifest = json.loads(fs.cat_file(key))
    # still a valid manifest, padded past the cap: a read without the bound would take it
    fs.pipe_file(key, json.dumps(manifest).encode() + b" " * MANIFEST_CAP)
    shutil.rmtree(tmp_path / "run")  # a new node
    _fit(config, resume=True, callbacks=[StopAt(13)])
    out = capsys.readouterr().out
    damaged = [line for line in out.splitlines() if "step-00000012 is damaged" in line]
    assert len(damaged) == 1 and f"is larger than {MANIFEST_CAP} bytes" in damaged[0], out
    assert f"fetched {url}/step-{steps[-2]:08d}.pt" in out
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "resume"] == [steps[-2]]
