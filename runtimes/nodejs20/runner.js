'use strict';
/**
 * gitops-sless Node.js runner: calls the handler once, for jobs and cron.
 *
 * Reads the event from SLESS_EVENT (a JSON object, default `{}`), calls the
 * handler named by SLESS_ENTRYPOINT and prints the JSON of its result as one
 * line on stdout. Whatever the handler logs (console.log, console.info,
 * process.stdout.write) goes to stderr, so stdout holds only the result.
 *
 * The run's ids are the context's: SLESS_REQUEST_ID and SLESS_TRACEPARENT (a generated
 * id, a new trace where they are not set). Its lines are not tagged with them, as a
 * server's requests are: all of a run's output is that run's (its job's error).
 *
 * Exit codes: 0 success, 1 the handler threw / cannot be loaded / returned
 * something that is not JSON, 2 SLESS_EVENT is not a JSON object, 124 the
 * call ran past SLESS_TIMEOUT_SEC (an async handler; a synchronous endless
 * loop cannot be interrupted).
 */

const crypto = require('node:crypto');
const rt = require('./server.js');

const FAIL = `${rt.RUNTIME} runner: error:`;

// Keep the real stdout for the result; everything else written there goes to stderr.
const writeResult = process.stdout.write.bind(process.stdout);
const toStderr = process.stderr.write.bind(process.stderr);
process.stdout.write = toStderr;
for (const method of ['log', 'info', 'debug']) {
  console[method] = (...args) => console.error(...args);
}
for (const name of ['SLESS_OTLP_ENDPOINT', 'SLESS_OTLP_TOKEN', 'SLESS_OTLP_SERVICE']) {
  delete process.env[name]; // a run exports no span of its own; nor the handler's to see
}

function exit(code, stdoutText) {
  const done = () => process.exit(code);
  if (stdoutText === undefined) {
    // stderr is synchronous for files and pipes on Linux; exit at once.
    done();
    return;
  }
  writeResult(stdoutText, done);
}

function parseEvent() {
  let raw = process.env.SLESS_EVENT;
  if (raw === undefined || raw.trim() === '') raw = '{}';
  let event;
  try {
    event = JSON.parse(raw);
  } catch (err) {
    toStderr(`${FAIL} SLESS_EVENT is not valid JSON: ${err.message}\n`);
    return exit(2);
  }
  if (event === null || typeof event !== 'object' || Array.isArray(event)) {
    const kind = event === null ? 'null' : Array.isArray(event) ? 'array' : typeof event;
    toStderr(`${FAIL} SLESS_EVENT must be a JSON object, not ${kind}\n`);
    return exit(2);
  }
  return event;
}

async function main() {
  const event = parseEvent();
  const entrypoint = process.env.SLESS_ENTRYPOINT || '';
  let handler;
  let timeoutSec;
  try {
    timeoutSec = rt.parseTimeout(process.env.SLESS_TIMEOUT_SEC);
    handler = await rt.loadHandler(entrypoint, process.env.SLESS_FUNCTION_DIR || process.cwd());
  } catch (err) {
    toStderr(`${FAIL} ${err instanceof rt.StartupError ? err.message : rt.errorStack(err)}\n`);
    return exit(1);
  }
  const timeoutMs = timeoutSec * 1000;
  const context = rt.makeContext(
    process.env.SLESS_FUNCTION_NAME || '',
    process.env.SLESS_ENV || '',
    process.env.SLESS_REQUEST_ID || crypto.randomUUID().replace(/-/g, ''),
    performance.now() + timeoutMs,
    process.env.SLESS_TRACEPARENT, // a run the reconciler traces
  );
  rt.invoke(handler, event, context, timeoutMs, (err, result, timedOut) => {
    if (timedOut) {
      toStderr(`function timed out after ${rt.formatSeconds(timeoutSec)}s\n`);
      return exit(124);
    }
    if (err) {
      toStderr(`${FAIL} the handler threw ${rt.describeError(err)}\n${rt.errorStack(err)}\n`);
      return exit(1);
    }
    let text;
    try {
      text = result === undefined ? 'null' : JSON.stringify(result);
    } catch (jsonErr) {
      toStderr(`${FAIL} the handler's result is not JSON serialisable: ${rt.describeError(jsonErr)}\n`);
      return exit(1);
    }
    if (text === undefined) {
      toStderr(`${FAIL} the handler's result is not JSON serialisable: ${typeof result}\n`);
      return exit(1);
    }
    return exit(0, `${text}\n`);
  });
}

main();
