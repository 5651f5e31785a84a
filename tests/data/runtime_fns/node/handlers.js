'use strict';
// Handlers for tests/test_runtimes.py (nodejs20 runtime); python/handlers.py mirrors them.

const helper = require('./helper'); // a sibling module of the function folder

console.log('handlers module loaded'); // at import time: must not reach the runner's stdout

let calls = 0;
const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** The HTTP handler: dispatches on the sub-path. */
exports.main = async (event, context) => {
  calls += 1;
  switch (event._path) {
    case '/add':
      return { sum: helper.add(event.a, event.b) };
    case '/text':
      return { statusCode: 201, headers: { 'X-Custom': 'yes' }, body: 'created' };
    case '/json-status':
      return { statusCode: 202, headers: { 'X-Kind': 'json' }, body: { accepted: true } };
    case '/none':
      return undefined;
    case '/list':
      return [1, 2, 3];
    case '/boom':
      throw new TypeError('kaboom');
    case '/unserialisable':
      return { value: 10n };
    case '/slow':
      return exports.slow();
    case '/async':
      await sleep(10);
      return { async: true };
    case '/calls':
      return { calls };
    case '/context':
      return {
        function_name: context.functionName,
        environment: context.environment,
        request_id: context.requestId,
        remaining_ms: context.getRemainingTimeInMillis(),
      };
    case '/trace':
      return { trace_id: context.traceId, traceparent: context.traceparent, outgoing: context.traceHeaders() };
    case '/env-keys':
      return Object.keys(process.env).filter((k) => k.startsWith('SLESS_')).sort();
    case '/dep':
      return { dep: require('fakedep').NAME }; // from node_modules, created by the test
    default:
      return event;
  }
};

/** Runner: logs on stdout itself, returns the sum. */
exports.add = (event) => {
  console.log('noise from the handler');
  return { sum: event.a + event.b };
};

exports.boom = () => {
  throw new TypeError('kaboom');
};

/** Three seconds, then a mark in SLOW_MARK (if set): see python/handlers.py. */
exports.slow = async () => {
  await sleep(3000);
  if (process.env.SLOW_MARK) require('node:fs').appendFileSync(process.env.SLOW_MARK, 'finished\n');
  return { late: true };
};

exports.nothing = () => undefined;

exports.whoami = (event, context) => ({
  function_name: context.functionName,
  environment: context.environment,
  remaining_ms: context.getRemainingTimeInMillis(),
});
