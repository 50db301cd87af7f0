"""remote_manifest.checked: the shape a remote manifest must have before anything it names is
fetched. Each bad manifest here is one a tampered or garbled store could hold."""

from __future__ import annotations

import json

import pytest

from ironloop.errors import CheckpointError
from ironloop.state.remote.manifest import checked

STEP = 12
ENTRY = {"blake2b": "ab" * 64, "size": 10}
PT = f"step-{STEP:08d}.pt"
DCP = f"step-{STEP:08d}.dcp"
GOOD = {"format": 1, "step": STEP, "kind": "file", "best": False, "world_size": 1,
        "files": {PT: ENTRY}, "logs": {f"logs/step-{STEP:08d}/metrics.jsonl": ENTRY},
        "time": 1.0}
GOOD_DCP = {**GOOD, "kind": "dcp", "world_size": 2,
            "files": {f"{DCP}/.metadata": ENTRY, f"{DCP}/__0_0.distcp": ENTRY,
                      f"{DCP}/__1_0.distcp": ENTRY, f"{DCP}/manifest.json": ENTRY,
                      f"{DCP}/extras-rank0.pt": ENTRY, f"{DCP}/extras-rank1.pt": ENTRY}}


def _with(base: dict, **changes) -> dict:
    return {**base, **changes}


BAD = {
    # names that would leave the fetch folder, or that are not this checkpoint's files
    "absolute name": _with(GOOD, files={"/etc/passwd": ENTRY}),
    "absolute name in a dcp": _with(GOOD_DCP, files={f"{DCP}//etc/passwd": ENTRY}),
    "../ name": _with(GOOD, files={"../x": ENTRY}),
    "../ inside a dcp": _with(GOOD_DCP, files={f"{DCP}/../../x": ENTRY}),
    "a dcp file in a subfolder": _with(GOOD_DCP, files={f"{DCP}/a/b": ENTRY}),
    "a dcp file named ..": _with(GOOD_DCP, files={f"{DCP}/..": ENTRY}),
    "a dcp file named .": _with(GOOD_DCP, files={f"{DCP}/.": ENTRY}),
    "another step's file": _with(GOOD, files={"step-00000011.pt": ENTRY}),
    "two files for a .pt": _with(GOOD, files={PT: ENTRY, "step-00000012.pt.x": ENTRY}),
    "a .pt name under kind dcp": _with(GOOD, kind="dcp"),
    "last.pt": _with(GOOD, files={"last.pt": ENTRY}),
    "no files": _with(GOOD, files={}),
    "a log outside logs/": _with(GOOD, logs={"logs/step-00000012/../../../x/run.json": ENTRY}),
    "a log that is not a run's log": _with(GOOD, logs={"logs/step-00000012/.bashrc": ENTRY}),
    "a log with a separator in its name": _with(GOOD, logs={"/root/metrics.jsonl": ENTRY}),
    # wrong JSON types
    "the manifest a list": [GOOD],
    "the manifest a string": "step-00000012.pt",
    "the manifest null": None,
    "files a list": _with(GOOD, files=[PT]),
    "files a string": _with(GOOD, files=PT),
    "an entry a string": _with(GOOD, files={PT: "ab" * 64}),
    "an entry a list": _with(GOOD, files={PT: ["ab" * 64, 10]}),
    "logs a list": _with(GOOD, logs=["metrics.jsonl"]),
    "a log entry a number": _with(GOOD, logs={f"logs/step-{STEP:08d}/metrics.jsonl": 3}),
    "step a string": _with(GOOD, step=str(STEP)),
    "step true": _with(GOOD, step=True),
    "another step": _with(GOOD, step=STEP + 1),
    "kind unknown": _with(GOOD, kind="zip"),
    "best a string": _with(GOOD, best="yes"),
    "world_size 0": _with(GOOD, world_size=0),
    "world_size a float": _with(GOOD, world_size=2.0),
    # sizes and digests
    "size negative": _with(GOOD, files={PT: {**ENTRY, "size": -1}}),
    "size a string": _with(GOOD, files={PT: {**ENTRY, "size": "10"}}),
    "size a float": _with(GOOD, files={PT: {**ENTRY, "size": 10.5}}),
    "size absurd": _with(GOOD, files={PT: {**ENTRY, "size": 1 << 60}}),
    "size missing": _with(GOOD, files={PT: {"blake2b": ENTRY["blake2b"]}}),
    "digest short": _with(GOOD, files={PT: {**ENTRY, "blake2b": "ab"}}),
    "digest not hex": _with(GOOD, files={PT: {**ENTRY, "blake2b": "zz" * 64}}),
    "digest a number": _with(GOOD, files={PT: {**ENTRY, "blake2b": 5}}),
    "digest missing": _with(GOOD, files={PT: {"size": 10}}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_manifest_is_refused_naming_what_is_wrong(case):
    with pytest.raises(CheckpointError, match=r"^its manifest"):
        checked(json.dumps(BAD[case]).encode(), STEP)


@pytest.mark.parametrize("data", [b"", b"{", b"\xff\xfe", b"[1, 2", b"nan"])
def test_bytes_that_are_not_json_are_refused(data):
    with pytest.raises(CheckpointError, match="its manifest is not JSON"):
        checked(data, STEP)


def test_bytes_that_are_not_json_are_refused_quoting_the_parsers_reason():
    with pytest.raises(CheckpointError) as e:
        checked(b"{", STEP)
    assert str(e.value) == ("its manifest is not JSON (Expecting property name enclosed in "
                            "double quotes: line 1 column 2 (char 1))")


@pytest.mark.parametrize("good", [GOOD, GOOD_DCP, {k: v for k, v in GOOD.items()
                                                   if k not in ("logs", "world_size")}],
                         ids=["file", "dcp", "older, without logs"])
def test_what_the_mirror_writes_passes_unchanged(good):
    assert checked(json.dumps(good).encode(), STEP) == good


@pytest.mark.parametrize("case, message", [
    ("files a list", "its manifest's files is a list, not an object"),
    ("logs a list", "its manifest's logs is a list, not an object"),
    ("another step's file", "its manifest's files names 'step-00000011.pt', which is not a file "
                            "of this checkpoint"),
    ("a log that is not a run's log", "its manifest's logs names 'logs/step-00000012/.bashrc', "
                                      "which is not a file of this checkpoint"),
    ("an entry a string", f"its manifest's entry for {PT} is a string, not an object"),
    ("a log entry a number", f"its manifest's entry for logs/step-{STEP:08d}/metrics.jsonl is "
                             f"a int, not an object"),
    ("two files for a .pt", "its manifest's files names 'step-00000012.pt.x', which is not a "
                            "file of this checkpoint"),
    ("no files", f"its manifest's files do not name one checkpoint {PT}"),
    ("size negative", f"its manifest's size of {PT} is -1"),
    ("digest short", f"its manifest's digest of {PT} is not a blake2b digest"),
    ("another step", f"its manifest's step {STEP + 1} is not {STEP}"),
    ("kind unknown", "its manifest's kind 'zip' is not one of ['dcp', 'file']"),
    ("best a string", "its manifest's best is not true or false"),
    ("world_size 0", "its manifest's world_size 0 is not a positive integer"),
    ("the manifest a list", "its manifest is a list, not an object"),
])
def test_the_refusal_names_the_key_and_the_entry_that_is_wrong(case, message):
    with pytest.raises(CheckpointError) as e:
        checked(json.dumps(BAD[case]).encode(), STEP)
    assert str(e.value) == message
