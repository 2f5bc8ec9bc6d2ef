"""`hearth nats` refuses ports out of range before nats-server starts (a usage error; before, nats-server started and
its whole log came back), and a broker certificate that has ended; a nats-server that exits at start is said in one
line: why it said it exited."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from hearth.services.broker.server import why_it_exited
from hearth.services.broker.tls import write_throwaway_ca
from hearth.services.cli import app


@pytest.mark.parametrize(("option", "value"), [("--port", "70000"), ("--port", "-3"), ("--port", "0"),
                                               ("--cluster-port", "99999"), ("--monitor-port", "65536")])
def test_a_port_out_of_range_is_a_usage_error(option, value, tmp_path):
    result = CliRunner().invoke(app, ["nats", "--store", str(tmp_path / "store"), option, value])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '{option}'" in result.output
    assert not (tmp_path / "store").exists()  # nothing was started


def test_a_cluster_whose_node_ports_pass_the_last_port_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(app, ["nats", "--store", str(tmp_path / "store"), "--cluster", "3", "--port",
                                      "65534"])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hearth nats: --cluster 3 numbers its nodes' ports"), lines
    assert not (tmp_path / "store").exists()


def test_a_broker_certificate_that_has_ended_is_refused_in_one_line_before_anything_starts(tmp_path):
    # Every member's handshake would fail, each saying only that the handshake failed.
    ended = write_throwaway_ca(tmp_path / "tls", validity_days=0)
    result = CliRunner().invoke(app, ["nats", "--store", str(tmp_path / "store"), "--tls-cert",
                                      str(ended.server_cert_file), "--tls-key", str(ended.server_key_file)])
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "ended on" in lines[0] and "tls --replace" in lines[0], lines
    assert not (tmp_path / "store").exists()


BANNER = """[7] 2026/12/06 10:36:17.935764 [INF] Starting nats-server
[7] 2026/12/06 10:36:17.935890 [INF]   Version:  2.15.1
[7] 2026/12/06 10:36:17.935894 [INF]   Name:     NALUFSNMANWWQN7A52M3YSUXKQTJERSUVS47BGSD5OLRETMXKILUQ6NH
"""


@pytest.mark.parametrize(("log", "why"), [
    (BANNER + '[7] 2026/12/06 10:36:17.937106 [FTL] Error listening on port: 0.0.0.0:4222, "listen tcp: bad"\n'
     "[7] 2026/12/06 10:36:17.937200 [INF] Server Exiting..\n",
     'Error listening on port: 0.0.0.0:4222, "listen tcp: bad"'),
    (BANNER + "nats-server: st/hearth-nats.conf:7:1: error parsing X509 certificate/key pair: open /nope.pem\n",
     "st/hearth-nats.conf:7:1: error parsing X509 certificate/key pair: open /nope.pem"),
    (BANNER, "Name:     NALUFSNMANWWQN7A52M3YSUXKQTJERSUVS47BGSD5OLRETMXKILUQ6NH"),
    ("", "it said nothing"),
], ids=["fatal-record", "configuration-error", "no-error-said", "empty-log"])
def test_why_a_nats_server_exited_is_one_line(log, why):
    assert why_it_exited(log) == why
