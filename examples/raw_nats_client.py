"""A minimal hearth client on raw NATS (nats-py only), written from docs/protocol.md alone: lists models, sends a chat
call, reads its frames in `seq` order to the final one, reports refusals, cancels midway and signs on a community."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import secrets
import ssl
import sys
import time
import uuid
from pathlib import Path

import nats
import nkeys

CHAT_SUBJECT = "llm.chat.request"
MODELS_SUBJECT = "llm.models"
FINAL_TYPES = ("done", "error", "pipeline_aborted")
# [client] defaults (docs/protocol.md, keepalive): before the first frame, then between frames.
FIRST_FRAME_TIMEOUT_S = 10.0
SILENCE_TIMEOUT_S = 2.5
# The orchestrator sends only its last 1024 frames again: a gap with more behind it never fills.
MAX_HELD_FRAMES = 1024


class Signer:
    """Signs calls as docs/protocol.md "Signed calls" says, with a roster member's nkey seed."""

    def __init__(self, seed_file: Path) -> None:
        seed = seed_file.read_text().strip().encode()
        self.keys = nkeys.from_seed(seed)
        self.public_key = self.keys.public_key.decode()

    def headers(self, subject: str, inbox: str, body: bytes) -> dict[str, str]:
        stamp = f"{time.time():.3f}"
        nonce = secrets.token_hex(16)
        signed = f"hearth-call\n{subject}\n{inbox}\n{stamp}\n{nonce}\n".encode() + body
        signature = base64.b64encode(self.keys.sign(signed)).decode()
        return {"Hearth-Caller": self.public_key, "Hearth-Caller-Time": stamp, "Hearth-Caller-Nonce": nonce,
                "Hearth-Caller-Signature": signature}


def parse_frame(data: bytes) -> dict | None:
    """A frame, or None for junk (docs: a message that is no frame is skipped and not counted)."""
    try:
        frame = json.loads(data)
    except ValueError:
        return None
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        return None
    seq = frame.get("seq")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return None
    return frame


class FrameReader:
    """Hands out a call's frames in `seq` order: duplicates dropped, frames after a gap held until it fills,
    keepalives only reset the silence clock."""

    def __init__(self, subscription) -> None:
        self.subscription = subscription
        self.next_seq = 0
        self.held: dict[int, dict] = {}
        self.heard_any = False
        self.gap_opened_at: float | None = None

    async def frames(self):
        loop = asyncio.get_running_loop()
        while True:
            wait_s = SILENCE_TIMEOUT_S if self.heard_any else FIRST_FRAME_TIMEOUT_S
            if self.held:  # a gap lasts at most the silence timeout, keepalives or not
                self.gap_opened_at = self.gap_opened_at or loop.time()
                wait_s = max(0.001, min(wait_s, self.gap_opened_at + SILENCE_TIMEOUT_S - loop.time()))
            try:
                message = await self.subscription.next_msg(timeout=wait_s)
            except nats.errors.TimeoutError:
                if self.held:
                    yield {"type": "pipeline_aborted", "code": "pipeline_stalled",
                           "reason": f"frames from seq {self.next_seq} never came"}
                else:
                    yield {"type": "error", "code": "orchestrator_gone",
                           "message": f"no frame or keepalive for {wait_s} s"}
                return
            if message.headers and message.headers.get("Status") == "503":
                yield {"type": "error", "code": "orchestrator_gone", "message": "no responders"}
                return
            frame = parse_frame(message.data)
            if frame is None:
                continue
            self.heard_any = True
            if frame["type"] == "keepalive" or frame["seq"] < self.next_seq:
                continue
            self.held.setdefault(frame["seq"], frame)
            if len(self.held) > MAX_HELD_FRAMES:
                yield {"type": "pipeline_aborted", "code": "pipeline_stalled",
                       "reason": f"more than {MAX_HELD_FRAMES} frames wait behind seq {self.next_seq}"}
                return
            if self.next_seq in self.held:
                self.gap_opened_at = None  # progress: a gap left behind these frames gets its own wait
            while self.next_seq in self.held:
                ready = self.held.pop(self.next_seq)
                self.next_seq += 1
                yield ready
                if ready["type"] in FINAL_TYPES:
                    return


async def list_models(nc) -> int:
    reply = json.loads((await nc.request(MODELS_SUBJECT, b"{}", timeout=FIRST_FRAME_TIMEOUT_S)).data)
    if reply.get("type") == "error":
        print(f"error {reply.get('code')}: {reply.get('message')}", file=sys.stderr)
        return 1
    for model in reply["models"]:
        print(f"{model['id']}\tcomplete={model['complete']}\tcontext={model.get('context_length')}")
    print(f"default_model: {reply.get('default_model')}")
    return 0


def chat_body(args) -> bytes:
    request = {"request_id": uuid.uuid4().hex, "messages": [{"role": "user", "content": args.prompt}],
               "max_tokens": args.max_tokens, "temperature": 0.0}
    if args.model:
        request["model"] = args.model
    return json.dumps(request).encode()


async def chat(nc, args, signer: Signer | None, out=sys.stdout) -> int:
    """One call; returns the exit code (0 done or cancelled, 1 failed, 2 refused or no answer)."""
    body = chat_body(args)
    inbox = nc.new_inbox()
    subscription = await nc.subscribe(inbox)
    headers = signer.headers(CHAT_SUBJECT, inbox, body) if signer else None
    await nc.publish(CHAT_SUBJECT, body, reply=inbox, headers=headers)
    tokens = 0
    try:
        async for frame in FrameReader(subscription).frames():
            kind = frame["type"]
            if kind == "token_delta" and frame.get("choice", 0) == 0:
                tokens += 1
                out.write(frame.get("text", ""))
                out.flush()
                if args.cancel_after and tokens >= args.cancel_after:
                    # Cancelling is leaving: with nobody on the inbox the orchestrator ends the call.
                    print(f"\n[cancelled after {tokens} tokens]", file=sys.stderr)
                    return 0
            elif kind == "queued":
                print(f"[queued: position {frame.get('position')}]", file=sys.stderr)
            elif kind == "tokens_withdrawn":
                print(f"\n[tokens_withdrawn: kept {frame.get('kept_tokens')}]", file=sys.stderr)
            elif kind == "done":
                print(f"\n[done: {frame.get('finish_reason')}, usage {frame.get('usage')}, "
                      f"orchestrator {frame.get('orchestrator')}]", file=sys.stderr)
                return 0
            elif kind == "error":
                refusal = f" param={frame.get('param')} refusal={frame.get('refusal')}" if frame.get("param") else ""
                retry = f" retry after {frame['retry_after_s']} s" if frame.get("retry_after_s") else ""
                print(f"error {frame.get('code')}: {frame.get('message')}{refusal}{retry}", file=sys.stderr)
                return 2 if frame.get("code") in ("bad_request", "orchestrator_gone") else 1
            elif kind == "pipeline_aborted":
                print(f"\npipeline_aborted {frame.get('code')}: {frame.get('reason')}", file=sys.stderr)
                return 1
            # pipeline, shard_status, shard_failover and unknown types: counted, nothing to show.
        return 1
    finally:
        await subscription.unsubscribe()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("prompt", nargs="?", help="the user message (omit with --models)")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222", help="broker URL")
    parser.add_argument("--key", type=Path, help="a roster member's nkey seed file (keys/NAME.nk): log in with it "
                        "and sign calls (a community mesh); absent: an open mesh")
    parser.add_argument("--tls-ca", type=Path, help="the CA file of a broker that serves TLS (community/tls/ca.pem)")
    parser.add_argument("--member", help="the member's name (default: the key file's stem)")
    parser.add_argument("--models", action="store_true", help="ask llm.models and exit")
    parser.add_argument("--model", help="a model id from llm.models (default: the mesh's default_model)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-after", type=int, default=0, help="cancel the call after this many tokens")
    args = parser.parse_args(argv)
    if not args.models and args.prompt is None:
        parser.error("a prompt is needed (or --models)")
    return args


async def run(args) -> int:
    options: dict = {"servers": [args.nats], "connect_timeout": 5, "max_reconnect_attempts": 2}
    signer = None
    if args.tls_ca:
        options["tls"] = ssl.create_default_context(cafile=str(args.tls_ca))
    if args.key:
        member = args.member or args.key.stem
        options.update(nkeys_seed=str(args.key), inbox_prefix=f"_INBOX.{member}")
        signer = Signer(args.key)
    nc = await nats.connect(**options)
    try:
        return await list_models(nc) if args.models else await chat(nc, args, signer)
    except nats.errors.NoRespondersError:
        print("error orchestrator_gone: no orchestrator listens", file=sys.stderr)
        return 2
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
