'use strict';
// WebSocket messages (tests/test_runtime_websockets.py); the python twin is sockets.py.
// Served with SLESS_WEBSOCKET=1, SLESS_WS_ON_CONNECT=connect, SLESS_WS_ON_DISCONNECT=disconnect.
const fs = require('node:fs');

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const has = (query, name) => Object.prototype.hasOwnProperty.call(query, name);

exports.connect = (event) => {
  const query = event._query;
  if (has(query, 'refuse')) return { statusCode: 403, body: { error: 'refused' } };
  if (has(query, 'boom')) throw new Error('connect failed');
  if (has(query, 'protocol')) return { protocol: query.protocol };
  return undefined;
};

exports.handler = async (message, ctx) => {
  if (typeof message !== 'string') return message; // binary: echoed
  if (message.startsWith('push:')) {
    const n = Number(message.slice(5));
    for (let i = 1; i <= n; i++) ctx.send(`push ${i}`);
    return `pushed ${n}`;
  }
  if (message.startsWith('close:')) {
    const rest = message.slice(6);
    const colon = rest.indexOf(':');
    const code = Number(colon < 0 ? rest : rest.slice(0, colon));
    ctx.close(code, colon < 0 ? '' : rest.slice(colon + 1));
    return undefined;
  }
  if (message === 'json') return { kind: 'json', ok: true };
  if (message.startsWith('sleep:')) {
    await sleep(Number(message.slice(6)) * 1000);
    return 'slept';
  }
  if (message === 'boom') throw new Error('message failed');
  if (message === 'none') return undefined;
  if (message === 'id') return ctx.connectionId;
  if (message.startsWith('print:')) {
    console.log(message.slice(6));
    return 'printed';
  }
  return message;
};

exports.disconnect = (event, ctx) => {
  const log = event._query.log;
  if (log) fs.appendFileSync(log, `disconnect ${event.code} ${ctx.connectionId}\n`);
};
