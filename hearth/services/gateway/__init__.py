"""The OpenAI-compatible HTTP gateway (`hearth gateway`): OpenAI's API in front of the mesh's `llm.chat.request`."""
