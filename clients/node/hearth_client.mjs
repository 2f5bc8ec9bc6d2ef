#!/usr/bin/env node
// A hearth client that shares no code with hearth: it asks `llm.models` which models the mesh serves,
// streams one `llm.chat.request` (or each turn of a conversation), checks the request, the reply and every frame
// against the published JSON Schemas (docs/schemas, draft 2020-12) and prints one JSON summary line a call.
// See docs/protocol.md.
//
//   node hearth_client.mjs [--nats URL] [--creds FILE --inbox-prefix _INBOX.NAME] [--model ID] [--max-tokens N]
//                          [--n N] [--orchestrator NAME] [--then PROMPT]... PROMPT...
//
// A secure mesh (the default) only lets in members: --creds names the member's nkey seed file
// (`keys/NAME.nk`, one `SU...` line) and --inbox-prefix the only inbox the broker lets that member
// subscribe to (`_INBOX.NAME`). See --help.
//
// A community mesh also wants every `llm.chat.request` signed by a member: with --creds each one carries the
// Hearth-Caller* headers (the member's public key, a time, a nonce and an Ed25519 signature over subject,
// reply inbox, time, nonce and body; hearth/services/common/call_signing.py is the reference), and the orchestrator
// answers an unsigned or badly signed call with an `error` frame of code `unauthorized`.
//
// Each orchestrator also answers on its own subject, `llm.chat.request.<node token>`, and names itself in the `done`
// frame (`orchestrator`). --orchestrator NAME sends the call there first (signed over that subject); --then PROMPT
// (repeatable) makes a conversation of `messages` whose later turns go to the orchestrator that answered the last,
// so the shards' kept KV of its history is used again. A pinned call goes to `llm.chat.request` at once when nobody
// listens on that subject, or it ends `overloaded` or `orchestrator_gone` (or goes silent) before its first token;
// hearth/services/client/pinned.py is the reference. Each turn prints its own summary line.
//
// Exit codes: 0 the stream ended with `done`; 1 it ended with `error` or `pipeline_aborted` (the summary
// is still printed); 2 a schema violation, an answer past its request's bound (more token_delta frames than
// max_tokens, or more text than they can make), a seq gap not filled in time, a timeout, no orchestrator, a refused
// login or permission, or bad arguments. An `unauthorized` error frame also says why on stderr (exit code 1).
import { randomBytes, randomUUID } from "node:crypto";
import { readFileSync, realpathSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { fromSeed } from "@nats-io/nkeys";
import { connect, createInbox, headers, nkeyAuthenticator } from "@nats-io/transport-node";
import Ajv2020 from "ajv/dist/2020.js";

const FINAL_FRAME_TYPES = new Set(["done", "error", "pipeline_aborted"]); // docs/protocol.md, "Frames"
const CHAT_REQUEST_SUBJECT = "llm.chat.request";
// Endings of a pinned call before any token after which the call goes to the queue group instead (pinned.py).
const FALLBACK_CODES = new Set(["orchestrator_gone", "overloaded"]);
const MAX_HELD_FRAMES = 1024; // frames held after a gap before the call is given up
// How long a choice's answer may be (docs/protocol.md, "How long an answer may be"; the reference is
// hearth/services/client/answer_bound.py): at most max_tokens token_delta frames as it stands, and at most
// max_tokens * MAX_TEXT_BYTES_PER_TOKEN + HELD_BACK_SLACK_BYTES bytes of UTF-8 text, and at most
// MAX_WITHDRAWALS_PER_CHOICE tokens_withdrawn frames (hearth/protocol/chat_frames.py, max_withdrawals_per_choice).
const MAX_TEXT_BYTES_PER_TOKEN = 128;
const HELD_BACK_SLACK_BYTES = 1024;
const MAX_WITHDRAWALS_PER_CHOICE = 16;

class Failure extends Error {}
// No orchestrator answered the call before its first token: nobody listens on its subject (`no_responders`), or none
// sent a frame in time (`orchestrator_gone`). A pinned call then goes to the queue group; any other call fails (2).
class Gone extends Failure {
  constructor(message, reason) {
    super(message);
    this.reason = reason;
  }
}

const USAGE = `usage: node hearth_client.mjs [options] PROMPT...

Asks llm.models which models the mesh serves, streams one llm.chat.request (one a turn with --then) and prints
one JSON summary line a call, checking the request, the reply and every frame against docs/schemas.

options:
  --nats URL                  NATS server (default: $HEARTH_NATS_URL, $NATS_URL or nats://127.0.0.1:4222)
  --creds FILE                log in with this member's nkey seed file (keys/NAME.nk: one SU... line);
                              needed on a secure mesh, which refuses anonymous connections; each chat
                              request is then signed with the same key (Hearth-Caller* headers)
  --inbox-prefix PREFIX       reply inboxes under PREFIX instead of _INBOX; a secure mesh lets member NAME
                              subscribe only to _INBOX.NAME.>, so pass _INBOX.NAME with --creds
  --model ID                  model to ask for (default: the mesh's default_model)
  --max-tokens N              tokens to generate (default 16)
  --n N                       independent answers (choices) to ask for, 1-8 (default 1); the summary's 'text'
                              is the first choice's, 'choice_texts' every choice's
  --response-format JSON      the request's response_format, e.g. '{"type": "json_object"}' (default: text)
  --orchestrator NAME         send the (first) call to that orchestrator's own subject, llm.chat.request.<NAME as
                              one subject token>, as a done frame's 'orchestrator' names it; it goes to
                              llm.chat.request at once when nobody listens there, or the orchestrator answers
                              overloaded or goes silent before its first token
  --then PROMPT               a conversation: PROMPT (repeat --then for more turns) is the next user turn after the
                              answer, sent with the whole history as 'messages' (the first turn too) to the
                              orchestrator that answered the last turn; one summary line per turn
  --connect-timeout S         seconds to connect, and to wait for the llm.models reply (default 10)
  --first-frame-timeout S     seconds to wait for the first frame (default 10)
  --silence-timeout S         seconds to wait between frames; keepalives reset it (default 2.5)
  --schemas DIR               the JSON Schemas (default: docs/schemas of this repository)
  --self-test-invalid         send a request that breaks the schema, to prove the check is real
  -h, --help                  print this and exit

exit codes: 0 done; 1 error or pipeline_aborted (the summary is still printed); 2 a schema violation, an answer
past its request's bound, a lost frame, a timeout, no orchestrator, a refused login or permission, or bad arguments.
`;

const OPTIONS = {
  help: { type: "boolean", short: "h", default: false },
  nats: { type: "string", default: process.env.HEARTH_NATS_URL ?? process.env.NATS_URL ?? "nats://127.0.0.1:4222" },
  creds: { type: "string" }, // nkey seed file; default: connect anonymously (only an open broker allows that)
  "inbox-prefix": { type: "string" }, // default: nats.js's _INBOX
  model: { type: "string" }, // default: leave `model` out, so the mesh's default_model serves the call
  "max-tokens": { type: "string", default: "16" },
  n: { type: "string", default: "1" }, // llm.chat.request's n; the schema bounds it
  "response-format": { type: "string" }, // JSON of llm.chat.request's response_format; default: text
  orchestrator: { type: "string" }, // pin the first call to this orchestrator (a done frame's `orchestrator`)
  then: { type: "string", multiple: true, default: [] }, // the conversation's next user turns, pinned
  "connect-timeout": { type: "string", default: "10" }, // seconds; also the wait for the llm.models reply
  "first-frame-timeout": { type: "string", default: "10" }, // [client] first_frame_timeout_s
  "silence-timeout": { type: "string", default: "2.5" }, // [client] silence_timeout_s (keepalives reset it)
  schemas: { type: "string", default: fileURLToPath(new URL("../../docs/schemas/", import.meta.url)) },
  // Proves the validation is real: sends max_tokens as a string, which the request schema must refuse.
  "self-test-invalid": { type: "boolean", default: false },
  // Testing only, left out of --help: do not sign the chat request even with --creds, to prove the orchestrator
  // checks signatures (it must answer `unauthorized`). No real client has a reason to use it.
  "no-sign": { type: "boolean", default: false },
};
let opts;

const seconds = (name) => {
  const value = Number(opts[name]);
  if (!(value > 0)) throw new Failure(`--${name} must be a positive number of seconds, not ${opts[name]}`);
  return value * 1000;
};

// ---------------------------------------------------------------- credentials and signed calls
const encoder = new TextEncoder();

function nkeySeed(file) {
  let seed;
  try {
    seed = readFileSync(file, "utf8").trim();
  } catch (err) {
    throw new Failure(`cannot read the --creds file ${file}: ${err.message}`);
  }
  try {
    if (!fromSeed(encoder.encode(seed)).getPublicKey().startsWith("U")) throw new Error("not a user seed");
  } catch { // refuse a bad file here, not as a puzzling login error
    throw new Failure(`the --creds file ${file} does not hold a member's nkey seed (one line starting with 'SU')`);
  }
  return encoder.encode(seed);
}

// The headers that sign one call, as hearth/services/common/call_signing.py builds them: the signature covers
// "hearth-call\n" + subject + "\n" + reply inbox + "\n" + time + "\n" + nonce + "\n" followed by the exact body
// bytes published, so neither the body nor the inbox the answer goes to can be changed, and the nonce (with
// the time) keeps the call from being replayed.
function signedCallHeaders(keyPair, subject, reply, body) {
  const time = (Date.now() / 1000).toFixed(3); // unix seconds, 3 decimals
  const nonce = randomBytes(16).toString("hex"); // 32 hex characters
  const preamble = encoder.encode(`hearth-call\n${subject}\n${reply}\n${time}\n${nonce}\n`);
  const signed = new Uint8Array(preamble.length + body.length);
  signed.set(preamble);
  signed.set(body, preamble.length);
  const signedHeaders = headers();
  signedHeaders.set("Hearth-Caller", keyPair.getPublicKey());
  signedHeaders.set("Hearth-Caller-Time", time);
  signedHeaders.set("Hearth-Caller-Nonce", nonce);
  signedHeaders.set("Hearth-Caller-Signature", Buffer.from(keyPair.sign(signed)).toString("base64"));
  return signedHeaders;
}

// What an `unauthorized` error frame means for this client, in words.
function explainUnauthorized(frame) {
  const why = opts.creds
    ? (opts["no-sign"]
      ? "the call was sent unsigned (--no-sign, testing only)"
      : `the call was signed with the key of ${opts.creds}: is that member in this community's roster, with the `
        + "trust this mesh asks of callers, and is this machine's clock right?")
    : "the call was not signed: pass --creds with a member's nkey seed file";
  return `the orchestrator refused the call as unauthorized (${frame.message}); ${why}`;
}

// What a refused login or subscription means for this client, in words.
function explainNatsError(err) {
  const text = `${err?.name ?? ""} ${err?.message ?? err} ${err?.cause?.message ?? ""}`.toLowerCase();
  if (text.includes("authorization") || text.includes("authentication")) {
    return opts.creds
      ? `NATS at ${opts.nats} refused the login with ${opts.creds} (authorization violation): is it a member of `
        + "this mesh's community?"
      : `NATS at ${opts.nats} refused an anonymous login (authorization violation): pass --creds with a member's `
        + "nkey seed file, and --inbox-prefix _INBOX.<member>";
  }
  if (text.includes("permission")) {
    return `NATS refused a permission (${err.message}): a secure mesh lets a member subscribe only to `
      + `_INBOX.<member>.>, so pass --inbox-prefix _INBOX.<member> for the member of --creds`;
  }
  return null;
}

// ---------------------------------------------------------------- each orchestrator's own subject
// A node id made one subject token, exactly as hearth/protocol/subjects.py node_token does: each code point that is
// not a letter or a number (Python's str.isalnum: Unicode categories L* and N*), `-` or `_` becomes `_`; an empty
// id becomes `_`. (Python and this Node.js may know different Unicode versions: code points assigned in between
// differ.)
export function nodeToken(text) {
  let safe = "";
  for (const ch of text) safe += /^[\p{L}\p{N}_-]$/u.test(ch) ? ch : "_";
  return safe || "_";
}

// Where one orchestrator answers calls besides the queue group's subject (orchestrator_request_subject).
export const orchestratorRequestSubject = (nodeId) => `${CHAT_REQUEST_SUBJECT}.${nodeToken(nodeId)}`;

// ---------------------------------------------------------------- schemas, found through index.json
let schemaDir, index, ajv;
const compiled = {};

function loadSchemaIndex(folder) {
  schemaDir = folder.endsWith("/") ? folder : `${folder}/`;
  index = JSON.parse(readFileSync(`${schemaDir}index.json`, "utf8")).schemas;
  ajv = new Ajv2020({ allErrors: true });
}

function schemaFile(predicate, what) {
  const entry = index.find(predicate);
  if (!entry) throw new Failure(`${schemaDir}index.json has no schema for ${what}`);
  return entry.file;
}
const frameSchema = (type) => schemaFile((e) => e.kind === "frame" && e.type === type, `frame type '${type}'`);
const knownFrameType = (type) => index.some((e) => e.kind === "frame" && e.type === type);

function check(file, value, what) {
  // Compiled on first use: only the client-facing schemas (the event schemas' `format`s need ajv-formats).
  const validate = (compiled[file] ??= ajv.compile(JSON.parse(readFileSync(schemaDir + file, "utf8"))));
  if (!validate(value)) {
    const problems = validate.errors.map((e) => `${e.instancePath || "/"} ${e.message}`).join("; ");
    throw new Failure(`${what} breaks ${file}: ${problems}\n  ${JSON.stringify(value)}`);
  }
  return value;
}

// ---------------------------------------------------------------- every wait has a deadline
async function within(ms, what, promise) {
  let timer;
  const expired = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Failure(`timed out after ${ms / 1000} s waiting for ${what}`)), ms);
  });
  try {
    return await Promise.race([promise, expired]);
  } finally {
    clearTimeout(timer);
  }
}

async function listModels(nc) {
  const body = check(schemaFile((e) => e.subject === "llm.models" && e.kind === "request", "llm.models"), {},
    "llm.models request");
  let reply;
  try {
    reply = (await nc.request("llm.models", JSON.stringify(body), { timeout: seconds("connect-timeout") })).json();
  } catch (err) {
    throw new Failure(explainNatsError(err) ?? `no answer on llm.models: ${err.message}`);
  }
  if (reply?.type === "error") {
    throw new Failure(`llm.models refused: ${JSON.stringify(check(frameSchema("error"), reply, "an error frame"))}`);
  }
  return check(schemaFile((e) => e.subject === "reply inbox of llm.models", "the llm.models reply"), reply,
    "llm.models reply");
}

// The frames of one call sent on `subject` (the queue group's or an orchestrator's own), up to its final frame;
// `pinned`: its first frame is waited for only as long as a silence (an orchestrator that took the call sends a
// keepalive within that, and a broker whose permissions predate the orchestrators' own subjects drops the publish
// without a "no responders"), as pinned.py does.
async function streamChat(nc, request, keyPair, subject, pinned = false) {
  const inbox = createInbox(opts["inbox-prefix"]);
  const subscription = nc.subscribe(inbox);
  const frames = subscription[Symbol.asyncIterator]();
  const body = encoder.encode(JSON.stringify(request)); // the exact bytes signed are the bytes published
  const publishOptions = { reply: inbox };
  // The signature covers the subject: the orchestrator checks it against the one it received the call on.
  if (keyPair) publishOptions.headers = signedCallHeaders(keyPair, subject, inbox, body);
  nc.publish(subject, body, publishOptions);
  const seen = [];
  const withinBound = answerBound(request);
  let lastSeq = -1;
  // After a broker node went away the orchestrator sends again what we missed (docs/protocol.md, "Frames"):
  // frames after a gap wait here until it is filled; a frame seen before is skipped.
  const held = new Map();
  let gapDeadline = null;
  const gapFailure = () => new Failure(`frames were lost: seq ${lastSeq + 1} to ${Math.min(...held.keys()) - 1} ` +
    "never came, not even sent again");
  try {
    for (;;) {
      let waitMs = seen.length || pinned ? seconds("silence-timeout") : seconds("first-frame-timeout");
      if (gapDeadline !== null) waitMs = Math.max(0, Math.min(waitMs, gapDeadline - Date.now()));
      let next;
      try {
        next = await within(waitMs, `a frame after seq ${lastSeq} on ${inbox}`, frames.next());
      } catch (err) {
        if (gapDeadline !== null && Date.now() >= gapDeadline) throw gapFailure();
        // Silent (the deadline passed) before any token: the orchestrator is gone, as far as this call goes.
        if (err instanceof Failure && !seen.some((f) => f.type === "token_delta")) {
          throw new Gone(err.message, "orchestrator_gone");
        }
        throw err;
      }
      const { value: msg, done } = next;
      if (done) throw new Failure("the reply subscription closed before a final frame");
      if (msg.headers?.code === 503) throw new Gone(`no orchestrator is listening on ${subject}`, "no_responders");
      let frame;
      try {
        frame = msg.json();
      } catch {
        throw new Failure(`a frame is not JSON: ${msg.string().slice(0, 200)}`);
      }
      const typed = frame !== null && typeof frame === "object" && typeof frame.type === "string";
      const known = !typed || knownFrameType(frame.type);
      if (known) {
        check(frameSchema(frame?.type), frame, `a '${frame?.type}' frame`);
        if (frame.type === "keepalive") { // not numbered: it repeats the last seq
          seen.push(frame);
          if (gapDeadline !== null && Date.now() >= gapDeadline) throw gapFailure();
          continue;
        }
      }
      if (!Number.isInteger(frame.seq) || frame.seq <= lastSeq) continue; // sent again: seen before
      if (frame.seq > lastSeq + 1) {
        held.set(frame.seq, { frame, known });
        gapDeadline ??= Date.now() + seconds("silence-timeout");
        if (held.size > MAX_HELD_FRAMES || Date.now() >= gapDeadline) throw gapFailure();
        continue;
      }
      for (let ready = { frame, known }; ready; ready = held.get(lastSeq + 1)) {
        held.delete(ready.frame.seq);
        lastSeq = ready.frame.seq;
        if (!ready.known) {
          // A frame type added after these schemas: skipped, its seq still counted (docs/protocol.md, "Frames").
          console.error(`[skipped a '${ready.frame.type.slice(0, 64)}' frame: a type this client does not know]`);
          continue;
        }
        withinBound(ready.frame);
        seen.push(ready.frame);
        if (ready.frame.type === "queued") {
          console.error(`[queued: ${ready.frame.position} of ${ready.frame.queued_requests}]`);
        }
        if (FINAL_FRAME_TYPES.has(ready.frame.type)) return seen;
      }
      gapDeadline = held.size ? Date.now() + seconds("silence-timeout") : null;
    }
  } finally {
    subscription.unsubscribe();
  }
}

// Each choice's answer as it stands (token_delta frames less those a tokens_withdrawn frame took back) against
// the request's bound: a frame past it is a violation (a Failure, exit code 2), as a frame past a schema's bound is.
function answerBound(request) {
  const maxTokens = Number(request.max_tokens ?? 128); // absent: the most an orchestrator then gives
  const maxTextBytes = maxTokens * MAX_TEXT_BYTES_PER_TOKEN + HELD_BACK_SLACK_BYTES;
  const choices = Array.from({ length: request.n ?? 1 }, () => ({ tokenBytes: [], textBytes: 0, withdrawals: 0 }));
  return (frame) => {
    if (frame.type !== "token_delta" && frame.type !== "tokens_withdrawn") return;
    const choice = frame.choice ?? 0;
    const size = choices[choice];
    if (!size) {
      if (frame.type === "token_delta") {
        throw new Failure(`a token of choice ${choice}, but the request asked for ${choices.length} choices`);
      }
      return;
    }
    if (frame.type === "tokens_withdrawn") {
      if (size.withdrawals >= MAX_WITHDRAWALS_PER_CHOICE) {
        throw new Failure(`choice ${choice} got more than ${MAX_WITHDRAWALS_PER_CHOICE} tokens_withdrawn frames, ` +
                          "the most the protocol lets a choice have");
      }
      size.withdrawals += 1;
      for (const bytes of size.tokenBytes.splice(frame.kept_tokens)) size.textBytes -= bytes;
      return;
    }
    if (size.tokenBytes.length >= maxTokens) {
      throw new Failure(`choice ${choice} got more token_delta frames than the request's max_tokens ${maxTokens}`);
    }
    // A UTF-8 text is never shorter in bytes than in UTF-16 units: a frame of megabytes is refused unencoded.
    const bytes = frame.text.length > maxTextBytes ? frame.text.length : encoder.encode(frame.text).length;
    if (size.textBytes + bytes > maxTextBytes) {
      throw new Failure(`choice ${choice} got more than ${maxTextBytes} bytes of text, the most max_tokens ` +
                        `${maxTokens} allows`);
    }
    size.tokenBytes.push(bytes);
    size.textBytes += bytes;
  };
}

// One call, sent first to `orchestrator`'s own subject when given, and to the queue group instead when that one
// cannot take it (hearth/services/client/pinned.py): nobody listens there, or the call ends `orchestrator_gone` or
// `overloaded` (or goes silent) before its first token. Any other ending is the answer. Returns the answering call's
// frames, every subject the call was sent on, and why it left the pinned one (absent when it did not).
async function chatPinned(nc, request, keyPair, orchestrator) {
  if (orchestrator != null) {
    const subject = orchestratorRequestSubject(orchestrator);
    let fellBack;
    try {
      const frames = await streamChat(nc, request, keyPair, subject, true);
      const final = frames.at(-1);
      if (frames.some((f) => f.type === "token_delta") || !FALLBACK_CODES.has(final.code)) {
        return { frames, subjects: [subject] };
      }
      fellBack = final.code;
    } catch (err) {
      if (!(err instanceof Gone)) throw err;
      fellBack = err.reason;
    }
    console.error(`[the call pinned to orchestrator ${orchestrator} went to ${CHAT_REQUEST_SUBJECT}: ${fellBack}]`);
    const frames = await streamChat(nc, request, keyPair, CHAT_REQUEST_SUBJECT);
    return { frames, subjects: [subject, CHAT_REQUEST_SUBJECT], fell_back: fellBack };
  }
  return { frames: await streamChat(nc, request, keyPair, CHAT_REQUEST_SUBJECT), subjects: [CHAT_REQUEST_SUBJECT] };
}

// One call's summary line: the first choice's text and token ids as they stand, its ending, the orchestrator that
// answered (the done frame's `orchestrator`, null when none is named), its verification outcome (the done frame's
// `verification`, null when absent) and the subjects the call was sent on.
function summarize(models, { frames, subjects, fell_back }, choices) {
  const final = frames.at(-1);
  // Each choice's deltas as they stand (a frame without `choice` is the first choice's): a tokens_withdrawn
  // frame keeps only the first kept_tokens of its choice's.
  const deltasByChoice = Array.from({ length: choices }, () => []);
  for (const f of frames) {
    const deltas = deltasByChoice[f.choice ?? 0];
    if (!deltas) continue;
    if (f.type === "token_delta") deltas.push(f);
    else if (f.type === "tokens_withdrawn") deltas.splice(f.kept_tokens);
  }
  const deltas = deltasByChoice[0];
  return {
    models: models.models.map((m) => m.id),
    default_model: models.default_model ?? null,
    text: deltas.map((f) => f.text).join(""),
    token_ids: deltas.map((f) => f.token_id),
    ...(choices > 1 ? { choice_texts: deltasByChoice.map((d) => d.map((f) => f.text).join("")),
                        choices: final.choices ?? null } : {}),
    frame_types: [...new Set(frames.map((f) => f.type))],
    finish_reason: final.finish_reason ?? null,
    usage: final.usage ?? null,
    orchestrator: final.orchestrator ?? null,
    // `met` or `unmet`: whether the shards' work was checked as the call's `params.verify` asks (null: `none`).
    verification: final.verification ?? null,
    subjects,
    ...(fell_back ? { fell_back } : {}),
    ...(final.type === "done"
      ? {}
      : { error: { type: final.type, code: final.code, detail: final.message ?? final.reason,
                   ...(final.retry_after_s != null ? { retry_after_s: final.retry_after_s } : {}),
                   // A bad_request's field and, where a program acts on it, its reason (docs/protocol.md, `error`).
                   ...(final.param != null ? { param: final.param } : {}),
                   ...(final.refusal != null ? { refusal: final.refusal } : {}) } }),
  };
}

async function main() {
  let positionals;
  try {
    ({ values: opts, positionals } = parseArgs({ options: OPTIONS, allowPositionals: true }));
  } catch (err) {
    throw new Failure(`${err.message}\n${USAGE}`);
  }
  if (opts.help) {
    process.stdout.write(USAGE);
    return 0;
  }
  loadSchemaIndex(opts.schemas);
  const prompt = positionals.join(" ");
  if (!prompt) throw new Failure("give a prompt: node hearth_client.mjs [--nats URL] PROMPT...");
  const connectOptions = { servers: opts.nats, timeout: seconds("connect-timeout"), name: "hearth-node-client" };
  let keyPair = null; // signs each chat request; its own copy of the seed, apart from the login's
  if (opts.creds) {
    const seed = nkeySeed(opts.creds);
    connectOptions.authenticator = nkeyAuthenticator(seed.slice());
    if (!opts["no-sign"]) keyPair = fromSeed(seed);
  }
  if (opts["inbox-prefix"]) connectOptions.inboxPrefix = opts["inbox-prefix"];
  let nc;
  try {
    nc = await connect(connectOptions);
  } catch (err) {
    throw new Failure(explainNatsError(err) ?? `cannot reach NATS at ${opts.nats}: ${err.message}`);
  }
  try {
    const models = await listModels(nc);
    if (!opts.model && !models.default_model) {
      const served = models.models.map((m) => m.id).join(", ") || "none";
      throw new Failure(`the mesh has no default model; pass --model (served: ${served})`);
    }
    const maxTokens = Number(opts["max-tokens"]);
    let responseFormat;
    try {
      responseFormat = opts["response-format"] ? JSON.parse(opts["response-format"]) : undefined;
    } catch (err) {
      throw new Failure(`--response-format is not JSON: ${err.message}`);
    }
    const choices = Number(opts.n);
    const conversation = opts.then.length > 0;
    if (conversation && choices !== 1) throw new Failure("--then goes on with one answer: not with --n");
    // A conversation's history: each user turn and the answer to it (`messages`); a single call sends `prompt`.
    const messages = [];
    let orchestrator = opts.orchestrator ?? null;
    for (const [turn, text] of [prompt, ...opts.then].entries()) {
      if (conversation) messages.push({ role: "user", content: text });
      const request = {
        request_id: `node-${randomUUID()}`,
        ...(opts.model ? { model: opts.model } : {}),
        ...(conversation ? { messages } : { prompt }),
        max_tokens: opts["self-test-invalid"] ? String(maxTokens) : maxTokens,
        temperature: 0,
        ...(choices !== 1 ? { n: choices } : {}),
        ...(responseFormat ? { response_format: responseFormat } : {}),
      };
      check(schemaFile((e) => e.subject === CHAT_REQUEST_SUBJECT, CHAT_REQUEST_SUBJECT), request, "the chat request");
      const answer = await chatPinned(nc, request, keyPair, orchestrator);
      const final = answer.frames.at(-1);
      if (final.type === "error" && final.code === "unauthorized") {
        console.error(`hearth_client: ${explainUnauthorized(final)}`);
      }
      if (final.type === "done" && final.verification === "unmet") {
        console.error("hearth_client: verification unmet: some of the shards' work on this answer was not checked "
                      + "as the call's verify level asks");
      }
      const summary = summarize(models, answer, choices);
      console.log(JSON.stringify(conversation ? { turn, ...summary } : summary));
      if (final.type !== "done") return 1;
      // The next turn goes to the orchestrator that answered this one (an older one names none: keep the pin).
      orchestrator = final.orchestrator ?? orchestrator;
      messages.push({ role: "assistant", content: summary.text });
    }
    return 0;
  } finally {
    await within(5000, "the NATS connection to close", nc.close());
  }
}

// Run as a program (`node hearth_client.mjs ...`); imported, it only lends nodeToken and orchestratorRequestSubject.
const runAsProgram = (() => {
  try {
    return realpathSync(process.argv[1]) === fileURLToPath(import.meta.url);
  } catch {
    return false;
  }
})();
if (runAsProgram) {
  try {
    process.exitCode = await main();
  } catch (err) {
    console.error(`hearth_client: ${err instanceof Failure ? err.message : err.stack}`);
    process.exitCode = 2;
  }
}
