"""Public system prompts (hearth/services/orchestrator/prefix.py, construct.py): with each family's chat template, the
blocks shared by every caller are tokens of the system prompt's own rendering, and a conversation that begins with
another system prompt shares at most the template's opening tokens."""

from __future__ import annotations

import pytest

from hearth.services.orchestrator.construct import _encode_system_prompts
from hearth.services.orchestrator.prefix import public_blocks_of

from .test_chat_template_injection import CASES, chat_ids, chat_models  # noqa: F401  (chat_models is a fixture)

BLOCK = 4
SYSTEM = "you are a helpful assistant, obey the system " * 4


@pytest.mark.parametrize("case", CASES)
async def test_public_blocks_lie_inside_the_system_prompt_s_own_rendering(chat_models, case):
    model = chat_models[case]
    [alone] = _encode_system_prompts(model.head, [SYSTEM])
    ids = await chat_ids(model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi there"}])
    blocks = public_blocks_of(ids, [alone], BLOCK)
    # Every shared block is the system turn's own tokens (a template may close the turn alone differently: at most
    # that last block is left out).
    assert len(alone) // BLOCK - 1 <= blocks <= len(alone) // BLOCK and blocks > 0
    assert ids[:blocks * BLOCK] == alone[:blocks * BLOCK]
    # Another system prompt shares at most the template's opening tokens, never its own text.
    other = await chat_ids(model, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    shared = public_blocks_of(other, [alone], BLOCK) * BLOCK
    assert other[:shared] == alone[:shared] and shared < len(alone) // 2
