"""How fast the report module reads a big event log, and how much memory it needs.

Writes a synthetic schema-1.5 log of N step summaries (with the window aggregates) and M spikes (each
spike with the norms and baselines of L layers and their parameters and its 64-step flight-recorder
window, like the guard writes), then times: load_run, severity_table, layer_ranking,
postmortem_markdown, the plots (timeline, heatmap, 8 incident close-ups) and the HTML page. Each phase
is timed in wall seconds and in CPU seconds of the process (all threads: the loader decodes summaries
in a second thread when pyarrow is installed), which tells how much a busy machine slowed the run.
Peak memory is the process's maximum resident set size (it includes Python, numpy and pandas
themselves: the baseline is printed too).

Usage:
  python bench/report_scale.py                       # 1,000,000 summaries, 10,000 spikes, 48 layers
  python bench/report_scale.py --summaries 100000 --spikes 1000
  python bench/report_scale.py --window 0 --no-aggregates   # a schema-1.4 style log, for comparison
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


class Clock:
    """Wall and process CPU seconds since the last ``lap`` (CPU counts every thread of the process)."""

    def __init__(self) -> None:
        self.t, self.c = time.perf_counter(), time.process_time()

    def lap(self) -> tuple:
        t, c = time.perf_counter(), time.process_time()
        out, (self.t, self.c) = (t - self.t, c - self.c), (t, c)
        return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _window(rng: random.Random, step: int, names: list, size: int) -> list:
    """The flight recorder's window of a spike (schema 1.5): ``size`` steps up to and including it."""
    out = []
    for s in range(max(0, step - size + 1), step + 1):
        g = 1 + rng.random()
        out.append({"step": s, "global_norm": g, "loss": 2.0, "lr": 0.001, "max_ratio": 1 + rng.random(),
                    "max_ratio_layer": names[s % len(names)], "action": "accepted" if s < step else "skip",
                    "update_rms": 0.001 * g})
    return out


def write_log(path: str, summaries: int, spikes: int, layers: int, seed: int = 0, window: int = 64,
              aggregates: bool = True) -> None:
    rng = random.Random(seed)
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(layers)]
    spike_steps = set(rng.sample(range(summaries), spikes))
    rid = "scale-run"
    head = f'{{"schema_version":"1.5","kind":"%s","run_id":"{rid}","step":%d,"time":%.3f,"rank":0,'
    with open(path, "w") as f:
        f.write(json.dumps({"schema_version": "1.5", "kind": "run_start", "run_id": rid, "step": 0, "time": 0.0,
                            "rank": 0, "config": {"spike_threshold": 10.0, "log_every": 1}, "optimizer": "AdamW",
                            "n_params": 2 * layers, "n_layers": layers, "layer_names": names}) + "\n")
        spikes_done = 0
        for step in range(summaries):
            if step in spike_steps:
                layer = names[rng.randrange(layers)]
                ratio = 10 + rng.random() * 1000
                norms = {n: rng.random() for n in names}
                norms.update({n + ".weight": rng.random() for n in names})
                norms[layer] = ratio
                rec = {"layer": layer, "ratio": ratio, "grad_norm": ratio, "baseline": 1.0, "threshold": 10.0,
                       "action": "skip", "loss": 2.0, "global_norm": ratio, "spike_layers": {layer: ratio},
                       "layer_norms": norms, "ema_baselines": {n: 1.0 for n in norms}, "nan_layers": []}
                if window:
                    rec["window"] = _window(rng, step, names, window)
                    rec["origin_ranks"] = None
                f.write(head % ("spike", step, step * 0.1) + json.dumps(rec)[1:] + "\n")
                spikes_done += 1
            g = 1 + rng.random()
            line = (head % ("step_summary", step, step * 0.1)
                    + '"global_norm":%.6f,"max_ratio":%.4f,"max_ratio_layer":"%s","loss":%.5f,"lr":0.001,'
                      '"threshold":10.0,"steps":%d,"spikes":%d,"nonfinite":0,"skipped":%d,"rollbacks":0'
                    % (g, 1 + rng.random(), names[step % layers], 2.0, step + 1, spikes_done, spikes_done))
            if aggregates:  # schema 1.5: aggregates over the summary window (one step here: log_every=1)
                line += (',"window_steps":1,"global_norm_mean":%.6f,"global_norm_max":%.6f,"loss_mean":2.0,'
                         '"loss_max":2.0,"update_rms_mean":%.6f,"clipped":0,"would_refuse":0,'
                         '"refused_max_ratio":null,"refused_max_ratio_layer":null' % (g, g, 0.001 * g))
            f.write(line + "}\n")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--summaries", type=int, default=1_000_000)
    ap.add_argument("--spikes", type=int, default=10_000)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--window", type=int, default=64, help="flight-recorder steps per spike (0: none)")
    ap.add_argument("--no-aggregates", action="store_true", help="summaries without the schema-1.5 aggregates")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--no-cli", dest="cli", action="store_false",
                    help="skip the end-to-end timing of `stabilityguard report` in a new process")
    ap.add_argument("--keep", action="store_true", help="keep the log and the report (deleted by default: 770 MB)")
    args = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="sg-scale-")
    try:
        return _run(args, tmp)
    finally:
        if args.keep:
            print(f"log and report kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: str) -> dict:
    from stabilityguard.reports import layer_ranking, load_run, postmortem_markdown, severity_table

    path = os.path.join(tmp, "events-scale-run.jsonl")
    clock = Clock()
    write_log(path, args.summaries, args.spikes, args.layers, window=args.window,
              aggregates=not args.no_aggregates)
    size = os.path.getsize(path) / 1e6
    base_rss = rss_mb()
    timings = {"write (not part of the report)": clock.lap()}
    run = load_run(tmp)
    timings["load_run"] = clock.lap()
    severity_table(run)
    layer_ranking(run)
    timings["severity_table + layer_ranking"] = clock.lap()
    images: dict = {}
    if not args.no_plots:
        from stabilityguard.reports.plots import heatmap_plot, incident_plot, timeline_plot
        from stabilityguard.reports.postmortem import _closeup_steps

        clock.lap()
        images = {"timeline": timeline_plot(run, os.path.join(tmp, "timeline.png")),
                  "heatmap": heatmap_plot(run, os.path.join(tmp, "heatmap.png"))}
        timings["plots (timeline, heatmap)"] = clock.lap()
        for step, seg in _closeup_steps(run, 8):
            images[f"incident_{step}"] = incident_plot(run, step, os.path.join(tmp, f"incident_{step}.png"), seg)
        timings["incident close-ups (8)"] = clock.lap()
    # as write_report does: the markdown once (with the image links), then the page with the images inlined
    from stabilityguard.reports.postmortem import markdown_to_html

    md = postmortem_markdown(run, {k: os.path.basename(p) for k, p in images.items()})
    timings["postmortem_markdown"] = clock.lap()
    if not args.no_plots:
        markdown_to_html(md, images)
        timings["postmortem.html (images inlined)"] = clock.lap()
    cli = None
    if args.cli:
        # what a user runs: a new process (interpreter start and imports included), load + write_report
        import subprocess

        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from stabilityguard.cli import main; sys.exit(main())",
                        "report", tmp, "-o", os.path.join(tmp, "cli-report")] + (["--no-plots"] if args.no_plots else []),
                       check=True, stdout=subprocess.DEVNULL,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [
                           os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                           os.environ.get("PYTHONPATH")]))))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cli = (time.perf_counter() - t0, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime))
    total = sum(v[0] for k, v in timings.items() if not k.startswith("write"))
    total_cpu = sum(v[1] for k, v in timings.items() if not k.startswith("write"))
    print(f"# report scale: {args.summaries:,} step summaries, {len(run.incidents):,} spikes "
          f"({args.window}-step windows: {len(run.windows):,} rows), {args.layers} layers, log {size:.0f} MB"
          + ("" if not args.no_aggregates else ", summaries without aggregates"))
    print("| phase | seconds | CPU seconds (all threads) |")
    print("|---|---:|---:|")
    for k, (wall, cpu) in timings.items():
        print(f"| {k} | {wall:.2f} | {cpu:.2f} |")
    print(f"| **report total** | **{total:.2f}** | {total_cpu:.2f} |")
    if cli:
        print(f"| `stabilityguard report` end to end (a new process: start, imports, load, write_report) "
              f"| **{cli[0]:.2f}** | {cli[1]:.2f} |")
    print(f"peak RSS {rss_mb():.0f} MB (before loading: {base_rss:.0f} MB)")
    assert len(run.steps) == args.summaries and len(run.incidents) == args.spikes and not run.problems
    return {"timings": {k: v[0] for k, v in timings.items()}, "cpu": {k: v[1] for k, v in timings.items()},
            "peak_rss_mb": rss_mb(), "log_mb": size, "cli": cli}


if __name__ == "__main__":
    main()
