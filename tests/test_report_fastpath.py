"""The loader's fast path (blocks of step summaries decoded by pyarrow) gives exactly what the careful
path gives: the same frames and the same problems, with the same line numbers, on a real guard's log
and on corrupted copies of it, whatever the block size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

from stabilityguard.reports import _fast, load  # noqa: E402

from .test_report_loader import guarded_logs  # noqa: E402

FRAMES = ("steps", "incidents", "layer_incidents", "actions", "resets", "layer_ratios", "sharpness", "windows",
          "refused_batches")


@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """A real guarded run (a spike, a NaN, a summary every step), and a hand-written schema-1.5 run."""
    return guarded_logs(tmp_path_factory.mktemp("fastsrc"), log_every=1, steps=60, spike=20, nan=40)


def load_both(d: Path, monkeypatch, block: int, max_line_bytes: int = load.MAX_LINE_BYTES):
    """(fast, careful) runs of ``d`` read with ``block``-byte blocks, and how many summaries went fast."""
    monkeypatch.setattr(_fast, "BLOCK_BYTES", block)
    fast_rows = []
    decode = _fast.decode_summaries

    def counting(lines, readable):
        cols = decode(lines, readable)
        fast_rows.append(0 if cols is None else cols.n)
        return cols

    monkeypatch.setattr(_fast, "decode_summaries", counting)
    monkeypatch.setattr(load, "FAST_SUMMARIES", True)
    fast = load.load_runs(d, max_line_bytes=max_line_bytes)
    monkeypatch.setattr(load, "FAST_SUMMARIES", False)
    careful = load.load_runs(d, max_line_bytes=max_line_bytes)
    return fast, careful, sum(fast_rows)


def assert_same(fast, careful):
    assert list(fast) == list(careful)
    for rid in fast:
        a, b = fast[rid], careful[rid]
        for name in FRAMES:
            pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=f"{rid}.{name}", check_exact=True)
        assert [str(p) for p in a.problems] == [str(p) for p in b.problems]
        assert (a.start, a.end, a.segments, a.ranks) == (b.start, b.end, b.segments, b.ranks)


def events_file(d: Path) -> Path:
    return next(p for p in d.glob("events-real*.jsonl"))


def test_real_log_reads_the_same_fast_and_careful(real_log, monkeypatch):
    lines = events_file(real_log).read_text().splitlines()
    n_summaries = sum('"kind":"step_summary"' in ln for ln in lines)
    assert n_summaries >= 60
    for block in (_fast.BLOCK_BYTES, 4096, 700):
        fast, careful, went_fast = load_both(real_log, monkeypatch, block)
        assert_same(fast, careful)
        assert went_fast >= n_summaries  # the real writer's summaries all take the fast path
        assert not fast["real"].problems and len(fast["real"].steps) == 60


BAD_SUMMARY_EDITS = [
    lambda r: r.update(lr="0.1"),
    lambda r: r.update(loss=True),
    lambda r: r.update(step=None),
    lambda r: r.update(step=7.0),
    lambda r: r.update(steps=3.0),
    lambda r: r.update(spikes=-(2**70)),
    lambda r: r.update(global_norm=10**400),
    lambda r: r.update(global_norm=2**1000 + 1),
    lambda r: r.update(max_ratio_layer=5),
    lambda r: r.update(max_ratio_layer=None, refused_max_ratio_layer="blocks.0.x"),
    lambda r: r.update(refused_max_ratio_layer=["a"]),
    lambda r: r.update(loss_mean="x"),
    lambda r: r.update(clipped_layers=3, post_clip_global_norm=1.5),
    lambda r: r.update(run_id=None),
    lambda r: r.pop("run_id"),
    lambda r: r.pop("schema_version"),
    lambda r: r.update(schema_version="1.4"),
    lambda r: r.update(schema_version=1.5),
    lambda r: r.update(rank=-1),
    lambda r: r.update(rank=1),
    lambda r: r.update(rank="0"),
    lambda r: r.update(rank=0.0),
    lambda r: r.update(extra={"nested": [1, 2]}),
    lambda r: r.update(max_ratio_layer="a\\b\u00e9\"x"),
    lambda r: r.update(max_ratio_layer="\u00e9t\u00e9"),
    lambda r: r.update(run_id="other"),
    lambda r: r.pop("lr"),
    lambda r: r.pop("steps"),
    lambda r: r.update(time=None, loss=None),
]

RAW_EDITS = [
    lambda s: s[: len(s) // 2],  # not JSON
    lambda s: s.replace('"lr":', '"lr":1,"lr":'),  # a duplicate key (json keeps the last)
    lambda s: s.replace('"loss":', '"loss":NaN,"x":', 1),
    lambda s: s + "\r",
    lambda s: "  " + s + " \t",
    lambda s: s.replace('"max_ratio_layer":"', '"max_ratio_layer":"\xff', 1),  # invalid UTF-8 (written as bytes)
    lambda s: s + s,  # two objects on one line
    lambda s: "[" + s + "]",
    lambda s: s.replace("{", "{\x00", 1),
    lambda s: s + "\n",  # a blank line after it
    lambda s: s.replace('"kind":"step_summary"', '"kind":"step_summary","kind":"spike"'),
    lambda s: s + "\n" + '{"kind":"step_summary","junk":"' + "y" * 3000 + '"}',  # a long line
    lambda s: s.replace('"step":', '"step": ', 1),
    lambda s: s.replace('"loss":', '"loss":-NaN,"y":', 1),  # json rejects -NaN, pyarrow reads it as NaN
    lambda s: s.replace('"loss":', '"loss":Infinity,"y":', 1),
    lambda s: s.replace('"loss":', '"loss":Inf,"y":', 1),  # json rejects Inf, pyarrow reads it
]


def corrupt(lines, rng: random.Random):
    """Edit a few random step summaries (and maybe cut the last line); returns the lines and what was done."""
    out = list(lines)
    done = []
    summaries = [i for i, ln in enumerate(out) if '"kind":"step_summary"' in ln]
    for _ in range(rng.randint(1, 4)):
        i = rng.choice(summaries)
        try:
            rec = json.loads(out[i])
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if rng.random() < 0.6:
            k = rng.randrange(len(BAD_SUMMARY_EDITS))
            BAD_SUMMARY_EDITS[k](rec)
            out[i] = json.dumps(rec, separators=(",", ":"), ensure_ascii=rng.random() < 0.5)
            done.append(("field", k, i + 1))
        else:
            k = rng.randrange(len(RAW_EDITS))
            out[i] = RAW_EDITS[k](out[i])
            done.append(("raw", k, i + 1))
    if rng.random() < 0.2:  # a second segment
        start = next(ln for ln in out if '"run_start"' in ln)
        out.insert(rng.randrange(len(out)), start)
    if rng.random() < 0.2:  # a truncated last line
        out[-1] = out[-1][: rng.randrange(len(out[-1]))]
    return out, done


def test_corrupted_logs_read_the_same_fast_and_careful(real_log, tmp_path, monkeypatch):
    src = events_file(real_log).read_text().splitlines()
    rng = random.Random(13)
    fast_rows = 0
    for it in range(40):
        d = tmp_path / f"c{it}"
        d.mkdir()
        lines, done = corrupt(src, rng)
        (d / "events-real.jsonl").write_bytes("\n".join(lines).encode("utf-8", "surrogateescape")
                                             .replace("\xff".encode(), b"\xff") + b"\n")
        for p in real_log.glob("spike_step*.json"):
            (d / p.name).write_bytes(p.read_bytes())
        fast, careful, went_fast = load_both(d, monkeypatch, rng.choice([700, 3000, 20000, _fast.BLOCK_BYTES]),
                                             max_line_bytes=2500)
        assert_same(fast, careful)
        fast_rows += went_fast
    assert fast_rows > 40 * 20  # most blocks still took the fast path


def test_each_edit_alone_is_read_as_the_careful_path_reads_it(real_log, tmp_path, monkeypatch):
    src = events_file(real_log).read_text().splitlines()
    target = [i for i, ln in enumerate(src) if '"kind":"step_summary"' in ln][30]
    cases = [("field", k) for k in range(len(BAD_SUMMARY_EDITS))] + [("raw", k) for k in range(len(RAW_EDITS))]
    for n, (how, k) in enumerate(cases):
        lines = list(src)
        if how == "field":
            rec = json.loads(lines[target])
            BAD_SUMMARY_EDITS[k](rec)
            lines[target] = json.dumps(rec, separators=(",", ":"), ensure_ascii=False)
        else:
            lines[target] = RAW_EDITS[k](lines[target])
        d = tmp_path / f"e{n}"
        d.mkdir()
        text = "\n".join(lines).encode("utf-8").replace("\xff".encode(), b"\xff") + b"\n"
        (d / "events-real.jsonl").write_bytes(text)
        for block in (_fast.BLOCK_BYTES, 2000):
            fast, careful, _ = load_both(d, monkeypatch, block, max_line_bytes=2500)
            assert_same(fast, careful)


def test_a_bad_line_in_a_fast_block_is_reported_with_its_line_number(real_log, tmp_path, monkeypatch):
    src = events_file(real_log).read_text().splitlines()
    target = [i for i, ln in enumerate(src) if '"kind":"step_summary"' in ln][25]
    rec = json.loads(src[target])
    rec["lr"] = "0.1"
    src[target] = json.dumps(rec, separators=(",", ":"))
    src[target + 3] = src[target + 3][:40]  # not JSON
    (tmp_path / "events-real.jsonl").write_text("\n".join(src) + "\n")
    fast, careful, went_fast = load_both(tmp_path, monkeypatch, _fast.BLOCK_BYTES)
    assert_same(fast, careful)
    probs = [(p.line, p.message) for p in fast["real"].problems]
    assert probs[0][0] == target + 1 and "'lr' is str '0.1'" in probs[0][1]
    assert probs[1][0] == target + 4 and "corrupt line skipped" in probs[1][1]
    assert len(fast["real"].steps) == 59 and fast["real"].steps["lr"].isna().sum() == 1
    # the bad lines sent their block the careful way; with small blocks, the other blocks stay fast
    _, _, went_fast = load_both(tmp_path, monkeypatch, 1500)
    assert went_fast > 30


def test_long_lines_across_blocks(tmp_path, monkeypatch):
    recs = [{"schema_version": "1.5", "kind": "step_summary", "run_id": "x", "step": i, "rank": 0, "lr": 0.1}
            for i in range(30)]
    lines = [json.dumps(r, separators=(",", ":")) for r in recs]
    lines[10] = '{"kind":"step_summary","junk":"' + "y" * 5000 + '"}'
    lines[20] = " " * 3000
    lines.append('{"kind":"step_summary","junk":"' + "z" * 4000)  # long and truncated
    (tmp_path / "events-x.jsonl").write_text("\n".join(lines))
    for block in (64, 300, 1000, 1 << 20):
        fast, careful, _ = load_both(tmp_path, monkeypatch, block, max_line_bytes=2500)
        assert_same(fast, careful)
        assert [p.line for p in fast["x"].problems] == [11, 21, 31]
        assert len(fast["x"].steps) == 28


def test_without_pyarrow_every_line_is_read_the_careful_way(real_log, monkeypatch):
    monkeypatch.setattr(_fast, "available", lambda: False)
    fast, careful, went_fast = load_both(real_log, monkeypatch, 4096)
    assert went_fast == 0
    assert_same(fast, careful)


def test_numbers_are_read_bit_for_bit_as_json_reads_them(tmp_path, monkeypatch):
    rng = random.Random(3)
    with open(tmp_path / "events-f.jsonl", "w") as f:
        for i in range(3000):
            x = rng.choice([rng.random(), rng.uniform(-1e300, 1e300), rng.random() * 1e-310,
                            10 ** rng.uniform(-300, 300), float(rng.getrandbits(60)), rng.getrandbits(70),
                            -rng.getrandbits(40), 0, -0.0])
            rec = {"schema_version": "1.5", "kind": "step_summary", "run_id": "f", "step": i, "rank": 0,
                   "loss": x, "global_norm": rng.random() * 10, "loss_mean": x, "steps": rng.getrandbits(62)}
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
    fast, careful, went_fast = load_both(tmp_path, monkeypatch, 1 << 16)
    assert went_fast == 3000
    assert_same(fast, careful)
    for col in ("loss", "global_norm", "loss_mean"):
        a, b = fast["f"].steps[col].to_numpy(), careful["f"].steps[col].to_numpy()
        assert (a.view("int64") == b.view("int64")).all()


def test_the_switch_interval_is_lowered_while_decoding_and_restored(real_log, tmp_path, monkeypatch):
    import sys

    before = sys.getswitchinterval()
    seen = []
    decode = _fast.decode_summaries

    def spying(lines, readable):
        seen.append(sys.getswitchinterval())
        return decode(lines, readable)

    monkeypatch.setattr(_fast, "decode_summaries", spying)
    load.load_runs(real_log)
    assert seen and max(seen) <= _fast.SWITCH_INTERVAL + 1e-9
    assert sys.getswitchinterval() == before
    newer = tmp_path / "events-newer.jsonl"
    newer.write_text(events_file(real_log).read_text() + json.dumps(
        {"schema_version": "9.0", "kind": "step_summary", "run_id": "real", "step": 1}) + "\n")
    with pytest.raises(load.LogFormatError):
        load.load_runs(newer)
    assert sys.getswitchinterval() == before
    with _fast.short_switch_interval():  # nested uses (two loaders in two threads) restore it once, at the end
        with _fast.short_switch_interval():
            pass
        assert sys.getswitchinterval() <= _fast.SWITCH_INTERVAL + 1e-9
    assert sys.getswitchinterval() == before


def test_read_blocks_gives_the_file_s_lines_whatever_the_block_size(monkeypatch):
    import io

    rng = random.Random(11)
    for _ in range(500):
        data = b"".join(rng.choice([b"\n", b"ab", b"x" * rng.randint(0, 200), b"\n\n", b"{}"])
                        for _ in range(rng.randint(0, 60)))
        monkeypatch.setattr(_fast, "BLOCK_BYTES", rng.choice([1, 2, 3, 7, 16, 64, 1000]))
        blocks = list(_fast.read_blocks(io.BytesIO(data), 1 << 20))
        lines = [ln for _, ls, _ in blocks for ln in ls]
        expected = data.split(b"\n")
        if expected[-1] == b"":  # a final newline ends the last line
            expected.pop()
        assert lines == expected
        assert [first for first, _, _ in blocks] == [1 + sum(len(ls) for _, ls, _ in blocks[:i])
                                                    for i in range(len(blocks))]
        assert all(complete for _, _, complete in blocks[:-1])
        assert not blocks or blocks[-1][2] == data.endswith(b"\n")
