#!/usr/bin/env node
// A hearth client that shares no code with hearth: it asks `llm.models` which models the mesh serves,
// streams one `llm.chat.request`, checks the request, the reply and every frame against the published
// JSON Schemas (docs/schemas, draft 2020-12) and prints one JSON summary line. See docs/protocol.md.
//
//   node hearth_client.mjs [--nats URL] [--model ID] [--max-tokens N] PROMPT...
//
// Exit codes: 0 the stream ended with `done`; 1 it ended with `error` or `pipeline_aborted` (the summary
// is still printed); 2 a schema violation, a seq gap, a timeout, no orchestrator, or bad arguments.
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { connect, createInbox } from "@nats-io/transport-node";
import Ajv2020 from "ajv/dist/2020.js";

const FINAL_FRAME_TYPES = new Set(["done", "error", "pipeline_aborted"]); // docs/protocol.md, "Frames"

class Failure extends Error {}

const OPTIONS = {
  nats: { type: "string", default: process.env.HEARTH_NATS_URL ?? process.env.NATS_URL ?? "nats://127.0.0.1:4222" },
  model: { type: "string" }, // default: leave `model` out, so the mesh's default_model serves the call
  "max-tokens": { type: "string", default: "16" },
  "connect-timeout": { type: "string", default: "10" }, // seconds; also the wait for the llm.models reply
  "first-frame-timeout": { type: "string", default: "10" }, // [client] first_frame_timeout_s
  "silence-timeout": { type: "string", default: "2.5" }, // [client] silence_timeout_s (keepalives reset it)
  schemas: { type: "string", default: fileURLToPath(new URL("../../docs/schemas/", import.meta.url)) },
  // Proves the validation is real: sends max_tokens as a string, which the request schema must refuse.
  "self-test-invalid": { type: "boolean", default: false },
};
let opts;

const seconds = (name) => {
  const value = Number(opts[name]);
  if (!(value > 0)) throw new Failure(`--${name} must be a positive number of seconds, not ${opts[name]}`);
  return value * 1000;
};

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
    throw new Failure(`no answer on llm.models: ${err.message}`);
  }
  if (reply?.type === "error") {
    throw new Failure(`llm.models refused: ${JSON.stringify(check(frameSchema("error"), reply, "an error frame"))}`);
  }
  return check(schemaFile((e) => e.subject === "reply inbox of llm.models", "the llm.models reply"), reply,
    "llm.models reply");
}

async function streamChat(nc, request) {
  const inbox = createInbox();
  const subscription = nc.subscribe(inbox);
  const frames = subscription[Symbol.asyncIterator]();
  nc.publish("llm.chat.request", JSON.stringify(request), { reply: inbox });
  const seen = [];
  let lastSeq = -1;
  try {
    for (;;) {
      const waitMs = seen.length ? seconds("silence-timeout") : seconds("first-frame-timeout");
      const { value: msg, done } = await within(waitMs, `a frame after seq ${lastSeq} on ${inbox}`, frames.next());
      if (done) throw new Failure("the reply subscription closed before a final frame");
      if (msg.headers?.code === 503) throw new Failure("no orchestrator is listening on llm.chat.request");
      let frame;
      try {
        frame = msg.json();
      } catch {
        throw new Failure(`a frame is not JSON: ${msg.string().slice(0, 200)}`);
      }
      check(frameSchema(frame?.type), frame, `a '${frame?.type}' frame`);
      seen.push(frame);
      if (frame.type === "keepalive") continue; // not numbered: it repeats the last seq
      if (frame.seq !== lastSeq + 1) throw new Failure(`frames were lost: seq ${frame.seq} after ${lastSeq}`);
      lastSeq = frame.seq;
      if (FINAL_FRAME_TYPES.has(frame.type)) return seen;
    }
  } finally {
    subscription.unsubscribe();
  }
}

async function main() {
  let positionals;
  try {
    ({ values: opts, positionals } = parseArgs({ options: OPTIONS, allowPositionals: true }));
  } catch (err) {
    throw new Failure(err.message);
  }
  loadSchemaIndex(opts.schemas);
  const prompt = positionals.join(" ");
  if (!prompt) throw new Failure("give a prompt: node hearth_client.mjs [--nats URL] PROMPT...");
  let nc;
  try {
    nc = await connect({ servers: opts.nats, timeout: seconds("connect-timeout"), name: "hearth-node-client" });
  } catch (err) {
    throw new Failure(`cannot reach NATS at ${opts.nats}: ${err.message}`);
  }
  try {
    const models = await listModels(nc);
    if (!opts.model && !models.default_model) {
      const served = models.models.map((m) => m.id).join(", ") || "none";
      throw new Failure(`the mesh has no default model; pass --model (served: ${served})`);
    }
    const maxTokens = Number(opts["max-tokens"]);
    const request = {
      request_id: `node-${randomUUID()}`,
      ...(opts.model ? { model: opts.model } : {}),
      prompt,
      max_tokens: opts["self-test-invalid"] ? String(maxTokens) : maxTokens,
      temperature: 0,
    };
    check(schemaFile((e) => e.subject === "llm.chat.request", "llm.chat.request"), request, "the chat request");
    const frames = await streamChat(nc, request);
    const final = frames.at(-1);
    const deltas = frames.filter((f) => f.type === "token_delta");
    console.log(JSON.stringify({
      models: models.models.map((m) => m.id),
      default_model: models.default_model ?? null,
      text: deltas.map((f) => f.text).join(""),
      token_ids: deltas.map((f) => f.token_id),
      frame_types: [...new Set(frames.map((f) => f.type))],
      finish_reason: final.finish_reason ?? null,
      usage: final.usage ?? null,
      ...(final.type === "done"
        ? {}
        : { error: { type: final.type, code: final.code, detail: final.message ?? final.reason } }),
    }));
    return final.type === "done" ? 0 : 1;
  } finally {
    await within(5000, "the NATS connection to close", nc.close());
  }
}

try {
  process.exitCode = await main();
} catch (err) {
  console.error(`hearth_client: ${err instanceof Failure ? err.message : err.stack}`);
  process.exitCode = 2;
}
