"""The index page of a report directory: every scenario over time (p99 time-to-stop per
part, verdicts, agents), one chart per comparable group, each run linked to its page."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import plotly.graph_objects as go

from harness.report.page import PART_LABELS, TEMPLATES, plotly_script
from harness.report.runs import Run, groups, runs

INDEX_PAGE = "index.html"


def write_index(report_dir: Path, out: Path | None = None) -> Path:
    all_runs = runs(report_dir)
    out = out or report_dir / INDEX_PAGE
    charts = []
    for (scenario, stack, agents), group_runs in sorted(groups(all_runs).items()):
        charts.append({"title": f"{scenario} on {stack}, {agents} agents",
                       "runs": list(reversed(group_runs)),
                       "chart": chart(group_runs).to_html(
                           full_html=False, include_plotlyjs=False,
                           config={"displaylogo": False, "responsive": True})})
    out.write_text(TEMPLATES.get_template("trend.html").render(
        groups=charts, plotly=plotly_script(out.parent), count=len(all_runs),
        rendered_at=datetime.now(UTC).isoformat(timespec="seconds")))
    return out


def chart(group_runs: list[Run]) -> go.Figure:
    fig = go.Figure()
    parts = sorted({part for r in group_runs for part in r.p99_us})
    for part in parts:
        points = [r for r in group_runs if part in r.p99_us]
        fig.add_trace(go.Scatter(
            x=[r.started_at for r in points], y=[r.p99_us[part] / 1000 for r in points],
            mode="lines+markers", name=PART_LABELS.get(part, part),
            text=[f"{r.journal}: {r.status}" for r in points],
            marker={"symbol": ["circle" if r.status == "completed" else "x-thin-open"
                               for r in points], "size": 8},
            hovertemplate="%{y:.1f} ms<br>%{text}<extra>%{fullData.name}</extra>"))
    fig.update_layout(height=320, margin={"l": 10, "r": 10, "t": 10, "b": 30},
                      yaxis={"title": {"text": "p99 ms after the kill"},
                             "rangemode": "tozero"}, plot_bgcolor="white")
    return fig
