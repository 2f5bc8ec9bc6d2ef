"""The bounds every message on hearth's wire shares: what a subject token may be, how long an id or a reason is."""

# Subject tokens may not carry dots, spaces or wildcards; pipeline ids become subject tokens.
SUBJECT_TOKEN_PATTERN = r"^[A-Za-z0-9_-]{1,128}$"
max_id_chars = 256  # node ids, model ids, digests, subjects, request ids
max_shard_id_chars = 2 * max_id_chars + 32  # "<model_id>:<lo>-<hi>[+<scheme>]@<node_id>"
# The longest wait a refusal may suggest before a call is sent again (`retry_after_s`): an hour.
max_retry_after_s = 3600.0
max_reason_chars = 2000  # free text; an emitter's longer text is cut to this, never refused
max_label_chars = 64  # dtypes, statuses, codes, finish reasons
# The largest count or timing a frame states (tokens, places in a queue, milliseconds): no call comes near it, and a
# client's 32-bit integer holds it.
max_frame_number = 2**31 - 1
# The log-probability reported for a token the logits rule out entirely (-infinity, which JSON cannot carry), as
# OpenAI reports it; no log-probability is lower.
lowest_logprob = -9999.0
# Hops of a pipeline (also the most [research.distributed_inference] max_shards_per_request): a shard builds subjects
# from a hop's number, so an unbounded one could outgrow the broker's control line and cost the shard its connection.
max_pipeline_hops = 64
# Elements per scale of an int8 activation frame: a frame declaring more is refused before anything is restored.
max_int8_block_elems = 2**16
