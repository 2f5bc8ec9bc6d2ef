"""Grafana dashboards of a hearth mesh: panel definitions, their Grafana JSON, the plugin's macros, PNG renders."""
