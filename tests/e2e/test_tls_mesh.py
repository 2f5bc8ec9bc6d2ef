"""The whole mesh over TLS: a broker that speaks only TLS and verifies client certificates (from a CA made in
the test), every process and client connecting with the [nats] tls_* files, and the answer unchanged."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import nats
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hearth.services.client.chat import chat
from hearth.protocol.chat import ChatRequest
from hearth.services.broker.connection import connect_nats
from tests.e2e.conftest import TINY_MODEL_NAME, three_shard_mesh

pytestmark = pytest.mark.e2e
PROMPT = "the quick brown fox"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, tiny_models_dir):
    with three_shard_mesh(tmp_path_factory.mktemp("tls-mesh"), tiny_models_dir, tls=True) as mesh:
        yield mesh


async def test_the_mesh_answers_over_tls_as_it_does_in_the_clear(tls_mesh, tiny_models_dir):
    path = tiny_models_dir / TINY_MODEL_NAME
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt_ids = AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=0)[0, len(prompt_ids):].tolist()
    nc = await connect_nats(tls_mesh.nats_url, name="tls-client", settings=tls_mesh.nats_settings())
    try:
        result = await chat(nc, ChatRequest(model=TINY_MODEL_NAME, prompt=PROMPT, max_tokens=NEW_TOKENS))
    finally:
        await nc.close()
    assert result.ok, result.final
    assert result.token_ids == expected


async def test_a_client_without_tls_is_refused(tls_mesh):
    with pytest.raises((nats.errors.NoServersError, nats.errors.Error, OSError, asyncio.TimeoutError)):
        await nats.connect(tls_mesh.nats_url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


def test_hearth_chat_reads_the_tls_files_from_its_configuration(tls_mesh):
    completed = subprocess.run([sys.executable, "-m", "hearth.services.cli", "chat", "--nats", tls_mesh.nats_url,
                                "--model", TINY_MODEL_NAME, "--raw", "--max-tokens", "3", PROMPT],
                               capture_output=True, text=True, timeout=60,
                               env={**os.environ, **tls_mesh.client_env()})
    assert completed.returncode == 0, completed.stderr
    assert "[length: 3 tokens" in completed.stderr, completed.stderr
