// A WebSocket echo: every message comes back; `who` lists the sockets open on this replica.
// Try it with the `websockets` package: python3 -m websockets ws://127.0.0.1:8080/fn/prod/echo-js/
const open = new Map(); // connection id -> its context, on this replica

module.exports.connect = async (event, context) => {
  if ('deny' in (event._query || {})) {
    return { statusCode: 403, body: { error: 'not today' } }; // refused: no socket is opened
  }
  open.set(context.connectionId, context);
};

module.exports.handler = async (message, context) => {
  if (message === 'who') return { open: [...open.keys()].sort() };
  if (message === 'hello all') {
    const others = [...open.entries()].filter(([id]) => id !== context.connectionId);
    for (const [, other] of others) {
      try {
        await other.send(`${context.connectionId} says hello`); // a push to another socket
      } catch {
        // it closed meanwhile
      }
    }
    return `said hello to ${others.length}`;
  }
  return message; // text stays text, a Buffer stays binary
};

module.exports.disconnect = async (event, context) => {
  open.delete(context.connectionId);
  console.log(`closed with ${event.code}`);
};
