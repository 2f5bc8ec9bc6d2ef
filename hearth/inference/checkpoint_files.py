"""The names of a safetensors checkpoint's files and the patterns of the hub files hearth fetches."""

SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SINGLE_NAME = "model.safetensors"
# What a snapshot needs for hearth: config, weights, tokenizer and chat template files; never *.bin/*.pt.
HUB_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]
