'use strict';
// Streamed responses (tests/test_runtime_streams.py), one per path; the python twin is
// streams.py. ?signal=FILE: wait for FILE before the second value; ?mark=FILE: write
// what happened to the iteration there when it ends.
const fs = require('node:fs');
const { Readable } = require('node:stream');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

async function waitFor(file, seconds = 20) {
  const end = Date.now() + seconds * 1000;
  while (!fs.existsSync(file) && Date.now() < end) await sleep(20);
}

function marked(query, what) {
  if (query.mark) fs.appendFileSync(query.mark, `${what}\n`);
}

function* counting(query) {
  // a synchronous generator: its values come as fast as they are taken
  let finished = false;
  try {
    for (let n = 0; n < 1e8; n++) yield `tick ${n}\n`;
    finished = true;
    marked(query, 'finished');
  } finally {
    if (!finished) marked(query, 'closed');
  }
}

async function* asyncCounting(query, context) {
  try {
    for (let n = 0; n < 2000; n++) {
      yield `tick ${n}\n`;
      await sleep(50);
    }
    marked(query, 'finished');
  } finally {
    marked(query, context.signal.aborted ? 'ended, aborted' : 'ended');
  }
}

exports.handler = async (event, context) => {
  const path = event._path;
  const query = event._query;
  if (path === '/gen') {
    return (async function* () {
      yield 'first\n';
      if (query.signal) await waitFor(query.signal);
      yield 'second\n';
    })();
  }
  if (path === '/async') {
    // a Readable, as node's own streams make them
    return Readable.from(
      (async function* () {
        yield Buffer.from('first\n');
        if (query.signal) await waitFor(query.signal);
        yield Buffer.from('second\n');
      })(),
    );
  }
  if (path === '/ndjson') return [{ n: 1 }, { n: 2 }, [3]][Symbol.iterator]();
  if (path === '/form') {
    return {
      statusCode: 201,
      headers: { 'Content-Type': 'application/json', 'X-Kind': 'form' },
      body: (function* () {
        yield ''; // writes nothing
        yield '{"a":1}';
      })(),
    };
  }
  if (path === '/sse') {
    return {
      statusCode: 200,
      headers: { 'Content-Type': 'text/event-stream' },
      body: (async function* () {
        yield context.sse({ n: 1 }, { event: 'tick', id: '1' });
        yield context.sse('two\nlines', { retry: 500 });
        if (query.quiet) {
          await sleep(Number(query.quiet) * 1000);
          yield context.sse('after');
        }
      })(),
    };
  }
  if (path === '/boom') {
    return (async function* () {
      yield 'first\n';
      throw new Error('broke mid-stream');
    })();
  }
  if (path === '/boom-first') {
    return (async function* () {
      throw new Error('broke before the first value');
    })();
  }
  if (path === '/counting') return counting(query);
  if (path === '/async-counting') return asyncCounting(query, context);
  if (path === '/idle') {
    return (async function* () {
      yield 'first\n';
      await sleep(Number(query.sleep || '5') * 1000);
      yield 'late\n';
    })();
  }
  if (path === '/made-on-its-loop') {
    const source = (async function* () {
      yield 'first\n';
      yield 'second\n';
    })();
    const first = await source.next();
    return (async function* () {
      yield first.value;
      yield* source;
    })();
  }
  if (path === '/stuck') {
    return (async function* () {
      yield 'first\n';
      await new Promise(() => {}); // stuck for good: only a limit ends it
      yield 'late\n';
    })();
  }
  if (path === '/slow-first') {
    return (async function* () {
      await sleep(Number(query.sleep || '3') * 1000);
      yield 'first\n';
    })();
  }
  if (path === '/empty') return [][Symbol.iterator]();
  return { path };
};
