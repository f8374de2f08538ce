"""Reports: turn event logs into tables, plots, and post-mortems in markdown and HTML (``report`` extra:
pandas, matplotlib).

Example:
    >>> from stabilityguard.reports import load_run, severity_table, layer_ranking, write_report
    >>> run = load_run("./sg_logs")            # the latest run in the directory  # doctest: +SKIP
    >>> layer_ranking(run).head()              # doctest: +SKIP
    >>> paths = write_report(run, "./sg_logs/report")  # postmortem.md/.html + plots  # doctest: +SKIP
    >>> paths["html"]                          # one file, plots inlined: for MLflow / W&B  # doctest: +SKIP
"""

from .compare import compare_table
from .load import SEVERITY_CLASSES, LogFormatError, Problem, RunLog, latest, load_run, load_runs, severity_of
from .postmortem import md_escape, next_steps, postmortem_html, postmortem_markdown, write_report
from .tables import (
    RANKING_RULE,
    SPIKE_SCORE_RULE,
    layer_ranking,
    run_summary,
    severity_by_layer,
    severity_table,
    spike_score,
)

__all__ = [
    "LogFormatError",
    "Problem",
    "RANKING_RULE",
    "RunLog",
    "SEVERITY_CLASSES",
    "SPIKE_SCORE_RULE",
    "compare_table",
    "latest",
    "layer_ranking",
    "load_run",
    "load_runs",
    "md_escape",
    "next_steps",
    "postmortem_html",
    "postmortem_markdown",
    "run_summary",
    "severity_by_layer",
    "severity_of",
    "severity_table",
    "spike_score",
    "write_report",
]
