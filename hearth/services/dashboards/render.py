"""Draws each dashboard as one PNG with matplotlib, from the same panel SQL Grafana runs, so a reader of the
README sees what Grafana shows for that read model.

The time range is the read model's own: from its first counted minute to its newest applied event, which is
"now" for the panels that ask what is live. Time series are pivoted as the SQLite plugin does (text columns
become series labels, every other column a value); Prometheus panels have no data in a read model and are
drawn as a labelled box naming their queries.
"""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

from hearth.services.common.sqlite_read_only import open_read_only
from hearth.services.dashboards.macros import TimeRange, run_panel_sql
from hearth.services.dashboards.model import Dashboard, PromPanel, SqlPanel
from hearth.services.dashboards.panels import DASHBOARDS

TABLE_MAX_ROWS = 12
CELL_MAX_CHARS = 28
COLUMNS = 2


class NoEvents(ValueError):
    """The read model has no applied event to draw a time range from."""


def data_time_range(connection: sqlite3.Connection) -> TimeRange:
    """From the first minute the read model counted an event to one second after its newest applied event."""
    first, = connection.execute("SELECT MIN(minute) FROM event_counts").fetchone()
    last, = connection.execute("SELECT MAX(last_event_at) FROM projection_positions").fetchone()
    if first is None or last is None:
        raise NoEvents("the read model holds no events yet")
    return TimeRange(first - 60, last + 1)


class RenderRefused(Exception):
    """`db` is nothing to draw: absent, not a migrated read model, or without events (the command says it in
    one line)."""


def render_all(db: Path, out_dir: Path) -> list[Path]:
    """One PNG per dashboard under `out_dir` (dashboard-<name>.png); returns their paths."""
    import matplotlib

    if not db.is_file():
        raise RenderRefused(f"no read model at {db} (run `hearth projector --db {db}`)")
    matplotlib.use("Agg")
    connection = open_read_only(db)
    try:
        time_range = data_time_range(connection)
        out_dir.mkdir(parents=True, exist_ok=True)
        return [render_dashboard(connection, dashboard, time_range, out_dir) for dashboard in DASHBOARDS]
    except sqlite3.DatabaseError as error:  # tables missing, or no SQLite database at all
        raise RenderRefused(f"{db} is not a migrated read model ({error})") from None
    except NoEvents as error:
        raise RenderRefused(f"{db}: {error}") from None
    finally:
        connection.close()


def render_dashboard(connection: sqlite3.Connection, dashboard: Dashboard, time_range: TimeRange,
                     out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = -(-len(dashboard.panels) // COLUMNS)
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(16, 3.6 * rows), squeeze=False)
    start = datetime.fromtimestamp(time_range.from_s, timezone.utc).strftime("%Y-%m-%d %H:%M")
    end = datetime.fromtimestamp(time_range.to_s, timezone.utc).strftime("%H:%M UTC")
    figure.suptitle(f"{dashboard.title}  ({start} to {end})", fontsize=15, x=0.01, ha="left")
    for index, axis in enumerate(axes.flat):
        if index >= len(dashboard.panels):
            axis.axis("off")
            continue
        panel = dashboard.panels[index]
        axis.set_title(panel.title, loc="left", fontsize=11)
        if isinstance(panel, PromPanel):
            _draw_prometheus(axis, panel)
        else:
            columns, result = run_panel_sql(connection, panel.sql, time_range)
            _draw_sql(axis, panel, columns, result, time_range)
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    path = out_dir / f"dashboard-{dashboard.uid.removeprefix('hearth-')}.png"
    figure.savefig(path, dpi=72)
    plt.close(figure)
    return path


def _draw_sql(axis, panel: SqlPanel, columns: list[str], rows: list[tuple], time_range: TimeRange) -> None:
    if not rows:
        axis.text(0.5, 0.5, "No data", ha="center", va="center", color="grey")
        axis.set_axis_off()
    elif panel.kind == "timeseries":
        _draw_time_series(axis, panel, columns, rows, time_range)
    elif panel.kind == "barchart":
        _draw_bars(axis, [str(row[0]) for row in rows], [row[1] or 0 for row in rows],
                   columns[1] + (f" ({panel.unit})" if panel.unit else ""))
    else:
        _draw_table(axis, columns, rows)


def _draw_bars(axis, labels: list[str], values: list[float], value_label: str) -> None:
    axis.barh(labels, values, color="tab:blue")
    axis.invert_yaxis()
    axis.set_xlabel(value_label)


def _draw_time_series(axis, panel: SqlPanel, columns: list[str], rows: list[tuple], time_range: TimeRange) -> None:
    """Long to wide as the plugin does: text columns label a series, numeric columns are its values."""
    import matplotlib.dates as mdates

    time_index = columns.index("time")
    label_indexes = [i for i, value in enumerate(rows[0]) if isinstance(value, str)]
    value_indexes = [i for i in range(len(columns)) if i != time_index and i not in label_indexes]
    series: dict[str, dict[datetime, float]] = defaultdict(dict)
    for row in rows:
        labels = " ".join(str(row[i]) for i in label_indexes)
        for i in value_indexes:
            name = labels if labels and len(value_indexes) == 1 else f"{columns[i]} {labels}".strip()
            series[name][_instant(row[time_index])] = row[i] or 0
    times = sorted({instant for points in series.values() for instant in points})
    if panel.bars and len(times) == 1:
        # One bucket (a day-long bucket of a short run): Grafana draws one group of bars; so do we.
        names = sorted(series)
        _draw_bars(axis, names, [series[name][times[0]] for name in names],
                   f"{columns[value_indexes[0]]} in the bucket of {times[0]:%Y-%m-%d %H:%M}")
        return
    if panel.bars:
        width = _bar_width_days(times)
        bottom = [0.0] * len(times)
        for name, points in sorted(series.items()):
            heights = [points.get(instant, 0) for instant in times]
            axis.bar(times, heights, width=width, bottom=bottom, label=name, align="edge")
            bottom = [b + h for b, h in zip(bottom, heights)]
    else:
        for name, points in sorted(series.items()):
            instants = sorted(points)
            axis.plot(instants, [points[t] for t in instants], marker="o", label=name)
    axis.set_xlim(_instant(time_range.from_s), _instant(time_range.to_s))
    locator = mdates.AutoDateLocator()
    axis.xaxis.set_major_locator(locator)
    axis.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
    if panel.unit:
        axis.set_ylabel(panel.unit)
    axis.legend(fontsize=8, loc="upper left")
    axis.grid(alpha=0.3)


def _instant(epoch_s: int) -> datetime:
    return datetime.fromtimestamp(epoch_s, timezone.utc)


def _bar_width_days(times: list[datetime]) -> float:
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:])]
    return 0.8 * (min(gaps) if gaps else 60.0) / 86400


def _draw_table(axis, columns: list[str], rows: list[tuple]) -> None:
    axis.set_axis_off()
    cells = [[_cell(value, column) for column, value in zip(columns, row)] for row in rows[:TABLE_MAX_ROWS]]
    table = axis.table(cellText=cells, colLabels=columns, loc="upper left", cellLoc="left")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    table.auto_set_column_width(list(range(len(columns))))
    if len(rows) > TABLE_MAX_ROWS:
        axis.text(0, 0, f"... {len(rows) - TABLE_MAX_ROWS} more rows", fontsize=8, color="grey")


def _cell(value, column: str) -> str:
    if value is None:
        return ""
    if column == "time":  # the plugin turns time columns into times
        return f"{_instant(value):%Y-%m-%d %H:%M:%S}"
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= CELL_MAX_CHARS else text[: CELL_MAX_CHARS - 1] + "…"


def _draw_prometheus(axis, panel: PromPanel) -> None:
    axis.set_xticks([])
    axis.set_yticks([])
    for spine in axis.spines.values():
        spine.set_linestyle("--")
        spine.set_color("grey")
    queries = "\n".join(target.expr for target in panel.targets)
    axis.text(0.02, 0.95, f"Prometheus (live metrics, not in the read model):\n{queries}", va="top", ha="left",
              fontsize=8, color="dimgrey", family="monospace", wrap=True, transform=axis.transAxes)
