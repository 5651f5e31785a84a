// Server-sent events: ?n=5 -> five `tick` events, one a second, each sent as it is made.
// A browser reads them with new EventSource("/fn/prod/ticker-js/?n=5"); curl with -N.
// a wait that ends early when `signal` aborts (the client left, a stream limit passed)
const sleep = (ms, signal) =>
  new Promise((resolve) => {
    const timer = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => {
      clearTimeout(timer);
      resolve();
    }, { once: true });
  });

module.exports.handler = async (event, context) => {
  const count = Math.min(Number((event._query || {}).n) || 5, 60);
  return {
    statusCode: 200,
    headers: { 'Content-Type': 'text/event-stream' },
    body: (async function* () {
      for (let n = 1; n <= count; n++) {
        yield context.sse({ n, of: count }, { event: 'tick', id: String(n) });
        // a client that leaves aborts context.signal: the wait ends with it
        if (n < count && !context.signal.aborted) await sleep(1000, context.signal);
      }
      yield context.sse('done', { event: 'end' });
    })(),
  };
};
