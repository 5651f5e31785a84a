'use strict';
const STARTED = monotonicSeconds(); // first of all: when the start began (the ready line's "start")
/**
 * gitops-sless Node.js runtime: serves one handler function over HTTP/1.1.
 *
 * Node built-ins only. Configuration comes from the environment:
 *
 *   SLESS_ENTRYPOINT     <path>.<function>, e.g. `handler.main` or `api/v1-users.get` (required)
 *   SLESS_FUNCTION_DIR   the function folder (default: the current directory)
 *   SLESS_FUNCTION_NAME, SLESS_ENV   passed to the handler in its `context`
 *   SLESS_TIMEOUT_SEC    seconds a call may run before it is answered with 504 (default 30);
 *                        for a streamed response, the seconds to its first chunk
 *   SLESS_STREAM_IDLE_SEC, SLESS_STREAM_MAX_SEC
 *                        a streamed response ends (unfinished) after this long without a
 *                        chunk from the handler (default 30), or this long in all (900)
 *   SLESS_STREAM_HEARTBEAT_SEC
 *                        a quiet `text/event-stream` response gets a comment line this
 *                        often, so idle intermediaries keep it (default 15)
 *   SLESS_STREAM_REQUEST 1: the handler reads the request body as it comes, from
 *                        `event._stream` (a Readable: the request itself), instead of `event`
 *                        holding it parsed; no size limit here (the proxy's)
 *   SLESS_STREAM_DRAIN_SEC
 *                        at SIGTERM, open streams and WebSockets end by themselves for this
 *                        long before they are cut (default 30); ordinary calls get the timeout
 *   SLESS_WEBSOCKET      1: the function serves WebSocket upgrades (ws.js, loaded only then),
 *                        with SLESS_WS_ON_CONNECT, SLESS_WS_ON_DISCONNECT (the names of the
 *                        module's hooks) and SLESS_WS_MAX_MESSAGE_BYTES (default 1048576); the
 *                        stream limits above are the socket's idle, max and ping periods
 *   SLESS_ERROR_DETAIL   1: a handler's error is the 500's body; 0: the body is a generic
 *                        error with the request id, the error only in the log (default: 1 in
 *                        a preview environment, `pr-*`, else 0)
 *   PORT, SLESS_HOST     where to listen (default 0.0.0.0:8080)
 *   SLESS_OTLP_ENDPOINT  where set, each call is a span sent over OTLP/HTTP JSON to
 *                        <endpoint>/v1/traces (with SLESS_OTLP_TOKEN as a bearer token and
 *                        SLESS_OTLP_SERVICE as service.name); the three are taken out of
 *                        process.env before the handler loads
 *   SLESS_READY_FD       an inherited pipe: once listening, one JSON line goes there, e.g.
 *                        {"port":8080,"t":{"start":..,"runtime":..,"handler":..,"listening":..}}
 *                        (CLOCK_MONOTONIC seconds at each phase of the start, as Python's
 *                        time.monotonic()), then it is closed; a failed start closes it
 *                        without a line
 *
 * `GET /health` answers {"status":"ok","inflight":..,"requests":..,"busySeconds":..}: the
 * calls running now, the calls answered since the start and the integral of the calls
 * running over time (the average concurrency between two reads is Δbusy/Δt).
 *
 * The timeout races the handler's promise against a timer: an async handler
 * that never settles gets its 504, but a synchronous endless loop blocks the
 * whole process and cannot be interrupted (JavaScript is single-threaded).
 *
 * While a call runs, each line written on stdout or stderr in its async context (console.*,
 * process.stdout.write, process.stderr.write) starts with the call's tag,
 * `[request_id=<id> trace_id=<32 hex>] `, the ids its context shows.
 *
 * `runner.js` requires this file for the shared loading and calling code.
 */

const fs = require('node:fs');
const http = require('node:http');
const path = require('node:path');
const crypto = require('node:crypto');
const { AsyncLocalStorage } = require('node:async_hooks');
const { StringDecoder } = require('node:string_decoder');
const { pathToFileURL } = require('node:url');

const RUNTIME = 'nodejs20';
const DEFAULT_TIMEOUT_SEC = 30;
const MAX_HEADER_BYTES = 64 * 1024;
const REPLICA_KEY_HEADER = 'x-sless-replica'; // the proxy's proof, on the local backend
const MAX_BODY_BYTES = 32 * 1024 * 1024;
const KEEP_ALIVE_TIMEOUT_MS = 75 * 1000; // longer than the usual proxy keep-alive (60 s)
const DEFAULT_STREAM_IDLE_SEC = 30;
const DEFAULT_STREAM_MAX_SEC = 900;
const HEARTBEAT_SEC = 15; // a quiet event stream's comment line, so intermediaries keep it
const DEFAULT_STREAM_DRAIN_SEC = 30; // what streams and sockets get at SIGTERM before they are cut
const SOCKET_CLOSE_WAIT_MS = 5000; // a WebSocket's close frame waits this long for the peer's (ws.js)

let streamModule = null;
/** stream.js beside this file, loaded on the first stream. */
function streams() {
  if (streamModule === null) streamModule = require('./stream.js');
  return streamModule;
}

let socketModule = null;
/** ws.js beside this file, loaded at the start of a WebSocket function (SLESS_WEBSOCKET=1)
 *  only: an HTTP-only function never pays for it. */
function sockets() {
  if (socketModule === null) socketModule = require('./ws.js');
  return socketModule;
}

class StartupError extends Error {}

/** The system-wide monotonic clock in seconds (CLOCK_MONOTONIC, as Python's time.monotonic). */
function monotonicSeconds() {
  return Number(process.hrtime.bigint()) / 1e9;
}

// ------------------------------------------------------------------ configuration

function parseTimeout(raw, fallback = DEFAULT_TIMEOUT_SEC, name = 'SLESS_TIMEOUT_SEC') {
  if (raw === undefined || raw.trim() === '') return fallback;
  const value = Number(raw);
  if (!Number.isFinite(value) || value <= 0) {
    throw new StartupError(`${name}=${JSON.stringify(raw)} must be a positive number of seconds`);
  }
  return value;
}

function formatSeconds(value) {
  return String(value);
}

/** Load `<path>.<function>` from `functionDir`; resolves to the function. */
async function loadHandler(entrypoint, functionDir) {
  return (await loadEntrypoint(entrypoint, functionDir)).handler;
}

/** Load `<path>.<function>` from `functionDir`; resolves to { handler, file, lookup }:
 *  `lookup(name)` finds another export of the module as the handler was found (the
 *  WebSocket hooks, SLESS_WS_ON_CONNECT...). */
async function loadEntrypoint(entrypoint, functionDir) {
  if (!entrypoint) {
    throw new StartupError("SLESS_ENTRYPOINT is not set (expected '<path>.<function>', e.g. 'handler.main')");
  }
  const dot = entrypoint.lastIndexOf('.');
  const relPath = dot > 0 ? entrypoint.slice(0, dot) : '';
  const funcName = dot > 0 ? entrypoint.slice(dot + 1) : '';
  if (!relPath || !funcName) {
    throw new StartupError(
      `SLESS_ENTRYPOINT=${JSON.stringify(entrypoint)} is invalid: expected '<path>.<function>', e.g. 'handler.main'`,
    );
  }
  const dir = path.resolve(functionDir);
  if (!fs.existsSync(dir) || !fs.statSync(dir).isDirectory()) {
    throw new StartupError(`function folder ${dir} does not exist`);
  }
  const file = path.resolve(dir, relPath + '.js');
  if (!fs.existsSync(file) || !fs.statSync(file).isFile()) {
    throw new StartupError(`cannot load SLESS_ENTRYPOINT=${JSON.stringify(entrypoint)}: ${file} does not exist`);
  }
  let mod;
  try {
    mod = require(file);
  } catch (err) {
    if (err && err.code === 'ERR_REQUIRE_ESM') {
      try {
        mod = await import(pathToFileURL(file).href); // "type": "module" in package.json
      } catch (esmErr) {
        throw loadFailure(entrypoint, file, esmErr);
      }
    } else {
      throw loadFailure(entrypoint, file, err);
    }
  }
  const lookup = (name) => {
    let found = mod == null ? undefined : mod[name];
    if (found === undefined && mod && mod.default && typeof mod.default === 'object') found = mod.default[name];
    return found;
  };
  const fn = lookup(funcName);
  if (fn === undefined) {
    throw new StartupError(
      `cannot load SLESS_ENTRYPOINT=${JSON.stringify(entrypoint)}: ${file} does not export ${JSON.stringify(funcName)}`,
    );
  }
  if (typeof fn !== 'function') {
    throw new StartupError(
      `cannot load SLESS_ENTRYPOINT=${JSON.stringify(entrypoint)}: ${JSON.stringify(funcName)} in ${file} is not a function`,
    );
  }
  return { handler: fn, file, lookup };
}

function loadFailure(entrypoint, file, err) {
  const detail = err && err.stack ? err.stack : String(err);
  return new StartupError(`cannot load SLESS_ENTRYPOINT=${JSON.stringify(entrypoint)}: loading ${file} failed:\n${detail}`);
}

// ------------------------------------------------------------------ calling

class Context {
  #requestId;
  #deadline;
  #traceparent;
  #tracestate;

  #spanId;
  #abort;

  constructor(functionName, environment, requestId, deadline, traceparent, tracestate, spanId) {
    this.functionName = functionName;
    this.environment = environment;
    this.#requestId = requestId;
    this.#deadline = deadline;
    this.#traceparent = traceparent;
    this.#tracestate = tracestate;
    this.#spanId = spanId; // the call's own span, where spans are exported
  }

  /** The id of the span exported for this call (SLESS_OTLP_ENDPOINT), else undefined. */
  get spanId() {
    return this.#spanId;
  }

  /** The call's W3C traceparent (the proxy sends one; else a new trace, made on first use). */
  get traceparent() {
    if (!this.#traceparent || !validTraceparent(this.#traceparent)) {
      this.#traceparent = `00-${randomHex(16)}-${randomHex(8)}-01`;
      this.#tracestate = undefined; // it belonged to the traceparent that was not valid
    }
    return this.#traceparent;
  }

  /** The id of the trace the call belongs to (32 hex digits). */
  get traceId() {
    return this.traceparent.slice(3, 35);
  }

  /** Headers that carry the call's trace on to a call it makes (its own span's id as the
   *  parent): `fetch(url, { headers: context.traceHeaders() })`. Where spans are exported
   *  (SLESS_OTLP_ENDPOINT), the parent is the span exported for this call. */
  traceHeaders() {
    const parent = this.traceparent;
    const span = this.#spanId || randomHex(8);
    const headers = { traceparent: `00-${parent.slice(3, 35)}-${span}-${parent.slice(53, 55)}` };
    if (this.#tracestate) headers.tracestate = this.#tracestate;
    return headers;
  }

  /** The X-Request-Id of the call, else a generated id (made on first use). */
  get requestId() {
    if (!this.#requestId) this.#requestId = crypto.randomUUID().replace(/-/g, '');
    return this.#requestId;
  }

  /** An AbortSignal that aborts when the call's streamed response ends early (the client
   *  went away, a stream limit, an error): work for it can stop. */
  get signal() {
    if (!this.#abort) this.#abort = new AbortController();
    return this.#abort.signal;
  }

  /** The runtime's: abort `signal` (once). */
  abortCall(reason) {
    if (!this.#abort) this.#abort = new AbortController();
    if (!this.#abort.signal.aborted) this.#abort.abort(reason);
  }

  /** One server-sent event, to yield from a `text/event-stream` response: `event:`, `id:`,
   *  `retry:` from `fields`, and a `data:` line per line of `data` (a string as it is,
   *  anything else as JSON). */
  sse(data, fields) {
    return streams().sse(data, fields);
  }

  getRemainingTimeInMillis() {
    return Math.max(0, Math.floor(this.#deadline - performance.now()));
  }

  toJSON() {
    return {
      functionName: this.functionName,
      environment: this.environment,
      requestId: this.requestId,
      traceId: this.traceId,
    };
  }
}

const TRACE_FIELDS = /^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$/;

/** A W3C traceparent this runtime can carry on: version 00 exactly, a later one (not ff)
 *  by its first four fields; trace and parent ids not all zeros. */
function validTraceparent(value) {
  if (typeof value !== 'string' || !TRACE_FIELDS.test(value)) return false;
  const version = value.slice(0, 2);
  if (version === 'ff' || (version === '00' && value.length !== 55)) return false;
  return !/^0+$/.test(value.slice(3, 35)) && !/^0+$/.test(value.slice(36, 52));
}

function randomHex(bytes) {
  const out = crypto.randomBytes(bytes);
  out[bytes - 1] |= 1; // never all zeros
  return out.toString('hex');
}

function makeContext(functionName, environment, requestId, deadline, traceparent, tracestate) {
  return new Context(functionName, environment, requestId, deadline, traceparent, tracestate);
}

// ------------------------------------------------------------------ log tags

/** The call a piece of code runs for: { context, tag, out, err, ended } (newCall). `out` and
 *  `err` are null or the stream's Partial; once `ended`, what code in the call's async
 *  context (a timer or socket it left behind) writes passes as written, like any line
 *  written outside a call. */
const calls = new AsyncLocalStorage();
const streamEnds = []; // each tagged stream's end of a call's partial line
const MAX_PARTIAL = 64 * 1024; // a partial line this long is written out as a line of its own
const UTF8 = /^utf-?8$/i;

function newCall(context) {
  return { context, tag: null, out: null, err: null, ended: false };
}

/** A call's partial line on one stream: its pieces (joined once, when it ends) and, once
 *  bytes were written, the decoder that keeps a character split across two writes. */
class Partial {
  constructor() {
    this.pieces = [];
    this.size = 0;
    this.decoder = null;
  }

  /** The pieces, joined; none left. */
  take() {
    const text = this.size === 0 ? '' : this.pieces.join('');
    this.pieces = [];
    this.size = 0;
    return text;
  }
}

/** `[request_id=<id> trace_id=<32 hex>] `: the ids the call's context shows. */
function callTag(call) {
  if (call.tag === null) call.tag = `[request_id=${call.context.requestId} trace_id=${call.context.traceId}] `;
  return call.tag;
}

/** Run `fn(...args)` as the call's code: what it writes until the call ends is tagged. */
function runInCall(call, fn, ...args) {
  return calls.run(call, fn, ...args);
}

/** The call's partial lines (written without their newline), ended. */
function endPartialLines(call) {
  if (call !== undefined && (call.out !== null || call.err !== null)) {
    for (const end of streamEnds) end(call);
  }
}

/** The call is over: its partial lines are ended, and what its async context writes from
 *  now on is not tagged (nor kept) as its. */
function endCall(call) {
  endPartialLines(call);
  call.ended = true;
}

/** The text of a write, `null` for what is not text or bytes. Bytes are decoded with the
 *  call's decoder for the stream: a character split across two writes stays whole. */
function chunkText(call, slot, chunk, encoding) {
  let bytes;
  if (typeof chunk === 'string') {
    if (typeof encoding !== 'string' || UTF8.test(encoding)) {
      const partial = call[slot];
      // bytes still waiting for the rest of their character end where text follows them
      return partial === null || partial.decoder === null ? chunk : partial.decoder.end() + chunk;
    }
    bytes = Buffer.from(chunk, encoding);
  } else if (chunk instanceof Uint8Array) {
    bytes = chunk;
  } else {
    return null;
  }
  const partial = call[slot] === null ? (call[slot] = new Partial()) : call[slot];
  if (partial.decoder === null) partial.decoder = new StringDecoder('utf8');
  return partial.decoder.write(bytes);
}

/** Each write costs what its own text costs: only it is searched for a newline, and a
 *  partial line is kept as its pieces. */
function tagStream(stream, slot) {
  const write = stream.write;
  stream.write = function taggedWrite(chunk, encoding, callback) {
    const call = calls.getStore();
    const text = call === undefined || call.ended ? null : chunkText(call, slot, chunk, encoding);
    if (text === null) return write.apply(this, arguments);
    if (typeof encoding === 'function') callback = encoding;
    const cut = text.lastIndexOf('\n');
    if (cut < 0) {
      if (text !== '') {
        const partial = call[slot] === null ? (call[slot] = new Partial()) : call[slot];
        partial.pieces.push(text);
        partial.size += text.length;
        if (partial.size >= MAX_PARTIAL) return write.call(this, `${callTag(call)}${partial.take()}\n`, callback);
      }
      if (typeof callback === 'function') process.nextTick(callback);
      return true;
    }
    const tag = callTag(call);
    const partial = call[slot];
    let head = text.slice(0, cut);
    if (partial !== null && partial.size > 0) head = partial.take() + head;
    let out = `${tag}${head.includes('\n') ? head.split('\n').join(`\n${tag}`) : head}\n`;
    const rest = text.slice(cut + 1);
    if (rest.length >= MAX_PARTIAL) {
      out += `${tag}${rest}\n`;
    } else if (rest !== '') {
      const kept = partial === null ? (call[slot] = new Partial()) : partial;
      kept.pieces.push(rest);
      kept.size = rest.length;
    }
    return write.call(this, out, callback);
  };
  streamEnds.push((call) => {
    const partial = call[slot];
    if (partial === null) return;
    call[slot] = null;
    const rest = partial.take() + (partial.decoder === null ? '' : partial.decoder.end());
    if (rest !== '') write.call(stream, `${callTag(call)}${rest}\n`);
  });
}

let logTagsInstalled = false;

/** Tag the lines of process.stdout and process.stderr (console.* writes through them). */
function installLogTags() {
  if (logTagsInstalled) return;
  logTagsInstalled = true;
  tagStream(process.stdout, 'out');
  tagStream(process.stderr, 'err');
}

// ------------------------------------------------------------------ spans

const SPAN_BATCH = 256; // sent at once when this many wait, else every SPAN_INTERVAL_MS
const SPAN_INTERVAL_MS = 1000;
const SPAN_QUEUE = 2048; // beyond it the oldest are dropped
const SPAN_FLUSH_MS = 2000; // what is waiting at SIGTERM is sent for at most this long
const SPAN_SCOPE = 'gitops-sless-runtime';
const DEFAULT_SPAN_SERVICE = 'gitops-sless-function';
const EPOCH_NS = BigInt(Date.now()) * 1000000n - process.hrtime.bigint();

const nowNs = () => process.hrtime.bigint() + EPOCH_NS;

function attribute(key, value) {
  return { key, value: typeof value === 'number' ? { intValue: String(value) } : { stringValue: value } };
}

/** Each call's span, sent in batches over OTLP/HTTP JSON from an unref'd timer. A call only
 *  appends to a bounded queue: it never waits for the receiver. */
class SpanExporter {
  constructor(endpoint, token, service, name, environment) {
    let url = endpoint.replace(/\/+$/, '');
    if (!url.endsWith('/v1/traces')) url += '/v1/traces';
    let parsed;
    try {
      parsed = new URL(url);
    } catch {
      parsed = null;
    }
    if (parsed === null || (parsed.protocol !== 'http:' && parsed.protocol !== 'https:')) {
      throw new StartupError(`SLESS_OTLP_ENDPOINT=${JSON.stringify(endpoint)} is not an http(s) URL`);
    }
    this.url = url;
    this.parsed = parsed;
    this.headers = { 'Content-Type': 'application/json' };
    if (token) this.headers.Authorization = `Bearer ${token}`;
    this.name = name;
    this.environment = environment;
    this.resource = { attributes: [attribute('service.name', service), attribute('faas.name', name)] };
    this.queue = [];
    this.dropped = 0;
    this.toldDropped = false;
    this.timer = null;
    this.sending = false;
    this.onIdle = null;
  }

  /** The span of a call that was answered with `status`. */
  add(call, start, status, error) {
    const end = nowNs();
    const context = call.context;
    const traceparent = context.traceparent;
    if (!(parseInt(traceparent.slice(53, 55), 16) & 1)) return; // the caller does not sample it
    const sent = call.sent;
    const parent = sent && sent === traceparent ? sent.slice(36, 52) : null;
    if (this.queue.length >= SPAN_QUEUE) {
      this.queue.shift();
      this.dropped++;
    }
    this.queue.push([traceparent.slice(3, 35), context.spanId, parent, start, end, context.requestId, call.method, status, error]);
    this.schedule(this.queue.length >= SPAN_BATCH ? 0 : SPAN_INTERVAL_MS);
  }

  schedule(ms) {
    if (this.sending) return; // the send in flight looks again when it ends
    if (this.timer !== null) {
      if (ms > 0) return;
      clearTimeout(this.timer);
    }
    // outside any call: the exporter's own lines are not a call's
    this.timer = calls.exit(() => setTimeout(() => this.sendWaiting(), ms));
    this.timer.unref();
  }

  sendWaiting() {
    this.timer = null;
    if (this.dropped > 0 && !this.toldDropped) {
      this.toldDropped = true;
      process.stderr.write(
        `[sless] span export: more than ${SPAN_QUEUE} spans waited; the oldest are dropped (${this.dropped} so far)\n`,
      );
    }
    const batch = this.queue.splice(0, SPAN_BATCH);
    if (batch.length === 0) {
      if (this.onIdle) this.onIdle();
      return;
    }
    this.sending = true;
    const body = JSON.stringify(this.body(batch));
    this.post(body, batch.length, 2, () => {
      this.sending = false;
      if (this.onIdle || this.queue.length >= SPAN_BATCH) this.sendWaiting();
      else if (this.queue.length > 0) this.schedule(SPAN_INTERVAL_MS);
    });
  }

  /** Send what is waiting, for at most SPAN_FLUSH_MS; then `done()`. */
  flush(done) {
    let finished = false;
    const finish = () => {
      if (finished) return;
      finished = true;
      done();
    };
    setTimeout(finish, SPAN_FLUSH_MS);
    this.onIdle = finish;
    if (this.timer !== null) clearTimeout(this.timer);
    if (!this.sending) calls.exit(() => this.sendWaiting());
  }

  body(batch) {
    return {
      resourceSpans: [
        { resource: this.resource, scopeSpans: [{ scope: { name: SPAN_SCOPE }, spans: batch.map((s) => this.span(s)) }] },
      ],
    };
  }

  span([traceId, spanId, parent, start, end, requestId, method, status, error]) {
    const encoded = {
      traceId,
      spanId,
      name: this.name,
      kind: 2, // SERVER
      startTimeUnixNano: String(start),
      endTimeUnixNano: String(end),
      attributes: [
        attribute('faas.invocation_id', requestId),
        attribute('faas.name', this.name),
        attribute('sless.environment', this.environment),
        attribute('http.request.method', method),
        attribute('http.response.status_code', status),
      ],
    };
    if (parent) encoded.parentSpanId = parent;
    if (error !== null) encoded.status = { code: 2, message: error }; // ERROR
    return encoded;
  }

  /** One POST, tried `tries` times; a batch that fails them all is dropped with one line. */
  post(body, count, tries, done) {
    const client = this.parsed.protocol === 'https:' ? require('node:https') : http;
    let answered = false;
    const failed = (problem) => {
      if (answered) return;
      answered = true;
      if (tries > 1) {
        this.post(body, count, tries - 1, done);
        return;
      }
      process.stderr.write(`[sless] span export to ${this.url} failed (${problem}): ${count} spans dropped\n`);
      done();
    };
    const req = client.request(this.parsed, {
      method: 'POST',
      headers: { ...this.headers, 'Content-Length': Buffer.byteLength(body) },
      timeout: 5000,
    });
    req.on('response', (res) => {
      res.resume();
      res.on('end', () => {
        if (res.statusCode < 200 || res.statusCode > 299) {
          failed(`HTTP ${res.statusCode}`);
          return;
        }
        if (answered) return;
        answered = true;
        done();
      });
      res.on('error', (err) => failed(err.message));
    });
    req.on('timeout', () => req.destroy(new Error('timed out')));
    req.on('error', (err) => failed(err.code || err.message));
    req.end(body);
  }
}

/** SLESS_OTLP_ENDPOINT, _TOKEN and _SERVICE, taken out of process.env (not the handler's to
 *  see); the exporter where an endpoint is set, else null. */
function startSpanExport(name, environment) {
  const endpoint = (process.env.SLESS_OTLP_ENDPOINT || '').trim();
  const token = process.env.SLESS_OTLP_TOKEN || '';
  const service = process.env.SLESS_OTLP_SERVICE || DEFAULT_SPAN_SERVICE;
  delete process.env.SLESS_OTLP_ENDPOINT;
  delete process.env.SLESS_OTLP_TOKEN;
  delete process.env.SLESS_OTLP_SERVICE;
  return endpoint ? new SpanExporter(endpoint, token, service, name, environment) : null;
}

function describeError(err) {
  if (err instanceof Error) {
    const name = err.name || (err.constructor && err.constructor.name) || 'Error';
    return err.message ? `${name}: ${err.message}` : name;
  }
  return `Error: ${typeof err === 'string' ? err : safeString(err)}`;
}

function safeString(value) {
  try {
    return typeof value === 'object' && value !== null ? JSON.stringify(value) : String(value);
  } catch {
    return Object.prototype.toString.call(value);
  }
}

function errorStack(err) {
  return err instanceof Error && err.stack ? err.stack : describeError(err);
}

const isThenable = (value) =>
  value !== null && (typeof value === 'object' || typeof value === 'function') && typeof value.then === 'function';

/**
 * Call the handler with a timeout. `done(error, result, timedOut)` is called
 * exactly once; synchronously when the handler is not async.
 */
function invoke(handler, event, context, timeoutMs, done) {
  let result;
  try {
    result = handler(event, context);
  } catch (err) {
    done(err, undefined, false);
    return;
  }
  if (!isThenable(result)) {
    done(null, result, false);
    return;
  }
  let settled = false;
  const timer = setTimeout(() => {
    if (settled) return;
    settled = true;
    done(null, undefined, true);
  }, timeoutMs);
  Promise.resolve(result).then(
    (value) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      done(null, value, false);
    },
    (err) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      done(err === undefined ? new Error('promise rejected without a reason') : err, undefined, false);
    },
  );
}

// ------------------------------------------------------------------ HTTP

const JSON_TYPE = 'application/json';
const SKIPPED_RESPONSE_HEADERS = new Set(['content-length', 'transfer-encoding', 'connection', 'date', 'keep-alive']);

const GENERIC_ERROR = 'the function failed; its log has the details';

/** SLESS_ERROR_DETAIL as given, else whether `environment` is a preview. */
function showsErrorDetail(setting, environment) {
  if (setting === '1' || setting === 'true') return true;
  if (setting === '0' || setting === 'false') return false;
  return String(environment || '').startsWith('pr-');
}

/**
 * The 500 for a handler's error, which is always in the log. Its text can hold what the
 * caller sent or what the function knows, so the caller reads it only where details are
 * shown; elsewhere, the request id that finds it in the log.
 */
function handlerFailed(res, err, method, path, requestId, errorDetail) {
  endPartialLines(calls.getStore()); // the heading starts a line of its own
  process.stderr.write(`[sless] the handler raised on ${method} ${path} (request ${requestId}):\n${errorStack(err)}\n`);
  if (errorDetail) sendJsonError(res, 500, describeError(err));
  else send(res, 500, JSON_TYPE, JSON.stringify({ error: GENERIC_ERROR, requestId }), null);
}

function sendJsonError(res, status, message) {
  send(res, status, JSON_TYPE, JSON.stringify({ error: message }), null);
}

/** `body` is a string (sent as UTF-8, in one write with the head) or a Buffer. */
function send(res, status, contentType, body, extraHeaders) {
  const headers = extraHeaders || {};
  if (contentType) headers['Content-Type'] = contentType;
  if (status === 204 || status === 304) {
    res.writeHead(status, headers);
    res.end();
    return;
  }
  headers['Content-Length'] = typeof body === 'string' ? Buffer.byteLength(body) : body.length;
  res.writeHead(status, headers);
  res.end(body);
}

/** The status form of a result that streams, or null (most results: a plain object). */
function streamOf(result) {
  if (result === null || typeof result !== 'object') return null;
  const body = 'statusCode' in result ? result.body : result;
  if (body === null || typeof body !== 'object') return null;
  if (!(Symbol.asyncIterator in body) && typeof body.next !== 'function') return null;
  return streams().streamOf(result);
}

function sendResult(res, result) {
  if (result === undefined || result === null) {
    send(res, 204, null, null, null);
    return;
  }
  if (typeof result === 'object' && !Array.isArray(result) && !Buffer.isBuffer(result) && 'statusCode' in result) {
    sendStatusForm(res, result);
    return;
  }
  let text;
  try {
    text = JSON.stringify(result);
  } catch (err) {
    sendJsonError(res, 500, `handler result is not JSON serialisable: ${describeError(err)}`);
    return;
  }
  if (text === undefined) {
    sendJsonError(res, 500, `handler result is not JSON serialisable: ${typeof result}`);
    return;
  }
  send(res, 200, JSON_TYPE, text, null);
}

class BadResult extends Error {}

/** The status, headers and Content-Type of a status form; BadResult says what is wrong. */
function statusHead(result) {
  const status = result.statusCode;
  if (!Number.isInteger(status) || status < 200 || status > 599) {
    throw new BadResult(`handler returned an invalid statusCode ${safeString(status)} (expected 200-599)`);
  }
  const given = result.headers == null ? {} : result.headers;
  if (typeof given !== 'object' || Array.isArray(given)) {
    throw new BadResult("handler returned 'headers' that is not an object");
  }
  const headers = {};
  let contentType = null;
  for (const [name, raw] of Object.entries(given)) {
    const value = typeof raw === 'string' ? raw : String(raw);
    // eslint-disable-next-line no-control-regex
    if (!/^[!#$%&'*+.^_`|~0-9A-Za-z-]+$/.test(name) || /[\r\n]/.test(value) || !/^[\x00-\x7f]*$/.test(value)) {
      throw new BadResult(`handler returned an invalid response header ${JSON.stringify(name)}`);
    }
    const lower = name.toLowerCase();
    if (lower === 'content-type') contentType = value;
    else if (!SKIPPED_RESPONSE_HEADERS.has(lower)) headers[name] = value;
  }
  return { status, headers, contentType };
}

function sendStatusForm(res, result) {
  let head;
  try {
    head = statusHead(result);
  } catch (err) {
    if (!(err instanceof BadResult)) throw err;
    sendJsonError(res, 500, err.message);
    return;
  }
  const { status, headers } = head;
  let { contentType } = head;
  const body = result.body;
  let payload;
  if (body === undefined || body === null) {
    payload = '';
  } else if (typeof body === 'string') {
    payload = body;
    contentType = contentType || 'text/plain; charset=utf-8';
  } else if (Buffer.isBuffer(body) || body instanceof Uint8Array) {
    payload = Buffer.from(body);
    contentType = contentType || 'application/octet-stream';
  } else {
    let text;
    try {
      text = JSON.stringify(body);
    } catch (err) {
      sendJsonError(res, 500, `handler body is not JSON serialisable: ${describeError(err)}`);
      return;
    }
    if (text === undefined) {
      sendJsonError(res, 500, `handler body is not JSON serialisable: ${typeof body}`);
      return;
    }
    payload = text;
    contentType = contentType || JSON_TYPE;
  }
  try {
    send(res, status, contentType, payload, headers);
  } catch (err) {
    if (res.headersSent) throw err;
    sendJsonError(res, 500, `handler returned an invalid response: ${describeError(err)}`);
  }
}

function decodePath(raw) {
  if (raw === '') return '/';
  if (!raw.includes('%')) return raw;
  try {
    return decodeURIComponent(raw);
  } catch {
    return raw;
  }
}

function buildEvent(req, body) {
  let event;
  if (body === null) {
    event = { _stream: req };
  } else if (body.length > 0) {
    let parsed;
    try {
      parsed = JSON.parse(body.toString('utf8'));
    } catch {
      parsed = undefined;
    }
    if (parsed !== null && typeof parsed === 'object' && !Array.isArray(parsed)) {
      event = parsed;
    } else {
      event = { _body: body.toString('utf8') };
    }
  } else {
    event = {};
  }
  let url = req.url;
  if (url[0] !== '/' && url !== '*') {
    const m = /^https?:\/\/[^/?#]*(.*)$/i.exec(url); // absolute-form request target
    url = m ? m[1] || '/' : url;
  }
  const q = url.indexOf('?');
  const rawPath = q < 0 ? url : url.slice(0, q);
  const query = {};
  if (q >= 0) {
    for (const [key, value] of new URLSearchParams(url.slice(q + 1))) query[key] = value;
  }
  const headers = {};
  const raw = req.rawHeaders;
  for (let i = 0; i < raw.length; i += 2) {
    const name = raw[i].toLowerCase();
    if (name === REPLICA_KEY_HEADER) continue;
    const prev = headers[name];
    headers[name] = prev === undefined ? raw[i + 1] : `${prev}, ${raw[i + 1]}`;
  }
  event._path = decodePath(rawPath);
  event._query = query;
  event._method = req.method;
  event._headers = headers;
  return event;
}

/**
 * What /health reports of the calls: running now, answered, and busy seconds (the
 * integral of the calls running over time, so a scraper reads the average concurrency
 * between two reads as Δbusy/Δt, as Knative's queue-proxy). A call counts from just
 * before the handler runs until its answer is decided (a call past its timeout ends
 * with its 504).
 */
function healthBody(state) {
  const busyMs = state.busyMs + state.busy * (performance.now() - state.since);
  return JSON.stringify({ status: 'ok', inflight: state.busy, requests: state.requests, busySeconds: busyMs / 1000 });
}

function createServer(handler, options) {
  const { timeoutSec, functionName = '', environment = '', replicaKey = null, exporter = null } = options;
  const { streamIdleSec = DEFAULT_STREAM_IDLE_SEC, streamMaxSec = DEFAULT_STREAM_MAX_SEC } = options;
  const heartbeatSec = options.heartbeatSec ?? HEARTBEAT_SEC;
  const drainSec = options.drainSec ?? DEFAULT_STREAM_DRAIN_SEC;
  // ws.configure's settings where the function serves WebSockets, else null
  const websocket = options.websocket ?? null;
  const requestStream = options.requestStream === true; // the handler reads bodies itself
  const errorDetail = options.errorDetail ?? showsErrorDetail(undefined, environment);
  // set where others share the network (the local backend): a call without it did not
  // come through the proxy, and skipped its limits and its record
  const key = replicaKey ? Buffer.from(replicaKey, 'latin1') : null;
  const fromProxy = (req) => {
    const given = req.headers[REPLICA_KEY_HEADER];
    if (typeof given !== 'string') return false;
    const bytes = Buffer.from(given, 'latin1');
    return bytes.length === key.length && crypto.timingSafeEqual(bytes, key);
  };
  const timeoutMs = timeoutSec * 1000;
  const timeoutText = `function timed out after ${formatSeconds(timeoutSec)}s`;
  // busy: the calls running now; busyMs: its integral over time up to `since` (see healthBody)
  const state = { stopping: false, busy: 0, requests: 0, busyMs: 0, since: performance.now() };
  const track = (delta) => {
    const now = performance.now();
    state.busyMs += state.busy * (now - state.since);
    state.since = now;
    state.busy += delta;
  };

  function handle(req, res, body) {
    let event;
    try {
      event = buildEvent(req, body);
    } catch (err) {
      sendJsonError(res, 400, `cannot read the request: ${describeError(err)}`);
      return;
    }
    const deadline = performance.now() + timeoutMs;
    const headers = event._headers;
    const context = new Context(
      functionName, environment, headers['x-request-id'], deadline, headers.traceparent, headers.tracestate,
      exporter === null ? undefined : randomHex(8),
    );
    const call = newCall(context);
    const start = exporter === null ? 0n : nowNs();
    track(1);
    const finished = (status, error) => {
      endCall(call); // a timer or socket the handler left writes untagged from now on
      if (exporter !== null) {
        call.sent = headers.traceparent;
        call.method = req.method;
        exporter.add(call, start, status, error);
      }
      if (state.stopping) maybeExit();
    };
    calls.run(call, invoke, handler, event, context, timeoutMs, (err, result, timedOut) => {
      // a body the handler left unread: the connection ends with the answer, so the rest
      // is never taken for the next request
      if (body === null && !req.complete) res.shouldKeepAlive = false;
      const form = err || timedOut ? null : streamOf(result);
      if (form !== null) {
        streaming.add(res); // SIGTERM gives it SLESS_STREAM_DRAIN_SEC, not the timeout
        streamResult(req, res, form, context, deadline, event._path, (status, error) => {
          streaming.delete(res);
          track(-1); // a stream is in flight until it ends
          endPartialLines(call);
          state.requests++;
          finished(status, error);
        });
        return;
      }
      track(-1);
      endPartialLines(call); // the runtime's lines about the call start lines of their own
      state.requests++;
      if (state.stopping) res.setHeader('Connection', 'close');
      if (timedOut) {
        process.stderr.write(`[sless] ${timeoutText}; the call is abandoned\n`);
        sendJsonError(res, 504, timeoutText);
      } else if (err) {
        handlerFailed(res, err, req.method, event._path, context.requestId, errorDetail);
      } else {
        try {
          sendResult(res, result);
        } catch (sendErr) {
          process.stderr.write(`[sless] cannot send the response: ${errorStack(sendErr)}\n`);
          if (!res.headersSent) sendJsonError(res, 500, describeError(sendErr));
          else res.destroy();
        }
      }
      finished(res.statusCode, timedOut ? timeoutText : err ? describeError(err) : null);
    });
  }

  /** Send a streamed result (see stream.js); `done(status, error)` once it has ended. */
  function streamResult(req, res, form, context, deadline, path, done) {
    let head;
    try {
      head = statusHead(form);
    } catch (err) {
      const message = err instanceof BadResult ? err.message : `handler returned an invalid response: ${describeError(err)}`;
      sendJsonError(res, 500, message);
      done(500, message);
      return;
    }
    if (state.stopping) res.setHeader('Connection', 'close');
    const options = {
      deadline,
      timeoutText,
      requestId: context.requestId,
      idleSec: streamIdleSec,
      maxSec: streamMaxSec,
      heartbeatSec,
      abort: { abort: (reason) => context.abortCall(reason) },
      contentType: head.contentType,
      headers: head.headers,
      status: head.status,
      timedOut: () => sendJsonError(res, 504, timeoutText),
      failed: (err) => {
        if (err instanceof TypeError && /not JSON serialisable/.test(err.message)) sendJsonError(res, 500, err.message);
        else handlerFailed(res, err, req.method, path, context.requestId, errorDetail);
      },
    };
    let called = false;
    const once = (status, error) => {
      if (called) return;
      called = true;
      done(status, error);
    };
    streams()
      .send(res, form, options, once)
      .catch((err) => {
        process.stderr.write(`[sless] the stream failed: ${errorStack(err)}\n`);
        res.destroy();
        once(500, describeError(err));
      });
  }

  let maybeExit = () => {};
  const streaming = new Set(); // the responses streaming now

  /** What ws.js needs of this server: its checks, load figures, limits and calls. */
  const host = {
    state,
    track,
    handle,
    fromProxy: key === null ? null : fromProxy,
    errorDetail,
    exporter,
    functionName,
    environment,
    timeoutSec,
    timeoutMs,
    idleSec: streamIdleSec,
    maxSec: streamMaxSec,
    idleMs: streamIdleSec * 1000,
    maxMs: streamMaxSec * 1000,
    heartbeatMs: heartbeatSec * 1000,
    /** A socket's call is over (refused, or ended and its onDisconnect run): one request. */
    ended(ws, status, error) {
      track(-1);
      state.requests++;
      endCall(ws.call);
      if (exporter !== null) {
        ws.call.sent = ws.event._headers.traceparent;
        ws.call.method = 'GET';
        exporter.add(ws.call, ws.start, status, error);
      }
      if (state.stopping) maybeExit();
    },
  };

  const server = http.createServer(
    { keepAlive: true, noDelay: true, maxHeaderSize: MAX_HEADER_BYTES },
    (req, res) => {
      const url = req.url;
      if ((req.method === 'GET' || req.method === 'HEAD') && (url === '/health' || url.startsWith('/health?'))) {
        // the load figures only to the proxy where others share the network: they would
        // tell a neighbour's function how this one is used
        const body = key !== null && !fromProxy(req) ? '{"status":"ok"}' : healthBody(state);
        send(res, 200, JSON_TYPE, body, null);
        return;
      }
      if (key !== null && !fromProxy(req)) {
        res.setHeader('Connection', 'close');
        sendJsonError(res, 403, 'call functions through the proxy');
        return;
      }
      const headers = req.headers;
      // `Upgrade: websocket` without `Connection: Upgrade` (else node emits 'upgrade')
      if (upgrades !== null && headers.upgrade !== undefined && upgrades.rejectsUpgrade(req, res)) return;
      if (requestStream) {
        handle(req, res, null); // event._stream is `req`: read by the handler as it comes
        return;
      }
      if (headers['transfer-encoding'] === undefined) {
        const length = headers['content-length'];
        if (length === undefined || length === '0') {
          handle(req, res, Buffer.alloc(0));
          return;
        }
        if (Number(length) > MAX_BODY_BYTES) {
          res.setHeader('Connection', 'close');
          sendJsonError(res, 413, `request body larger than ${MAX_BODY_BYTES} bytes`);
          return;
        }
      }
      const chunks = [];
      let size = 0;
      let tooLarge = false;
      req.on('data', (chunk) => {
        if (tooLarge) return;
        size += chunk.length;
        if (size > MAX_BODY_BYTES) {
          tooLarge = true;
          res.setHeader('Connection', 'close');
          sendJsonError(res, 413, `request body larger than ${MAX_BODY_BYTES} bytes`);
          return;
        }
        chunks.push(chunk);
      });
      req.on('end', () => {
        if (!tooLarge) handle(req, res, chunks.length === 1 ? chunks[0] : Buffer.concat(chunks));
      });
      req.on('error', () => {}); // client went away mid-body
    },
  );
  // without an 'upgrade' listener node serves an upgrade request as an ordinary one
  const upgrades = websocket === null ? null : sockets().attach(server, { ...websocket, handler }, host);
  server.keepAliveTimeout = KEEP_ALIVE_TIMEOUT_MS;
  server.headersTimeout = KEEP_ALIVE_TIMEOUT_MS + 1000;
  server.on('clientError', (err, socket) => {
    if (socket.writable && !socket.writableEnded) {
      const status = err.code === 'HPE_HEADER_OVERFLOW' ? 431 : 400;
      const body = JSON.stringify({ error: status === 431 ? 'request header too large' : 'malformed request' });
      socket.end(
        `HTTP/1.1 ${status} ${http.STATUS_CODES[status]}\r\nContent-Type: application/json\r\n` +
          `Content-Length: ${Buffer.byteLength(body)}\r\nConnection: close\r\n\r\n${body}`,
      );
    } else {
      socket.destroy();
    }
  });

  /** Stop accepting, let running calls finish (at most the timeout), streams and sockets
   *  end by themselves for SLESS_STREAM_DRAIN_SEC (then they are cut, a socket closed with
   *  1001), then call `onDone`. */
  server.shutdown = (onDone) => {
    state.stopping = true;
    let finished = false;
    const finish = () => {
      if (finished) return;
      finished = true;
      calls.exit(onDone); // the last call's answer may be what ends the wait: not its lines
    };
    const lasting = () => streaming.size + (upgrades === null ? 0 : upgrades.open());
    let callsOver = false; // the ordinary calls had their timeout: only streams and sockets count
    maybeExit = () => {
      if (state.busy <= 0 || (callsOver && lasting() === 0)) finish();
    };
    server.close();
    server.closeIdleConnections();
    const timers = [
      setTimeout(() => {
        callsOver = true;
        maybeExit();
      }, timeoutMs + 1000),
      setTimeout(() => {
        const left = lasting();
        if (left > 0) {
          const drain = `SLESS_STREAM_DRAIN_SEC (${formatSeconds(drainSec)}s)`;
          process.stderr.write(`[sless] stopping: ${left} streams and sockets still open after ${drain} are cut\n`);
        }
        for (const res of streaming) res.destroy(); // unfinished, as any stream cut short
        if (upgrades !== null) upgrades.goAway();
        // a socket's close frame waits for the peer's, then its onDisconnect runs
        setTimeout(finish, SOCKET_CLOSE_WAIT_MS + timeoutMs + 1000).unref();
        maybeExit();
      }, drainSec * 1000),
    ];
    for (const timer of timers) timer.unref();
    maybeExit();
  };
  return server;
}

// ------------------------------------------------------------------ main

function fatal(message) {
  process.stderr.write(`${RUNTIME} runtime: error: ${message}\n`);
  process.exit(1);
}

function keepServingOnStrayErrors() {
  process.on('uncaughtException', (err) => {
    process.stderr.write(`[sless] uncaught exception (the server keeps serving):\n${errorStack(err)}\n`);
  });
  process.on('unhandledRejection', (reason) => {
    process.stderr.write(`[sless] unhandled promise rejection (the server keeps serving):\n${errorStack(reason)}\n`);
  });
}

/** The pipe named by SLESS_READY_FD, taken out of the environment: not the handler's. */
function takeReadyFd() {
  const raw = process.env.SLESS_READY_FD;
  delete process.env.SLESS_READY_FD;
  if (raw === undefined || raw === '') return null;
  if (!/^\d+$/.test(raw)) throw new StartupError(`SLESS_READY_FD=${JSON.stringify(raw)} is not a file descriptor number`);
  const fd = Number(raw);
  try {
    fs.fstatSync(fd);
  } catch (err) {
    throw new StartupError(`SLESS_READY_FD=${JSON.stringify(raw)} is not an open file descriptor: ${err.code}`);
  }
  return fd;
}

/** Write the ready line to `fd` and close it. */
function announceReady(fd, port, phases) {
  let line = Buffer.from(JSON.stringify({ port, t: phases }) + '\n');
  try {
    while (line.length > 0) line = line.subarray(fs.writeSync(fd, line));
  } catch (err) {
    process.stderr.write(`[sless] cannot write the ready line to SLESS_READY_FD=${fd}: ${err.code || err.message}\n`);
  } finally {
    closeFd(fd);
  }
}

function closeFd(fd) {
  if (fd === null) return;
  try {
    fs.closeSync(fd);
  } catch {
    // already closed: nothing to tell the parent
  }
}

async function main() {
  const phases = { start: STARTED, runtime: monotonicSeconds() };
  const entrypoint = process.env.SLESS_ENTRYPOINT || '';
  const host = process.env.SLESS_HOST || '0.0.0.0';
  const portText = process.env.PORT || '8080';
  const port = Number(portText);
  let handler;
  let timeoutSec;
  let streamLimits;
  let replicaKey;
  let exporter = null;
  let websocket = null;
  let readyFd = null;
  try {
    readyFd = takeReadyFd();
    if (!/^\d+$/.test(portText) || port > 65535) throw new StartupError(`PORT=${JSON.stringify(portText)} is not a port number`);
    timeoutSec = parseTimeout(process.env.SLESS_TIMEOUT_SEC);
    const seconds = (name, fallback) => parseTimeout(process.env[name], fallback, name);
    streamLimits = {
      streamIdleSec: seconds('SLESS_STREAM_IDLE_SEC', DEFAULT_STREAM_IDLE_SEC),
      streamMaxSec: seconds('SLESS_STREAM_MAX_SEC', DEFAULT_STREAM_MAX_SEC),
      heartbeatSec: seconds('SLESS_STREAM_HEARTBEAT_SEC', HEARTBEAT_SEC),
      drainSec: seconds('SLESS_STREAM_DRAIN_SEC', DEFAULT_STREAM_DRAIN_SEC),
    };
    const functionDir = process.env.SLESS_FUNCTION_DIR || process.cwd();
    replicaKey = process.env.SLESS_REPLICA_KEY || null;
    delete process.env.SLESS_REPLICA_KEY; // not the handler's to see
    exporter = startSpanExport(process.env.SLESS_FUNCTION_NAME || entrypoint, process.env.SLESS_ENV || '');
    installLogTags();
    const loaded = await loadEntrypoint(entrypoint, functionDir);
    handler = loaded.handler;
    if (process.env.SLESS_WEBSOCKET === '1') websocket = sockets().configure(process.env, loaded.lookup, loaded.file);
    phases.handler = monotonicSeconds();
  } catch (err) {
    closeFd(readyFd); // no line: the parent reads EOF
    fatal(err instanceof StartupError ? err.message : errorStack(err));
    return;
  }
  keepServingOnStrayErrors();
  const server = createServer(handler, {
    timeoutSec,
    functionName: process.env.SLESS_FUNCTION_NAME || '',
    environment: process.env.SLESS_ENV || '',
    replicaKey,
    exporter,
    ...streamLimits,
    websocket,
    requestStream: process.env.SLESS_STREAM_REQUEST === '1',
    errorDetail: showsErrorDetail(process.env.SLESS_ERROR_DETAIL, process.env.SLESS_ENV),
  });
  server.once('error', (err) => {
    closeFd(readyFd);
    fatal(`cannot listen on ${host}:${port}: ${err.message}`);
  });
  server.listen(port, host, () => {
    phases.listening = monotonicSeconds();
    if (readyFd !== null) announceReady(readyFd, server.address().port, phases);
    readyFd = null; // closed: its number may be reused
    process.stderr.write(`${RUNTIME} serving ${entrypoint} on ${host}:${server.address().port}\n`);
  });
  const stop = () => {
    process.removeAllListeners('SIGTERM');
    process.removeAllListeners('SIGINT');
    process.on('SIGTERM', () => {});
    process.on('SIGINT', () => {});
    server.shutdown(() => {
      const exit = () => {
        process.stderr.write(`${RUNTIME} stopped\n`);
        process.exit(0);
      };
      if (exporter !== null) exporter.flush(exit);
      else exit();
    });
  };
  process.on('SIGTERM', stop);
  process.on('SIGINT', stop);
}

module.exports = {
  RUNTIME,
  StartupError,
  parseTimeout,
  formatSeconds,
  loadHandler,
  makeContext,
  newCall,
  runInCall,
  endPartialLines,
  endCall,
  installLogTags,
  describeError,
  errorStack,
  invoke,
  createServer,
  // for ws.js
  Context,
  randomHex,
  nowNs,
  buildEvent,
  handlerFailed,
  send,
  sendJsonError,
  sendStatusForm,
};

if (require.main === module) {
  main();
}
