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

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms).unref());

/**
 * Send `form` (a status form whose body streams, its head valid) on `res`.
 * `options`: { deadline (performance.now() ms of the first value's timeout), timeoutText, requestId,
 * idleSec, maxSec, heartbeatSec, abort (the context's AbortController), contentType,
 * headers, failed(err) (the 500 of an error before the first value) }. `done(status,
 * error)` once it has ended, whatever happened.
 */
async function send(res, form, options, done) {
  const values = valuesOf(form.body);
  let ended = false;
  let why = null; // why it ends early, once known
  const end = (reason) => {
    if (ended) return;
    ended = true;
    why = why || reason;
    options.abort.abort(new Error(why || 'the stream ended'));
    values.end();
  };
  res.on('close', () => {
    if (!res.writableFinished) end('the client went away mid-stream');
  });

  // the first value, within the call's timeout: empty values write nothing
  let first;
  try {
    for (;;) {
      const left = options.deadline - performance.now();
      const step = await Promise.race([values.next(), sleep(Math.max(0, left)).then(() => null)]);
      if (step === null) {
        end(options.timeoutText);
        process.stderr.write(`[sless] ${options.timeoutText}; the call is abandoned\n`);
        options.timedOut();
        done(504, options.timeoutText);
        return;
      }
      if (step.done) {
        first = undefined;
        break;
      }
      first = step.value;
      if (!((typeof first === 'string' || ArrayBuffer.isView(first)) && first.length === 0)) break;
    }
  } catch (err) {
    ended = true;
    options.failed(err);
    done(500, describe(err));
    return;
  }
  if (ended) {
    done(form.statusCode, why); // the client left before the first value
    return;
  }
  const status = form.statusCode;
  const contentType = options.contentType || contentTypeOf(first);
  const encode = encoder(contentType);
  const headers = { ...options.headers, 'Content-Type': contentType, 'X-Accel-Buffering': 'no' };
  if (contentType.startsWith(EVENT_STREAM) && !Object.keys(headers).some((h) => h.toLowerCase() === 'cache-control')) {
    headers['Cache-Control'] = 'no-cache';
  }
  let data;
  try {
    data = first === undefined ? null : encode(first);
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
    if (!res.write(chunk)) {
      await new Promise((resolve) => {
        res.once('drain', resolve);
        res.once('close', resolve);
      });
    }
  };
  const watch = setInterval(() => {
    if (ended) return;
    const now = performance.now();
    if (now >= stopAt) {
      why = `ran for ${options.maxSec}s (stream.maxSec)`;
    } else if (now - lastValue >= options.idleSec * 1000) {
      why = `sent nothing for ${options.idleSec}s (stream.idleSec)`;
    } else {
      if (contentType.startsWith(EVENT_STREAM) && now - lastWrite >= options.heartbeatSec * 1000) {
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
      const step = await values.next();
      lastValue = performance.now();
      if (ended) break;
      if (step.done) break;
      const chunk = encode(step.value);
      if (chunk.length > 0) await write(chunk);
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

module.exports = { EVENT_STREAM, isStream, streamOf, sse, send };
