'use strict';
/**
 * A streamed response, required by server.js the first time a handler returns a stream
 * (a start never pays for it).
 *
 * A handler streams by returning an async iterable (an async generator, a Readable), a
 * generator, or a `{statusCode, headers, body}` form whose body is one. Each value is one
 * chunk, written as soon as it is produced: a Buffer or Uint8Array as it is, a string as
 * UTF-8, anything else as JSON (followed by a newline where the response is
 * `application/x-ndjson`, which a bare stream of such values is). An empty value writes
 * nothing.
 *
 * The first value comes within the call's timeout (else the 504 of any call); then the
 * stream ends unfinished (the connection is cut before the last chunk, so the client sees
 * it did not finish) after `idleSec` without a value or `maxSec` in all, after an error,
 * or once the client went away. Whenever it ends early the handler's iteration is ended
 * (`return()` on its iterator, `destroy()` on a Readable) and `context.signal` aborts.
 */

const NDJSON = 'application/x-ndjson';
const EVENT_STREAM = 'text/event-stream';

/** Whether `value` is something a handler streams (never a string, Buffer or array). */
function isStream(value) {
  if (value === null || typeof value !== 'object' || Array.isArray(value) || ArrayBuffer.isView(value)) return false;
  return Symbol.asyncIterator in value || (typeof value.next === 'function' && Symbol.iterator in value);
}

/** The status form of a result that streams, or null. */
function streamOf(result) {
  if (result === null || typeof result !== 'object') return null;
  if (isStream(result)) return { statusCode: 200, body: result };
  if ('statusCode' in result && isStream(result.body)) return result;
  return null;
}

function contentTypeOf(first) {
  if (Buffer.isBuffer(first) || first instanceof Uint8Array) return 'application/octet-stream';
  if (typeof first === 'string') return 'text/plain; charset=utf-8';
  return NDJSON;
}

function encoder(contentType) {
  const newline = contentType.split(';', 1)[0].trim().toLowerCase() === NDJSON;
  return (value) => {
    if (Buffer.isBuffer(value)) return value;
    if (value instanceof Uint8Array) return Buffer.from(value.buffer, value.byteOffset, value.byteLength);
    if (typeof value === 'string') return Buffer.from(value);
    const text = JSON.stringify(value);
    if (text === undefined) throw new TypeError(`a stream value is not JSON serialisable: ${typeof value}`);
    return Buffer.from(newline ? `${text}\n` : text);
  };
}

/** One server-sent event: `event:`, `id:`, `retry:` and a `data:` line per line of
 *  `data` (a string as it is, anything else as JSON). */
function sse(data, fields = {}) {
  const lines = [];
  for (const name of ['event', 'id']) {
    const value = fields[name];
    if (value === undefined || value === null) continue;
    const text = String(value);
    if (/[\r\n]/.test(text)) throw new Error(`an event's ${name} cannot hold a line break`);
    lines.push(`${name}: ${text}`);
  }
  if (fields.retry !== undefined && fields.retry !== null) lines.push(`retry: ${Math.trunc(Number(fields.retry))}`);
  if (data !== undefined && data !== null) {
    const text = typeof data === 'string' ? data : JSON.stringify(data);
    for (const line of text.replace(/\r\n?/g, '\n').split('\n')) lines.push(`data: ${line}`);
  }
  return `${lines.join('\n')}\n\n`;
}

/** An iterator over `body`'s values, whose `end()` ends the handler's iteration. */
function valuesOf(body) {
  const iterator = Symbol.asyncIterator in body ? body[Symbol.asyncIterator]() : body;
  return {
    next: () => iterator.next(),
    end() {
      if (typeof body.destroy === 'function') body.destroy(); // a Readable
      if (typeof iterator.return === 'function') {
        Promise.resolve()
          .then(() => iterator.return())
          .catch((err) => process.stderr.write(`[sless] the handler failed as its stream ended: ${err && err.stack}\n`));
      }
    },
  };
}

/** A timer as a promise that resolves to `value`, and its cancel. */
function timer(ms, value) {
  let handle;
  const promise = new Promise((resolve) => {
    handle = setTimeout(resolve, Math.max(0, ms), value);
    handle.unref();
  });
  return { promise, cancel: () => clearTimeout(handle) };
}

const ENDED = Symbol('ended');
const TIMED_OUT = Symbol('timed out');

/** Whether a value sends nothing (an empty chunk would end the response; `undefined`,
 *  a bare `yield`, has no JSON). */
const isEmpty = (value) =>
  value === undefined || ((typeof value === 'string' || ArrayBuffer.isView(value)) && value.length === 0);

/**
 * Send `form` (a status form whose body streams, its head valid) on `res`.
 * `options`: { deadline (performance.now() ms of the first value's timeout), timeoutText, requestId,
 * idleSec, maxSec, heartbeatSec, abort (the context's AbortController), contentType,
 * headers, timedOut() (the 504), failed(err) (the 500 of an error before the first
 * value) }. `done(status, error)` once it has ended, whatever happened: at once when it
 * ends early, even while the handler is stuck in an `await` (its pending value is then
 * left to settle on its own).
 */
async function send(res, form, options, done) {
  const values = valuesOf(form.body);
  let ended = false;
  let why = null; // why it ends early, once known
  let stopped; // resolves to ENDED once it ends early: a pending next() is not waited for
  const stoppedAt = new Promise((resolve) => {
    stopped = resolve;
  });
  const end = (reason) => {
    if (ended) return;
    ended = true;
    why = why || reason;
    options.abort.abort(new Error(why || 'the stream ended'));
    stopped(ENDED);
    values.end();
  };
  // the next value, or ENDED; a rejection of a value nobody waits for any more is quiet
  const next = () => {
    let pending;
    try {
      pending = Promise.resolve(values.next()); // a generator's value comes at once
    } catch (err) {
      pending = Promise.reject(err);
    }
    pending.catch(() => {});
    return Promise.race([pending, stoppedAt]);
  };
  res.on('close', () => {
    if (!res.writableFinished) end('the client went away mid-stream');
  });

  // the first value, within the call's timeout: empty values write nothing
  let first;
  let empty = false;
  const limit = timer(options.deadline - performance.now(), TIMED_OUT);
  try {
    for (;;) {
      const step = await Promise.race([next(), limit.promise]);
      if (step === TIMED_OUT) {
        end(options.timeoutText);
        process.stderr.write(`[sless] ${options.timeoutText}; the call is abandoned\n`);
        options.timedOut();
        done(504, options.timeoutText);
        return;
      }
      if (step === ENDED) {
        done(form.statusCode, why); // the client left before the first value
        return;
      }
      if (step.done) {
        empty = true;
        break;
      }
      first = step.value;
      if (!isEmpty(first)) break;
    }
  } catch (err) {
    if (ended) {
      done(form.statusCode, why); // its source was destroyed as the client left
      return;
    }
    ended = true;
    options.failed(err);
    done(500, describe(err));
    return;
  } finally {
    limit.cancel();
  }
  const status = form.statusCode;
  const contentType = options.contentType || contentTypeOf(first);
  const encode = encoder(contentType);
  const named = new Set(Object.keys(options.headers).map((h) => h.toLowerCase()));
  const headers = { ...options.headers, 'Content-Type': contentType };
  if (!named.has('x-accel-buffering')) headers['X-Accel-Buffering'] = 'no'; // nginx: pass each chunk on
  const events = contentType.toLowerCase().startsWith(EVENT_STREAM);
  if (events && !named.has('cache-control')) headers['Cache-Control'] = 'no-cache';
  let data = null;
  try {
    if (!empty) data = encode(first);
  } catch (err) {
    end('a value not JSON serialisable');
    options.failed(err);
    done(500, describe(err));
    return;
  }
  if (data === null || res.req.method === 'HEAD' || status === 204 || status === 304) {
    if (data !== null) end('no body to send');
    res.writeHead(status, headers);
    res.end();
    done(status, null);
    return;
  }
  res.writeHead(status, headers);

  const stopAt = performance.now() + options.maxSec * 1000;
  let lastWrite = performance.now();
  let lastValue = lastWrite;
  const write = async (chunk) => {
    lastWrite = performance.now();
    if (res.write(chunk)) return;
    await new Promise((resolve) => {
      const go = () => {
        res.off('drain', go);
        res.off('close', go);
        resolve();
      };
      res.on('drain', go);
      res.on('close', go);
    });
  };
  const watch = setInterval(() => {
    if (ended) return;
    const now = performance.now();
    if (now >= stopAt) {
      why = `ran for ${options.maxSec}s (stream.maxSec)`;
    } else if (now - lastValue >= options.idleSec * 1000) {
      why = `sent nothing for ${options.idleSec}s (stream.idleSec)`;
    } else {
      if (events && now - lastWrite >= options.heartbeatSec * 1000 && !res.writableNeedDrain) {
        lastWrite = now;
        res.write(': heartbeat\n\n');
      }
      return;
    }
    process.stderr.write(`[sless] the stream ${why}; it is ended\n`);
    end(why);
    res.destroy(); // unfinished: no last chunk
  }, Math.min(50, options.idleSec * 250));
  watch.unref();

  let error = null;
  try {
    await write(data);
    while (!ended) {
      const step = await next();
      if (step === ENDED || step.done) break;
      lastValue = performance.now();
      if (!isEmpty(step.value)) await write(encode(step.value));
      // a handler whose values never wait (a generator) would starve the event loop:
      // the client's leaving and the limits' timer could not be seen
      await new Promise(setImmediate);
    }
  } catch (err) {
    if (!ended) {
      error = describe(err);
      const trace = err && err.stack ? err.stack : describe(err);
      process.stderr.write(
        `[sless] the handler raised mid-stream (request ${options.requestId}); the response ends unfinished:\n${trace}\n`,
      );
      end(error);
      res.destroy();
    }
  }
  clearInterval(watch);
  if (!ended) {
    ended = true;
    res.end();
  }
  done(status, error || why);
}

function describe(err) {
  if (err instanceof Error) return `${err.name}: ${err.message}`;
  return String(err);
}

module.exports = { streamOf, sse, send };
