"""Reading refused_batches.jsonl and the skip_refused_batches setting: bad inputs are reported, never silently
weakened (no Trainer needed)."""

from __future__ import annotations

import json
import logging

import pytest

from stabilityguard import ConfigError
from stabilityguard.integrations._records import RECORDS_FILE, check_skip_setting, load_records, skip_keys

RECORD = {"schema": "1.5", "run_id": "r", "step": 3, "global_step": 3, "epoch": 0, "batch_index": 3,
          "sample_indices": None, "reason": "spike", "action": "skip", "rank": 0, "framework": "lightning"}


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_path_is_refused(value):
    with pytest.raises(ConfigError, match="skip_refused_batches"):
        check_skip_setting(value, None)


def test_a_directory_means_the_records_file_in_it(tmp_path):
    (tmp_path / RECORDS_FILE).write_text(json.dumps(RECORD) + "\n")
    path = check_skip_setting(str(tmp_path), None)
    assert path == tmp_path / RECORDS_FILE
    assert list(skip_keys(load_records(path))) == [(0, 3)]
    assert load_records(tmp_path) == load_records(path)  # load_records takes the directory too


def test_a_missing_explicit_path_is_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stabilityguard"):
        path = check_skip_setting(tmp_path / "refused_batch.jsonl", None)  # a typo
    assert path == tmp_path / "refused_batch.jsonl"
    assert "no such file" in caplog.text and "refused_batch.jsonl" in caplog.text


def test_true_on_a_first_run_is_not_warned_about(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="stabilityguard"):
        assert check_skip_setting(True, tmp_path) == tmp_path / RECORDS_FILE
    assert caplog.text == ""


@pytest.mark.parametrize("line", [
    '{"epoch": NaN, "batch_index": 3, "framework": "lightning"}',
    '{"epoch": 0, "batch_index": Infinity, "framework": "lightning"}',
    '{"epoch": 0, "batch_index": -Infinity, "framework": "lightning"}',
    '{"epoch": 0.7, "batch_index": 3.9, "framework": "lightning"}',
    '{"epoch": 0, "batch_index": -1, "framework": "lightning"}',
    '{"epoch": true, "batch_index": 3, "framework": "lightning"}',
    '{"epoch": "0", "batch_index": 3, "framework": "lightning"}',
    '{"epoch": 0, "batch_index": 3, "framework": "lightning", "sample_indices": [1, 2.5, 3]}',
    '{"epoch": 0, "batch_index": 3, "framework": "lightning", "sample_indices": [1, NaN]}',
    '{"epoch": 0, "batch_index": 3, "framework": "lightning", "sample_indices": [1, true]}',
    '{"epoch": 0, "batch_index": 3, "framework": "lightning", "sample_indices": "1,2,3"}',
    '{"epoch": 0, "batch_index": 3, "framework": "lightning", "sample_indices": [[1, 2]]}',
    '[0, 3]',
    '{"epoch": 0, "batch_index": 3',
    '[' * 100000 + ']' * 100000,  # deeper than json can read: RecursionError, not fatal either
])
def test_a_corrupt_line_is_reported_and_not_used(tmp_path, caplog, line):
    path = tmp_path / RECORDS_FILE
    good = {**RECORD, "batch_index": 5, "sample_indices": [40, 41]}
    path.write_text(line + "\n" + json.dumps(good) + "\n")
    with caplog.at_level(logging.WARNING, logger="stabilityguard"):
        records = load_records(path, framework="lightning")
    assert records == [good]
    assert skip_keys(records) == {(0, 5): [(0, [40, 41])]}
    assert "1 unreadable line(s)" in caplog.text and "line 1" in caplog.text


def test_integral_floats_read_as_ints_and_keep_the_sample_check(tmp_path):
    path = tmp_path / RECORDS_FILE
    path.write_text(json.dumps({**RECORD, "epoch": 1.0, "batch_index": 3.0, "sample_indices": [1, 2.0, 3]}) + "\n")
    (rec,) = load_records(path)
    assert (rec["epoch"], rec["batch_index"], rec["sample_indices"]) == (1, 3, [1, 2, 3])
    assert all(type(v) is int for v in (rec["epoch"], rec["batch_index"], *rec["sample_indices"]))
    assert skip_keys([rec]) == {(1, 3): [(0, [1, 2, 3])]}


def test_skip_keys_refuses_an_unchecked_malformed_record():
    with pytest.raises(ValueError, match="not a refused-batch record"):
        skip_keys([{**RECORD, "sample_indices": [1, 2.5]}])
