"""The gateway on a mesh serving several models: `/v1/models` lists the models served whole now (or runnable locally),
each with the weight schemes `hearth.quantization` may name (`hearth_quantizations`, kept by OpenAI's client as an
extra field), and a call naming no model there is a 400 naming `model`; retrieving a model the mesh knows but does not
serve whole now is a 503 `shard_unavailable`, as a call for it is, not a 404 saying it does not exist."""

from __future__ import annotations

import httpx2
import openai

from hearth.protocol.chat_frames import ErrorFrame
from hearth.protocol.discovery import ModelsReply, ServedModel
from hearth.services.gateway.app import create_app
from tests.unit.test_withdrawn_tokens import ScriptedGateway, chat_body

WHOLE, WITH_A_HOLE, LOCAL_ONLY = "tiny-llama", "tiny-qwen", "tiny-local"


class TwoModelGateway(ScriptedGateway):
    async def models(self) -> ModelsReply:
        self._known_models = {WHOLE, WITH_A_HOLE, LOCAL_ONLY}
        return ModelsReply(models=[
            ServedModel(id=WHOLE, total_layers=6, covered_layers=[(0, 5)], complete=True,
                        quantizations=["none", "int8"]),
            ServedModel(id=WITH_A_HOLE, total_layers=6, covered_layers=[(0, 2)], complete=False),
            ServedModel(id=LOCAL_ONLY, total_layers=0, complete=False, runnable_locally=True)], default_model=None)


async def test_the_model_list_holds_what_is_served_whole_with_its_schemes():
    transport = httpx2.ASGITransport(app=create_app(TwoModelGateway()))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        listed = (await http.get("/v1/models")).json()["data"]
        client = openai.AsyncOpenAI(base_url="http://gateway/v1", api_key="unused", http_client=http, max_retries=0)
        retrieved = await client.models.retrieve(WHOLE)
    assert [(card["id"], card["hearth_quantizations"]) for card in listed] == [
        (WHOLE, ["none", "int8"]), (LOCAL_ONLY, [])]
    assert retrieved.model_extra["hearth_quantizations"] == ["none", "int8"]


async def test_a_call_naming_no_model_on_a_mesh_of_several_is_400_naming_model():
    scripted = TwoModelGateway()
    scripted.scripts.append([ErrorFrame(seq=0, code="bad_request", param="model", message=(
        f"field 'model': required when the mesh does not serve exactly one model (it serves 2: {WHOLE}, "
        f"{LOCAL_ONLY}; ask llm.models)"))])
    transport = httpx2.ASGITransport(app=create_app(scripted))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        response = await http.post("/v1/chat/completions", json=chat_body(model=None))
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "bad_request", "model"), error
    assert WHOLE in error["message"] and scripted.received[0].model is None


async def test_a_model_with_a_hole_is_retrieved_as_503_shard_unavailable_as_a_call_for_it_is_answered():
    transport = httpx2.ASGITransport(app=create_app(TwoModelGateway()))
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        with_a_hole = await http.get(f"/v1/models/{WITH_A_HOLE}")
        unknown = await http.get("/v1/models/never-served")
    error = with_a_hole.json()["error"]
    # It exists (OpenAI's clients take 404 for "no such model"), but is not served whole now: the call's answer.
    assert (with_a_hole.status_code, error["code"], error["type"]) == (
        503, "shard_unavailable", "service_unavailable_error"), error
    assert with_a_hole.headers["retry-after"] and "0-2" in error["message"] and "does not exist" not in error["message"]
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "model_not_found")
