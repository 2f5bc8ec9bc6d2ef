"""`hearth bench`: transformers generate() vs the distributed pipeline on one machine — decode tokens/s and
their ratio, time to first token, pipeline construction, per-hop transport overhead, concurrent sessions.

One invocation, one model, one prompt:

1. starts nats-server, N shard hosts (layers split evenly, each with ``--metrics-port``; ``--replicas R``: R shard
   processes per range, each on a node of its own) and an orchestrator as real `hearth` processes
   (services.devtools.local_cluster.LocalCluster), and loads the whole model
   with ``AutoModelForCausalLM.from_pretrained`` in a worker process (``python -m hearth.services.devtools.bench``)
   that gets the shard processes' OpenMP environment and thread count, and in a second one with this
   shell's environment and torch's own thread count ("library defaults"; --no-library-defaults skips it);
2. warms all up, then runs ``--repeats`` rounds of [generate(), generate() with library defaults,
   pipeline request] with the same prompt ids and greedy decoding, rotating which goes first so
   drifting machine load hits all alike. Time is measured where a user sees it: for generate() by a
   streamer that timestamps every token, for the pipeline by the client timestamping every
   `token_delta` frame (those a `tokens_withdrawn` frame took back left out). Decode tokens/s
   is (tokens - 1) / (last token time - first token time); time to first token runs from the call
   (generate() / publishing the request) to the first token;
3. reads pipeline construction ms from each `done` frame (timing.construct_ms, as in the
   pipeline.constructed event);
4. per-hop transport overhead: each shard host observes, for every step, the step's inbound wire time
   (upstream publish -> last chunk here), its deserialisation and the serialisation of its output
   (hearth/services/shard/metrics.py, `hearth_shard_step_transport_seconds`); the bench scrapes the
   histograms before and after the measured rounds and reports p50/p95 of decode steps per hop and
   pooled (linear interpolation inside buckets 0.1 ms wide up to 1 ms, plus the exact share <= 1 ms), and where a
   decode token's time goes: the hops' compute and transport (means, summed over the hops), the orchestrator's turn
   from a step's output to the next step sent with its head step inside (`hearth_orchestrator_turn_seconds`,
   `hearth_head_step_seconds`, scraped alike) and the rest;
5. sends K requests at once (different prompts of the same length) and reports the aggregate
   tokens/s (all tokens / wall time from the first request to the last `done`) and each session's
   time to first token and finish, and whether any session produced its first token only after
   another one had finished;
6. with ``--burst N``, sends N copies of the greedy request at once (more than the mesh runs at once) and
   reports how many completed and were refused, whether every answer equals the solo run's, p50/p95 of
   the queue wait (the orchestrator's, from each `done` frame) and of the time to first token (the
   client's, queue wait included), and the largest queue position a call was told.

``--model`` is a checkpoint folder, a name under models/, a hub id in the local cache, or
``random:<shape>`` (services.devtools.random_models): a randomly initialised Llama written once with
save_pretrained to ``$HEARTH_CACHE_DIR`` (default ~/.cache/hearth)/random-models/<shape>, with a
word-level tokenizer (token i is the word ``t<i>``) so prompts have exactly the requested length; no
end-of-sequence token, so every run generates exactly ``--new-tokens``.

Every pipeline request asks for verification level ``--verify`` (none given: the protocol's default); the report
says the level, the replicas and the orchestrator's verification checks during the measured rounds.

Modules: ``command`` (the `hearth bench` entry), ``runner`` (the Bench: rounds, concurrent sessions), ``mesh`` (the
processes started, replicas included), ``monolithic`` (the generate() worker and its handle; ``__main__`` starts the
worker), ``pipeline`` (one timed request through the orchestrator), ``timing`` (one timed generation), ``burst`` (the
burst part), ``prompts``, ``transport_metrics`` (scraped histograms -> per-hop figures), ``verification_metrics`` (the
orchestrator's checks counter), ``token_budget`` (a decode token's time, split), ``report`` (models and text),
``targets`` (verdicts), ``errors``.
"""
