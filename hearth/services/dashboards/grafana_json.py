"""Turns the dashboards of hearth/services/dashboards/panels.py into Grafana dashboard JSON under grafana/dashboards/.

`hearth dashboards build` writes the files (`--check` fails if a committed file differs, as the drift test
does); Grafana loads them through grafana/provisioning/dashboards/hearth.yaml. Panels are laid out two per
row, in the order they are defined.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hearth.services.dashboards.model import (
    PROMETHEUS_DATASOURCE, READ_MODEL_DATASOURCE, Dashboard, PromPanel, SqlPanel,
)
from hearth.services.dashboards.panels import DASHBOARDS
from hearth.services.dashboards.routing_sql import ROUTING_VARIABLES
from hearth.services.common.hearth_files import data_dir

DASHBOARDS_DIR = data_dir("grafana") / "dashboards"
PANEL_WIDTH = 12
PANEL_HEIGHT = 8
GRAFANA_SCHEMA_VERSION = 39


def dashboard_json(dashboard: Dashboard) -> dict[str, Any]:
    panels = []
    for index, panel in enumerate(dashboard.panels):
        grid = {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": (index % 2) * PANEL_WIDTH, "y": (index // 2) * PANEL_HEIGHT}
        panels.append(_panel_json(panel, index + 1, grid))
    return {
        "uid": dashboard.uid,
        "title": dashboard.title,
        "description": dashboard.description,
        "tags": ["hearth"],
        "timezone": "browser",
        "editable": True,
        "refresh": "30s",
        "schemaVersion": GRAFANA_SCHEMA_VERSION,
        "time": {"from": "now-6h", "to": "now"},
        "panels": panels,
        "templating": {"list": _routing_constants(dashboard)},
    }


def _routing_constants(dashboard: Dashboard) -> list[dict[str, Any]]:
    """The routing settings its SQL names (`${name}`), as hidden constants: only an editor changes them (to the
    mesh's [research.distributed_inference] values), and a viewer cannot put text into a query through them."""
    used = [name for name in ROUTING_VARIABLES if any(f"${{{name}}}" in panel.sql for panel in dashboard.sql_panels)]
    return [{"type": "constant", "name": name, "hide": 2, "query": f"{ROUTING_VARIABLES[name]:g}",
             "current": {"text": f"{ROUTING_VARIABLES[name]:g}", "value": f"{ROUTING_VARIABLES[name]:g}"},
             "description": f"[research.distributed_inference] {name} of the mesh's orchestrators (routing_sql.py)"}
            for name in used]


def _panel_json(panel: SqlPanel | PromPanel, panel_id: int, grid: dict[str, int]) -> dict[str, Any]:
    if isinstance(panel, SqlPanel):
        datasource = READ_MODEL_DATASOURCE
        targets = [{
            "refId": "A",
            "datasource": datasource,
            "queryText": panel.sql,
            "rawQueryText": panel.sql,
            "queryType": "time series" if panel.time_series else "table",
            "timeColumns": ["time"],
        }]
        bars = panel.bars
    else:
        datasource = PROMETHEUS_DATASOURCE
        targets = [
            {"refId": chr(ord("A") + n), "datasource": datasource, "expr": target.expr,
             "legendFormat": target.legend, "range": True}
            for n, target in enumerate(panel.targets)
        ]
        bars = False
    defaults: dict[str, Any] = {}
    if panel.unit:
        defaults["unit"] = panel.unit
    if bars:
        defaults["custom"] = {"drawStyle": "bars", "fillOpacity": 80, "stacking": {"mode": "normal"}}
    options: dict[str, Any] = {}
    if panel.kind == "barchart":
        options = {"xField": panel.columns[0], "orientation": "horizontal", "showValue": "auto"}
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": datasource,
        "gridPos": grid,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options,
    }


def rendered_files() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {f"{d.uid}.json": json.dumps(dashboard_json(d), indent=2) + "\n" for d in DASHBOARDS}


def write_dashboards(out_dir: Path = DASHBOARDS_DIR, *, check: bool = False) -> list[str]:
    """Write every dashboard's JSON into `out_dir`; with `check`, write nothing and return the stale files."""
    stale = []
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in rendered_files().items():
        path = out_dir / name
        if path.exists() and path.read_text() == text:
            continue
        stale.append(name)
        if not check:
            path.write_text(text)
    return stale
