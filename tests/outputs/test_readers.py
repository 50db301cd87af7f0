"""outputs/readers.py: reading a run directory back, tolerant of what a crash leaves."""

from __future__ import annotations

import json
import math

from ironloop.outputs import readers


def test_read_jsonl_skips_a_torn_line_and_recovers_a_row_glued_to_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert readers.read_jsonl(path) == []  # missing: no rows
    path.write_text('{"step": 1, "loss": 0.5}\n'
                    '{"step": 2, "lo\n'  # torn by a kill, nothing after it
                    '{"step": 3, "lo{"step": 3, "loss": 0.25}\n'  # a resume appended to a stub
                    '{"step": 4, "extra": {"a": 1}}\n'
                    'not json at all\n')
    assert readers.read_jsonl(str(path)) == [{"step": 1, "loss": 0.5}, {"step": 3, "loss": 0.25},
                                             {"step": 4, "extra": {"a": 1}}]


def test_a_stubs_nested_object_is_not_taken_for_a_glued_row(tmp_path):
    path = tmp_path / "evals.jsonl"
    path.write_text('{"step": 5, "sets": {"a": 1}, "x": \n')  # torn after a nested object
    assert readers.read_jsonl(path) == []


def test_the_first_key_of_a_row_text():
    assert readers._first_key('{ "step": 1}') == "step"
    assert readers._first_key('{"": 1}') == ""
    assert readers._first_key('[1, 2]') is None


def test_num_takes_only_finite_real_numbers():
    assert readers.num(3) == 3.0 and isinstance(readers.num(3), float)
    assert readers.num(0.5) == 0.5
    for v in (None, True, False, "1.0", math.nan, math.inf, -math.inf, [1]):
        assert readers.num(v) is None


def test_continuous_keeps_the_replayed_rows_after_a_resume():
    rows = [{"step": 1}, {"step": 2}, {"step": 3}, {"x": 1}, {"step": 2, "r": 1},
            {"step": 3, "r": 1}, {"step": 4}]
    assert readers.continuous(rows) == [{"step": 1}, {"step": 2, "r": 1}, {"step": 3, "r": 1},
                                        {"step": 4}]
    assert readers.continuous([{"epoch": 1}, {"epoch": 1, "r": 1}], key="epoch") == \
        [{"epoch": 1, "r": 1}]


def test_load_mapping_reads_json_and_yaml_and_says_what_is_wrong(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"a": 1}))
    (tmp_path / "config.yaml").write_text("train:\n  lr: 0.1\n")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.yaml").write_text("a: [1,\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    (tmp_path / "utf.yaml").write_bytes("name: café\n".encode())
    assert readers.load_mapping(tmp_path / "run.json") == ({"a": 1}, None)
    assert readers.load_mapping(tmp_path / "config.yaml") == ({"train": {"lr": 0.1}}, None)
    assert readers.load_mapping(tmp_path / "utf.yaml") == ({"name": "café"}, None)
    assert readers.load_mapping(tmp_path / "none.yaml") == ({}, "no none.yaml")
    assert readers.load_mapping(tmp_path / "bad.json") == \
        ({}, "bad.json is unreadable (JSONDecodeError)")
    assert readers.load_mapping(tmp_path / "bad.yaml") == \
        ({}, "bad.yaml is unreadable (ParserError)")
    assert readers.load_mapping(tmp_path / "list.yaml") == ({}, "list.yaml is not a mapping")


def test_get_dotted_walks_nested_keys_and_gives_none_past_a_leaf():
    cfg = {"train": {"lr": 0.1, "opt": {"name": "adamw"}}, "seed": 3}
    assert readers.get_dotted(cfg, "train.opt.name") == "adamw"
    assert readers.get_dotted(cfg, "train.lr") == 0.1
    assert readers.get_dotted(cfg, "seed") == 3
    assert readers.get_dotted(cfg, "seed.x") is None
    assert readers.get_dotted(cfg, "train.missing") is None
