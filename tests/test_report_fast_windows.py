"""The loader's fast path for flight-recorder windows (``_fast_windows``: windows cut out of incident lines
and decoded by pyarrow) gives exactly what the careful path gives: the same frames and the same problems,
with the same line numbers, on a real guard's log and on corrupted copies of it, whatever the block size."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")

from stabilityguard.reports import _fast, _fast_windows, load  # noqa: E402

from .test_report_fastpath import assert_same, load_both  # noqa: E402
from .test_report_loader import guarded_logs  # noqa: E402


@pytest.fixture(scope="module")
def real_log(tmp_path_factory):
    """A real guarded run (a spike, a NaN, windows) and a hand-written schema-1.5 run (spaced JSON, windows)."""
    return guarded_logs(tmp_path_factory.mktemp("fastwin"), log_every=1, steps=60, spike=20, nan=40)


def window_lines(d: Path):
    return {p.name: [i for i, ln in enumerate(p.read_bytes().split(b"\n")) if b'"window"' in ln]
            for p in sorted(d.glob("events-*.jsonl"))}


def load_counting(d: Path, monkeypatch, block: int):
    """(fast, careful) as ``load_both``, and how many windows the fast path decoded."""
    decoded = []
    decode = _fast_windows.decode

    def counting(texts):
        out = decode(texts)
        decoded.append(0 if out is None else len(out))
        return out

    monkeypatch.setattr(_fast_windows, "decode", counting)
    fast, careful, _ = load_both(d, monkeypatch, block)
    return fast, careful, sum(decoded)


def copy_reports(src: Path, d: Path) -> None:
    for p in src.glob("spike_step*.json"):
        (d / p.name).write_bytes(p.read_bytes())


def test_real_windows_read_the_same_fast_and_careful(real_log, monkeypatch):
    n_windows = sum(map(len, window_lines(real_log).values()))
    assert n_windows >= 8  # incidents and follow-up windows of both runs
    for block in (_fast.BLOCK_BYTES, 20000, 3000):
        fast, careful, went_fast = load_counting(real_log, monkeypatch, block)
        assert_same(fast, careful)
        assert went_fast == n_windows  # every window of the real writers takes the fast path
        assert len(fast["real"].windows) and len(fast["r15"].windows) and not fast["real"].problems


def _entry(rec):
    return rec["window"][len(rec["window"]) // 2]


WINDOW_EDITS = [
    lambda r: _entry(r).update(step=None),
    lambda r: _entry(r).pop("step"),
    lambda r: _entry(r).update(step=7.0),
    lambda r: _entry(r).update(step="7"),
    lambda r: _entry(r).update(step=2**70),
    lambda r: _entry(r).update(step=True),
    lambda r: _entry(r).update(global_norm="x"),
    lambda r: _entry(r).update(loss=True),
    lambda r: _entry(r).update(lr=10**400),
    lambda r: _entry(r).update(lr=2**1000 + 1),
    lambda r: _entry(r).update(update_rms=3),
    lambda r: _entry(r).update(loss_z=None, max_ratio=None),
    lambda r: _entry(r).update(max_ratio_layer=5),
    lambda r: _entry(r).update(max_ratio_layer=None, action=None),
    lambda r: _entry(r).update(max_ratio_layer="a]b"),
    lambda r: _entry(r).update(max_ratio_layer="a[b"),
    lambda r: _entry(r).update(max_ratio_layer="\u00e9t\u00e9"),
    lambda r: _entry(r).update(max_ratio_layer='q"x\\y'),
    lambda r: _entry(r).update(action="weird"),
    lambda r: _entry(r).update(action=["skip"]),
    lambda r: _entry(r).update(extra={"a": 1}),
    lambda r: _entry(r).update(extra={"a": [1]}),
    lambda r: r["window"].insert(1, None),
    lambda r: r["window"].insert(1, 3),
    lambda r: r["window"].insert(1, [1]),
    lambda r: r["window"].insert(1, {}),
    lambda r: r.update(window=[]),
    lambda r: r.update(window=None),
    lambda r: r.update(window={"step": 1}),
    lambda r: r.update(window="x"),
    lambda r: r.update(window=[{"step": 1}], extra={"window": 0}),
    lambda r: r.update(extra={"window": r.pop("window")}),
    lambda r: r.update(extra={"window": r.pop("window")}, window=0),  # the first "window" is not the record's
    lambda r: r.update(layer="window"),
    lambda r: r.update(kind="action"),
    lambda r: r.update(kind="run_start"),
    lambda r: r.update(kind=["spike"]),
    lambda r: r.update(step=None),
    lambda r: r.update(schema_version="0.9"),  # unreadable: the record is skipped
    lambda r: r.update(run_id="other"),
]

RAW_EDITS = [
    lambda s: s[: len(s) // 2],  # not JSON
    lambda s: s[: s.index('"window"') + 40],  # cut inside the window
    lambda s: s.replace('"window"', '"window" ', 1),
    lambda s: s.replace('"window":', '"window": \t', 1),
    lambda s: s.replace('"step"', '"step":1,"step"', 1) if s.count('"step"') > 1 else s,  # duplicate key
    lambda s: s.replace('"window"', '"wind\\u006fw"', 1),  # an escaped key
    lambda s: s.replace('"window"', '"x":0,"window"', 1).replace('{"step"', '{"step":NaN,"step"', 1),
    lambda s: s.replace('"global_norm"', '"global_norm":-NaN,"x"', 2),  # json rejects -NaN, pyarrow reads it
    lambda s: s.replace('"global_norm"', '"global_norm":Infinity,"x"', 2),
    lambda s: s.replace('"global_norm"', '"global_norm":Inf,"x"', 2),  # json rejects Inf, pyarrow reads it
    lambda s: s.replace("}]", "},]", 1),  # a trailing comma
    lambda s: s.replace("}]", "}]]", 1),
    lambda s: s.replace("}]", "}\r]", 1),
    lambda s: s.replace("}, {", "} {", 1).replace("},{", "} {", 1),
    lambda s: s.replace('"max_ratio_layer"', '"max_ratio_layer":"\xff","y"', 1),  # invalid UTF-8 (as bytes)
    lambda s: s.replace("{", "{\x00", 1),
    lambda s: s + s,  # two objects on one line
    lambda s: "  " + s + " \r",
    lambda s: s.replace('"window"', '"window":[],"window"', 1),  # a duplicate window
]


def write_edited(d: Path, src: Path, name: str, target: int, how: str, k: int) -> None:
    lines = (src / name).read_text().splitlines()
    if how == "field":
        rec = json.loads(lines[target])
        WINDOW_EDITS[k](rec)
        compact = '"kind":"' in lines[target]
        lines[target] = json.dumps(rec, separators=(",", ":") if compact else (", ", ": "), ensure_ascii=False)
    else:
        lines[target] = RAW_EDITS[k](lines[target])
    d.mkdir()
    for p in src.glob("events-*.jsonl"):
        if p.name != name:
            (d / p.name).write_bytes(p.read_bytes())
    (d / name).write_bytes("\n".join(lines).encode("utf-8").replace("\xff".encode(), b"\xff") + b"\n")
    copy_reports(src, d)


def test_each_window_edit_is_read_as_the_careful_path_reads_it(real_log, tmp_path, monkeypatch):
    targets = [(name, i) for name, idx in window_lines(real_log).items() for i in idx]
    cases = [("field", k) for k in range(len(WINDOW_EDITS))] + [("raw", k) for k in range(len(RAW_EDITS))]
    fell_back = 0
    for n, (how, k) in enumerate(cases):
        name, target = targets[n % len(targets)]
        d = tmp_path / f"e{n}"
        write_edited(d, real_log, name, target, how, k)
        for block in (_fast.BLOCK_BYTES, 5000):
            fast, careful, went_fast = load_counting(d, monkeypatch, block)
            assert_same(fast, careful)
        fell_back += went_fast < sum(map(len, window_lines(d).values()))
    assert fell_back > len(cases) // 2  # most edits sent their block the careful way


def test_corrupted_windows_read_the_same_fast_and_careful(real_log, tmp_path, monkeypatch):
    rng = random.Random(17)
    targets = [(name, i) for name, idx in window_lines(real_log).items() for i in idx]
    went = 0
    for it in range(30):
        d = tmp_path / f"c{it}"
        d.mkdir()
        texts = {p.name: p.read_text().splitlines() for p in real_log.glob("events-*.jsonl")}
        for _ in range(rng.randint(1, 3)):
            name, i = rng.choice(targets)
            line = texts[name][i]
            if rng.random() < 0.5:
                try:
                    rec = json.loads(line)
                    WINDOW_EDITS[rng.randrange(len(WINDOW_EDITS))](rec)
                    texts[name][i] = json.dumps(rec, separators=(",", ":") if '"kind":"' in line else (", ", ": "))
                except (ValueError, KeyError, TypeError, AttributeError, IndexError):
                    continue
            else:
                texts[name][i] = RAW_EDITS[rng.randrange(len(RAW_EDITS))](line)
        for name, lines in texts.items():
            (d / name).write_bytes("\n".join(lines).encode("utf-8", "surrogateescape")
                                  .replace("\xff".encode(), b"\xff") + b"\n")
        copy_reports(real_log, d)
        fast, careful, went_fast = load_counting(d, monkeypatch, rng.choice([3000, 20000, _fast.BLOCK_BYTES]))
        assert_same(fast, careful)
        went += went_fast
    assert went > 30 * 4  # the untouched windows (in other blocks) still took the fast path


def test_cut_keeps_the_line_s_rest_and_its_window():
    raw = b'{"kind":"spike","step":3,"window":[{"step":2},{"step":3}],"origin_ranks":[0,1]}'
    rest, window = _fast_windows.cut(raw)
    assert rest == b'{"kind":"spike","step":3,"window":0,"origin_ranks":[0,1]}'
    assert window == b'[{"step":2},{"step":3}]'
    spaced = b'{"kind": "spike", "window" : \t[{"step": 2}], "x": 1}'
    assert _fast_windows.cut(spaced) == (b'{"kind": "spike", "window" : \t0, "x": 1}', b'[{"step": 2}]')
    for bad in (b'{"window":[[1]]}', b'{"window":{"a":[1]}}', b'{"window":1}', b'{"a":"\\n","window":[]}',
                b'{"window":[],"b":{"window":[]}}', b'{"window":[{"step":1}\r]}', b'{"window":[', b'{"window"'):
        assert _fast_windows.cut(bad) is None, bad
