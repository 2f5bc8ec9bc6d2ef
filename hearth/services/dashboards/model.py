"""What a dashboard is made of, independent of Grafana's JSON: SQL panels over the read model, PromQL panels.

A `SqlPanel` runs on the read model through Grafana's SQLite datasource (frser-sqlite-datasource) and may use
its time macros (`$__timeFilter(col)`, `$__unixEpochGroupSeconds(col, seconds)`) and Grafana's `$__from` /
`$__to` (epoch milliseconds); `columns` are the columns the panel draws, checked by the tests. A `PromPanel`
queries Prometheus with the metric names agreed with the metrics side (hearth/services/dashboards/panels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

PanelKind = Literal["timeseries", "table", "barchart"]

READ_MODEL_DATASOURCE = {"type": "frser-sqlite-datasource", "uid": "hearth-readmodel"}
PROMETHEUS_DATASOURCE = {"type": "prometheus", "uid": "hearth-prometheus"}


@dataclass(frozen=True)
class SqlPanel:
    """A panel whose one query runs on the read model; time series return a `time` column (epoch s)."""

    title: str
    kind: PanelKind
    sql: str
    columns: tuple[str, ...]
    description: str = ""
    unit: str | None = None
    bars: bool = False  # time series drawn as stacked bars (counts per bucket)

    @property
    def time_series(self) -> bool:
        return self.kind == "timeseries"


@dataclass(frozen=True)
class PromTarget:
    expr: str
    legend: str


@dataclass(frozen=True)
class PromPanel:
    """A time-series panel of PromQL expressions (live metrics the read model does not keep)."""

    title: str
    targets: tuple[PromTarget, ...]
    description: str = ""
    unit: str | None = None
    kind: PanelKind = "timeseries"


Panel = SqlPanel | PromPanel


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)

    @property
    def sql_panels(self) -> list[SqlPanel]:
        return [panel for panel in self.panels if isinstance(panel, SqlPanel)]
