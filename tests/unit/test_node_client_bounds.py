"""The Node client (clients/node/hearth_client.mjs) keeps its own copies of the bounds the Python clients read answers
by (hearth/services/client/answer_bound.py, hearth/protocol/chat_frames.py): they must say the same numbers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hearth.protocol.chat_frames import max_withdrawals_per_choice
from hearth.services.client.answer_bound import held_back_slack_bytes, max_text_bytes_per_token

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node" / "hearth_client.mjs"


def node_constant(name: str) -> int:
    found = re.search(rf"^const {name} = (\d+);", NODE_CLIENT.read_text(), re.MULTILINE)
    assert found is not None, f"{name} is not a plain number constant of {NODE_CLIENT.name}"
    return int(found.group(1))


@pytest.mark.parametrize(("node_name", "python_value"), [
    ("MAX_TEXT_BYTES_PER_TOKEN", max_text_bytes_per_token),
    ("HELD_BACK_SLACK_BYTES", held_back_slack_bytes),
    ("MAX_WITHDRAWALS_PER_CHOICE", max_withdrawals_per_choice),
])
def test_the_node_client_bounds_an_answer_as_the_python_clients_do(node_name, python_value):
    assert node_constant(node_name) == python_value
