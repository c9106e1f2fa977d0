"""The page of one game day: an HTML file beside its journal, readable from a CI artifact on
a machine with no network (nothing is fetched). Plotly's script (4.8 MB, nearly all of a
page) is one file beside the pages of a report directory, `plotly.min.js`, not inlined in
each; a page copied alone still opens, its charts each saying what they miss, and
`write_page(..., standalone=True)` (`gameday report JOURNAL --standalone`) inlines it.

It shows what an on-call engineer asks first: did the stop hold (status, verdicts with the
events that prove them), what happened when (a timeline with a lane per agent, fault windows
shaded, as Jepsen's timeline.html does), how long the stop took (time-to-stop per part), and
how to replay it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from plotly.offline import get_plotlyjs

from harness.judge.stops import stops
from harness.judge.time_to_stop import PARTS, TOTAL
from harness.record.history import Event, History, Operation
from harness.report.answer import answer, required_of
from harness.report.answer import replay_command as answer_replay

OPERATORS = "operators"
NS = 1_000_000_000
MS = 1_000_000
FLEET_KILL, AGENT_KILL = "kill_fleet", "kill_agent"
OUTCOME_COLOURS = {"ok": "#2e7d32", "refused": "#78909c", "fail": "#c62828",
                   "info": "#f9a825"}
# A wake path answering 409 while a stop stands is the stop holding (DESIGN §2.3.3), not an
# operation failing: drawn grey as "refused", never red.
REFUSAL_STATUS = 409
WAKE_PATHS = ("wake", "fire_heartbeat", "trigger")
PERCENTILE_COLOURS = {"p50": "#1b5e20", "p90": "#ef6c00", "p99": "#b71c1c"}
PART_LABELS = {"kill_acknowledged": "kill acknowledged", "last_action": "last agent action",
               "daemon_exit": "daemon exit", "sandbox_gone": "sandbox gone",
               "tasks_requeued": "tasks requeued", TOTAL: "stopped in every respect"}

# coveyd's exit codes (README): what each means for the stop under test.
EXIT_MEANINGS = {0: "asleep", 1: "error", 2: "own guard", 3: "kill switch"}
SYMBOLS = {"agent action (puppet ledger)": ("line-ns-open", "#555555", 9),
           "sandbox gone": ("square-open", "#6a1b9a", 10),
           "tasks requeued": ("triangle-up", "#00838f", 11),
           "daemon exit 0 (asleep)": ("x", "#757575", 10),
           "daemon exit 2 (own guard)": ("x", "#ef6c00", 11),
           "daemon exit 3 (kill switch)": ("x", "#2e7d32", 11)}

# The chart script shared by a report directory's pages (and its index page).
PLOTLY_FILE = "plotly.min.js"
# Where the shared script is missing (a page copied out of its directory), a stand-in draws,
# in place of each chart, what it needs: the page's text (verdicts, figures, replay) is all
# there without it, and the console stays free of errors.
PLOTLY_MISSING = Markup("""<script>
if (!window.Plotly) {
  window.Plotly = {newPlot: function (where) {
    var div = typeof where === "string" ? document.getElementById(where) : where;
    if (div) {
      div.className += " chart-missing";
      div.textContent = "This chart needs plotly.min.js beside the page (it is in the " +
        "report directory the page came from), or a page with it inlined: " +
        "gameday report JOURNAL --standalone";
    }
    return Promise.resolve(div);
  }};
}
</script>""")

TEMPLATES = Environment(loader=PackageLoader("harness.report", "templates"),
                         autoescape=select_autoescape(["html"]), trim_blocks=True,
                         lstrip_blocks=True)


@dataclass(frozen=True)
class Clock:
    """Milliseconds from the switch (the first kill's request; with no kill, the game day's
    first event): what the timeline's axis and every time on the page read. A time before
    the switch is negative."""

    zero_ns: int
    switched: bool = True

    def ms(self, time_ns: int) -> float:
        return round((time_ns - self.zero_ns) / MS, 3)

    @property
    def origin(self) -> str:
        return "the switch" if self.switched else "the game day's first event"


def write_page(journal_path: Path, standalone: bool = False) -> Path:
    """Render the page of the journal at `journal_path` beside it (same name, `.html`): with
    the report directory's shared chart script, or with the script inlined (`standalone`)."""
    journal = json.loads(journal_path.read_text())
    history_path = journal_path.with_name(journal.get("history") or "")
    history = History.from_jsonl(history_path) if history_path.is_file() else History()
    page = journal_path.with_suffix(".html")
    page.write_text(render_page(journal, history, plotly_script(page.parent, standalone),
                                 journal_path))
    return page


def plotly_script(report_dir: Path, standalone: bool = False) -> Markup:
    """The chart script's tags for a page in `report_dir`: inlined when `standalone`, else a
    reference to the directory's `plotly.min.js` (written there when missing or of another
    Plotly version) with the stand-in for a page that travelled without it."""
    script = get_plotlyjs()
    if standalone:
        return Markup("<script>") + Markup(script) + Markup("</script>")
    shared = report_dir / PLOTLY_FILE
    if not (shared.is_file() and shared.stat().st_size == len(script.encode())
            and shared.read_text() == script):
        # Game days finishing at once share the directory: each writes its own copy and
        # renames it into place, so no page ever reads a half-written script.
        fd, name = tempfile.mkstemp(prefix=".plotly-", suffix=".js", dir=report_dir)
        with os.fdopen(fd, "w") as out:
            out.write(script)
        os.chmod(name, 0o644)
        os.replace(name, shared)
    return Markup(f'<script src="{PLOTLY_FILE}"></script>\n') + PLOTLY_MISSING


def render_page(journal: dict[str, Any], history: History,
                plotly: Markup | None = None, journal_path: Path | None = None) -> str:
    """The page's HTML; `plotly`: the chart script's tags (default: inlined)."""
    events = sorted(history, key=lambda e: e.time_ns)
    kills = [s.kill.start_ns for s in stops(history)]
    first = min([e.time_ns for e in events] + [f["started_ns"] for f in journal["faults"]],
                default=_ns(journal["started_at"]))
    clock = Clock(min(kills), True) if kills else Clock(first, False)
    lanes = agent_lanes(journal)
    evidence = {i: history[i] for v in journal["verdicts"] for i in v["evidence"]
                if 0 <= i < len(history)}
    told = answer(journal, journal_path)
    return TEMPLATES.get_template("gameday.html").render(
        journal=journal, answer=told, replay=told.replay,
        plotly=plotly if plotly is not None else Markup("<script>") + Markup(get_plotlyjs())
        + Markup("</script>"),
        timeline=timeline(journal, history, clock, lanes).to_html(
            full_html=False, include_plotlyjs=False, div_id="timeline",
            config={"displaylogo": False, "responsive": True}),
        distribution=distribution(journal).to_html(
            full_html=False, include_plotlyjs=False, div_id="time-to-stop",
            config={"displaylogo": False, "responsive": True}),
        parts=part_rows(journal), evidence=evidence, clock=clock, lanes=lanes,
        faults=[{**f, "start_ms": clock.ms(f["started_ns"]),
                 "end_ms": clock.ms(f["healed_ns"]) if f["healed_ns"] else None}
                for f in journal["faults"]],
        required=required_of(journal), ran=ran(journal),
        rendered_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"))


def ran(journal: dict[str, Any]) -> str:
    """When the game day ran, to the second, and how long: not two ISO strings with
    microseconds."""
    start = datetime.fromisoformat(journal["started_at"])
    end = datetime.fromisoformat(journal["ended_at"])
    took = (end - start).total_seconds()
    return (f"{start.astimezone(UTC):%Y-%m-%d %H:%M:%S} → {end.astimezone(UTC):%H:%M:%S} UTC "
            f"({took:.0f} s)")


def replay_command(journal: dict[str, Any], journal_path: Path | None = None) -> str:
    """The command that replays this game day (harness/report/answer.py)."""
    return answer_replay(journal, journal_path)


def agent_lanes(journal: dict[str, Any]) -> dict[str, str]:
    """Agent id → its lane's label, in the journal's order."""
    return {a["id"]: f"{a['slug']} ({a['behaviour']})" for a in journal["agents"]}


def timeline(journal: dict[str, Any], history: History, clock: Clock,
             lanes: dict[str, str]) -> go.Figure:
    """One lane per agent and one for the operators; fault windows shaded across all."""
    fig = go.Figure()
    order = [OPERATORS, *lanes.values()]
    sessions = session_spans(history, lanes)
    fig.add_trace(go.Bar(
        name="session", orientation="h", y=[s[0] for s in sessions],
        base=[clock.ms(s[1]) for s in sessions], x=[(s[2] - s[1]) / MS for s in sessions],
        marker={"color": "rgba(66, 133, 244, 0.25)", "line": {"width": 0}}, width=0.6,
        hovertemplate="session from %{base:.1f} ms for %{x:.1f} ms<extra></extra>"))
    points: dict[str, list[tuple[str, float, str]]] = defaultdict(list)
    for e in history:
        lane = lanes.get(e.agent_id or "")
        if e.f == "action" and lane:
            points["agent action (puppet ledger)"].append(
                (lane, clock.ms(e.time_ns), f"step {e.value.get('step')}"))
        elif e.f == "daemon_exit" and lane:
            code = e.value.get("exit_code")
            meaning = EXIT_MEANINGS.get(code, "unknown code") if isinstance(code, int) \
                else "unknown code"
            name = f"daemon exit {code} ({meaning})"
            points[name].append((lane, clock.ms(e.time_ns), f"exit {code}"))
        elif e.f == "sandbox_gone" and lane:
            points["sandbox gone"].append((lane, clock.ms(e.time_ns), "sandbox gone"))
    for sample in journal["measurements"]["time_to_stop"]["samples_ns"]:
        lane = lanes.get(sample["agent_id"])
        kill = history[sample["kill_index"]] if sample["kill_index"] < len(history) else None
        if lane and kill is not None and sample["tasks_requeued_ns"] is not None:
            points["tasks requeued"].append(
                (lane, clock.ms(kill.time_ns + sample["tasks_requeued_ns"]), "tasks open again"))
    for name, rows in sorted(points.items()):
        symbol, colour, size = SYMBOLS.get(name, ("x", "#c62828", 11))
        fig.add_trace(go.Scatter(
            name=name, mode="markers", y=[r[0] for r in rows], x=[r[1] for r in rows],
            text=[r[2] for r in rows], marker={"symbol": symbol, "color": colour,
                                               "size": size},
            hovertemplate="%{text} at %{x:.1f} ms<extra>%{fullData.name}</extra>"))
    operator_trace(fig, history, clock, lanes)
    kill_shapes, kill_notes = kill_lines(history, clock)
    fault_shapes, fault_notes = fault_windows(journal, clock)
    shapes, annotations = kill_shapes + fault_shapes, kill_notes + fault_notes
    fig.update_layout(
        shapes=shapes, annotations=annotations, barmode="overlay",
        height=160 + 30 * len(order), margin={"l": 10, "r": 10, "t": 40, "b": 40},
        xaxis={"title": {"text": f"ms after {clock.origin}"}, "zeroline": clock.switched,
               "zerolinecolor": "#b71c1c"},
        yaxis={"type": "category", "categoryorder": "array",
               "categoryarray": list(reversed(order)), "automargin": True},
        legend={"orientation": "h", "y": 1.02, "yanchor": "bottom"},
        plot_bgcolor="white")
    return fig


def session_spans(history: History, lanes: dict[str, str]) -> list[tuple[str, int, int]]:
    """(lane, start, end) of each session: from its start to its sandbox's end, or to the
    agent's next daemon exit, or to the game day's last event."""
    end_of_day = max((e.time_ns for e in history), default=0)
    exits: dict[str, list[Event]] = defaultdict(list)
    for e in history:
        if e.f == "daemon_exit" and e.agent_id:
            exits[e.agent_id].append(e)
    spans = []
    for e in history:
        if e.f != "session_start" or e.agent_id not in lanes:
            continue
        agent_exits = sorted((x for x in exits[e.agent_id] if x.time_ns >= e.time_ns),
                             key=lambda x: x.time_ns)
        own = [x for x in agent_exits if x.value.get("sandbox_id") == e.value.get("sandbox_id")
               and e.value.get("sandbox_id")]
        end = (own or agent_exits)[0].time_ns if (own or agent_exits) else end_of_day
        spans.append((lanes[e.agent_id], e.time_ns, end))
    return spans


def operator_trace(fig: go.Figure, history: History, clock: Clock,
                   lanes: dict[str, str]) -> None:
    """Each operator operation as a bar from its invoke to its completion, coloured by
    outcome (an operation with no completion runs to the end: its outcome is unknown)."""
    end_of_day = max((e.time_ns for e in history), default=0)
    rows = []
    for op in history.operations():
        if not op.process.startswith("operator:"):
            continue
        end = op.end_ns if op.end_ns is not None else end_of_day
        target = lanes.get(op.agent_id or "", "")
        status = op.value.get("status", "")
        rows.append((clock.ms(op.start_ns), max((end - op.start_ns) / MS, 2.0), outcome_of(op),
                     f"{op.f} by {op.process.removeprefix('operator:')} {target} → "
                     f"{outcome_of(op)} {status}".strip()))
    for outcome, colour in OUTCOME_COLOURS.items():
        mine = [r for r in rows if r[2] == outcome]
        if mine:
            fig.add_trace(go.Bar(
                name="refused (409, as it should while stopped)" if outcome == "refused"
                else f"operation {outcome}", orientation="h", y=[OPERATORS] * len(mine),
                base=[r[0] for r in mine], x=[r[1] for r in mine], text=[r[3] for r in mine],
                marker={"color": colour}, width=0.5, textposition="none",
                hovertemplate="%{text}<br>at %{base:.1f} ms, took %{x:.1f} ms<extra></extra>"))


def outcome_of(op: Operation) -> str:
    """ok, refused (a wake path's 409: the stop held, DESIGN §2.3.3), fail or info."""
    if op.type == "fail" and op.f in WAKE_PATHS and op.value.get("status") == REFUSAL_STATUS:
        return "refused"
    return str(op.type)


def kill_lines(history: History, clock: Clock) -> tuple[list[dict[str, Any]],
                                                         list[dict[str, Any]]]:
    """A fleet kill's invoke (solid) and acknowledgement (dotted) as lines across every
    lane, labelled once: who pulled it and how long the answer took."""
    shapes, annotations = [], []
    for op in history.operations(FLEET_KILL):
        if op.type != "ok":
            continue
        ends = [(op.start_ns, "solid")] + ([(op.end_ns, "dot")] if op.end_ns else [])
        for at, dash in ends:
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": clock.ms(at),
                           "x1": clock.ms(at), "y0": 0, "y1": 1, "name": "fleet-kill",
                           "line": {"color": "#b71c1c", "width": 1.5, "dash": dash}})
        answered = (f", answered in {(op.end_ns - op.start_ns) / 1e6:.0f} ms"
                    if op.end_ns else ", answer never seen")
        annotations.append({"x": clock.ms(op.start_ns), "y": 1, "xref": "x", "yref": "paper",
                            "xanchor": "right", "yanchor": "bottom", "showarrow": False,
                            "text": f"fleet switch pulled by "
                                    f"{op.process.removeprefix('operator:')}{answered}",
                            "font": {"color": "#b71c1c", "size": 11}})
    return shapes, annotations


def fault_windows(journal: dict[str, Any], clock: Clock) -> tuple[list[dict[str, Any]],
                                                                   list[dict[str, Any]]]:
    """Each fault shaded from its start until it healed (an unhealed one: to its deadline,
    hatched darker, because it was still standing when the game day was judged)."""
    shapes, annotations = [], []
    for f in journal["faults"]:
        end = f["healed_ns"] or f["heals_at_ns"]
        shapes.append({"type": "rect", "xref": "x", "yref": "paper",
                       "x0": clock.ms(f["started_ns"]), "x1": clock.ms(end), "y0": 0, "y1": 1,
                       "name": f"fault:{f['id']}", "layer": "below", "line": {"width": 0},
                       "fillcolor": "rgba(229, 57, 53, 0.12)" if f["healed_ns"]
                       else "rgba(229, 57, 53, 0.35)"})
        annotations.append({"x": clock.ms(f["started_ns"]), "y": 0, "xref": "x",
                            "yref": "paper", "xanchor": "left", "yanchor": "bottom",
                            "showarrow": False, "font": {"size": 11, "color": "#b71c1c"},
                            "text": f"{f['kind']} {f['target']}"
                                    + ("" if f["healed_ns"] else " (never healed)")})
    return shapes, annotations


def distribution(journal: dict[str, Any]) -> go.Figure:
    """Time-to-stop per part: every raw sample, with p50, p90 and p99 marked."""
    samples = journal["measurements"]["time_to_stop"]["samples_ns"]
    summary = journal["measurements"]["time_to_stop"]["summary_us"]
    fig = go.Figure()
    shown: set[str] = set()
    for part in (*PARTS, TOTAL):
        values = [_total(s) if part == TOTAL else s[f"{part}_ns"] for s in samples]
        ms = [v / 1e6 for v in values if v is not None]
        if not ms:
            continue
        label = PART_LABELS[part]
        fig.add_trace(go.Box(y=ms, name=label, boxpoints="all", jitter=0.5, pointpos=0,
                             line={"width": 1}, fillcolor="rgba(0,0,0,0)",
                             marker={"size": 6, "color": "#1565c0"}, showlegend=False,
                             hovertemplate="%{y:.1f} ms<extra>" + label + "</extra>"))
        p = summary.get(part)
        for key, colour in PERCENTILE_COLOURS.items():
            if p:
                fig.add_trace(go.Scatter(
                    x=[label], y=[p[f"{key}_us"] / 1000], mode="markers", name=key,
                    legendgroup=key, showlegend=key not in shown,
                    marker={"symbol": "line-ew-open", "size": 30, "color": colour,
                            "line": {"width": 2.5}},
                    hovertemplate=key + " %{y:.1f} ms<extra>" + label + "</extra>"))
                shown.add(key)
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 20, "b": 40},
                      yaxis={"title": {"text": "ms after the kill was pulled"},
                             "rangemode": "tozero"}, plot_bgcolor="white")
    return fig


def part_rows(journal: dict[str, Any]) -> list[dict[str, Any]]:
    """Each part's percentiles in ms; a percentile never above the max (a journal written
    before summarize capped them could hold 198.3 against 198.2)."""
    summary = journal["measurements"]["time_to_stop"]["summary_us"]
    return [{"part": PART_LABELS.get(part, part), "count": p["count"],
             "max_us": p["max_us"] / 1000,
             **{k: min(v, p["max_us"]) / 1000 for k, v in p.items()
                if k not in ("count", "max_us")}}
            for part, p in summary.items()]


def _total(sample: dict[str, Any]) -> int | None:
    parts = [sample[f"{p}_ns"] for p in PARTS if sample.get(f"{p}_ns") is not None]
    return max(parts) if parts else None


def _ns(timestamp: str) -> int:
    return int(datetime.fromisoformat(timestamp).timestamp() * NS)
