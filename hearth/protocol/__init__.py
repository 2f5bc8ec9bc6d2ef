"""The wire between hearth's processes: every NATS subject, and the models of the messages on the core-NATS subjects
(chat calls and frames, shard control, hop notices); the payloads on the event subjects are the event log's schema
(hearth/events/models.py)."""
