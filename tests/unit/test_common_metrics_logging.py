"""hearth/services/common metrics and logging helpers: shared collectors, the /metrics server, log levels."""

from __future__ import annotations

import logging
import socket
import urllib.parse
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from hearth.services.common.lifecycle import CommandRefused
from hearth.services.common.logging import configure_logging, parse_log_level
from hearth.services.common.metrics import counter, gauge, histogram, render_metrics, sample_value, start_metrics_server


def test_collectors_are_created_once_per_registry_and_name():
    registry = CollectorRegistry()
    first = counter("hearth_test_things_total", "things", ["kind"], registry=registry)
    assert counter("hearth_test_things_total", "things", ["kind"], registry=registry) is first
    first.labels(kind="a").inc(3)
    assert sample_value("hearth_test_things_total", {"kind": "a"}, registry=registry) == 3
    assert sample_value("hearth_test_things_total", {"kind": "never"}, registry=registry) == 0
    with pytest.raises(ValueError, match="already exists"):
        gauge("hearth_test_things_total", "things", registry=registry)
    histogram("hearth_test_seconds", "latency", buckets=(0.1, 1.0), registry=registry).observe(0.5)
    assert 'hearth_test_seconds_bucket{le="1.0"} 1.0' in render_metrics(registry)


def test_the_metrics_server_serves_the_registry_and_stops():
    registry = CollectorRegistry()
    counter("hearth_test_served_total", "served", registry=registry).inc()
    server = start_metrics_server(0, host="127.0.0.1", registry=registry)
    try:
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
        assert "hearth_test_served_total 1.0" in body
    finally:
        server.stop()
    assert not server._thread.is_alive()  # woken out of its wait for a connection, it saw the stop
    with pytest.raises(OSError):
        urllib.request.urlopen(server.url, timeout=2)


def test_a_metrics_port_already_taken_is_refused_in_one_line_naming_it():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(CommandRefused, match=f"--metrics-port {port}: cannot listen on 127.0.0.1:{port}: "):
            start_metrics_server(port, host="127.0.0.1", registry=CollectorRegistry())


@pytest.mark.parametrize("host", ["::1", "::"])
def test_a_metrics_server_on_ipv6_prints_a_url_it_can_be_scraped_at(host):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    server = start_metrics_server(0, host=host, registry=CollectorRegistry())
    try:
        assert server.url == f"http://[::1]:{server.port}/metrics"
        assert urllib.parse.urlsplit(server.url).port == server.port
        urllib.request.urlopen(server.url, timeout=5).read()
    finally:
        server.stop()


def test_log_levels_parse_by_name_or_number_and_reject_nonsense():
    assert parse_log_level("debug") == logging.DEBUG
    assert parse_log_level(" WARNING ") == logging.WARNING
    assert parse_log_level("15") == 15 and parse_log_level(40) == 40
    with pytest.raises(ValueError, match="unknown log level"):
        parse_log_level("loud")


def test_configure_logging_sets_the_root_level_and_writes_to_the_current_stderr(capsys):
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    try:
        configure_logging("warning")
        assert root.level == logging.WARNING
        logging.getLogger("hearth.test").warning("visible %d", 1)
        logging.getLogger("hearth.test").info("hidden")
        err = capsys.readouterr().err
        assert "WARNING" in err and "hearth.test: visible 1" in err and "hidden" not in err
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
