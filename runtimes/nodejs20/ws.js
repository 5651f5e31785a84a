'use strict';
/**
 * WebSocket functions (RFC 6455), required by server.js at start-up only where
 * SLESS_WEBSOCKET=1: an HTTP-only function never loads it.
 *
 * An upgrade runs the module's onConnect (SLESS_WS_ON_CONNECT) before the 101; then the
 * entrypoint runs once per complete message, in order, one at a time, and its return
 * value is the answer (a string a text frame, a Buffer or Uint8Array a binary frame,
 * anything else its JSON as text; nothing sends nothing). `context.send()` sends at any
 * time, `context.close()` starts the close handshake; onDisconnect
 * (SLESS_WS_ON_DISCONNECT) runs once when the socket has ended, whatever ended it.
 *
 * Node is single-threaded: each frame goes out in one synchronous write (a corked pair
 * for a large one), so frames never interleave whoever sends them. Frames are parsed
 * from the socket's reads as they come (a frame split across reads, several in one
 * read); a frame's length is checked against SLESS_WS_MAX_MESSAGE_BYTES from its header,
 * before its payload is kept. Reading stops while the peer does not take what is written
 * (a write that returns false, until 'drain') or while too many messages wait for the
 * handler, so neither side's buffer grows without bound.
 *
 * Each socket has one timer, set to the next thing due: the heartbeat ping, the idle and
 * max limits (SLESS_STREAM_*), the end of the 5 s wait for the peer's close.
 */

const crypto = require('node:crypto');
const http = require('node:http');
// the runtime's shared code; server.js is loaded (it is the main module) when this is
const rt = require('./server.js');

const GUID = '258EAFA5-E914-47DA-95CA-C5AB0DC85B11';
const DEFAULT_MAX_MESSAGE_BYTES = 1048576;
const CLOSE_WAIT_MS = 5000; // how long a close frame waits for the peer's
const MAX_QUEUED = 64; // messages waiting for the handler before reading stops
const SMALL_FRAME = 16 * 1024; // a frame up to this size is copied into one buffer with its header
const KEY = /^[A-Za-z0-9+/]{22}==$/; // base64 of 16 bytes
const EMPTY = Buffer.alloc(0);

const CONTINUATION = 0x0;
const TEXT = 0x1;
const BINARY = 0x2;
const CLOSE = 0x8;
const PING = 0x9;
const PONG = 0xa;

// the socket's life: onConnect runs; messages flow; our close frame waits for the peer's;
// no more frames either way (the TCP connection is ending); ended ('close' was emitted)
const CONNECTING = 0;
const OPEN = 1;
const CLOSING = 2;
const CLOSED = 3;
const ENDED = 4;

// fatal: a text message or close reason that is not UTF-8 is an error, not U+FFFD;
// ignoreBOM: a leading U+FEFF is the message's, as python's decode keeps it
const utf8 = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true });

// ------------------------------------------------------------------ configuration

/**
 * The WebSocket settings from `env`, the entrypoint's module already loaded (`lookup`
 * finds its exports): { onConnect, onDisconnect, maxMessageBytes }. A bad value is a
 * StartupError naming the variable, as a bad SLESS_STREAM_* is.
 */
function configure(env, lookup, file) {
  const hook = (name) => {
    const wanted = (env[name] || '').trim();
    if (wanted === '') return null;
    const fn = lookup(wanted);
    if (fn === undefined) {
      throw new rt.StartupError(`${name}=${JSON.stringify(wanted)}: ${file} does not export ${JSON.stringify(wanted)}`);
    }
    if (typeof fn !== 'function') {
      throw new rt.StartupError(`${name}=${JSON.stringify(wanted)}: ${JSON.stringify(wanted)} in ${file} is not a function`);
    }
    return fn;
  };
  let maxMessageBytes = DEFAULT_MAX_MESSAGE_BYTES;
  const raw = env.SLESS_WS_MAX_MESSAGE_BYTES;
  if (raw !== undefined && raw.trim() !== '') {
    maxMessageBytes = /^\s*\d+\s*$/.test(raw) ? Number(raw) : NaN;
    if (!Number.isSafeInteger(maxMessageBytes) || maxMessageBytes <= 0) {
      const name = `SLESS_WS_MAX_MESSAGE_BYTES=${JSON.stringify(raw)}`;
      throw new rt.StartupError(`${name} must be a positive whole number of bytes`);
    }
  }
  return { onConnect: hook('SLESS_WS_ON_CONNECT'), onDisconnect: hook('SLESS_WS_ON_DISCONNECT'), maxMessageBytes };
}

// ------------------------------------------------------------------ frames

/** Whether a close code may be sent or received (RFC 6455 7.4, IANA's registry): 1004-1006
 *  and 1015 are reserved, 1016-2999 are for the RFC's future, 3000-4999 for applications. */
function closeCodeValid(code) {
  return (code >= 1000 && code <= 1003) || (code >= 1007 && code <= 1014) || (code >= 3000 && code <= 4999);
}

/** The frame header for a payload of `length` bytes (FIN set: the server never fragments,
 *  never masks). */
function frameHead(opcode, length, size) {
  const head = Buffer.allocUnsafe(size);
  head[0] = 0x80 | opcode;
  if (length < 126) {
    head[1] = length;
  } else if (length < 65536) {
    head[1] = 126;
    head.writeUInt16BE(length, 2);
  } else {
    head[1] = 127;
    head.writeUInt32BE(Math.floor(length / 0x100000000), 2);
    head.writeUInt32BE(length >>> 0, 6);
  }
  return head;
}

function headSize(length) {
  return length < 126 ? 2 : length < 65536 ? 4 : 10;
}

function closePayload(code, reason) {
  if (code === null) return EMPTY;
  const text = Buffer.from(reason);
  const payload = Buffer.allocUnsafe(2 + text.length);
  payload.writeUInt16BE(code, 0);
  text.copy(payload, 2);
  return payload;
}

function unmask(payload, mask) {
  for (let i = 0; i < payload.length; i++) payload[i] ^= mask[i & 3];
}

/** [opcode, payload] of a value sent or returned: a string is text, bytes are binary,
 *  anything else its JSON as text. */
function encode(value) {
  if (typeof value === 'string') return [TEXT, Buffer.from(value)];
  if (Buffer.isBuffer(value)) return [BINARY, value];
  if (value instanceof Uint8Array) return [BINARY, Buffer.from(value.buffer, value.byteOffset, value.byteLength)];
  const text = JSON.stringify(value);
  if (text === undefined) throw new TypeError(`a WebSocket message is not JSON serialisable: ${typeof value}`);
  return [TEXT, Buffer.from(text)];
}

// ------------------------------------------------------------------ the context

/** The runtime's Context, plus the socket's id, `send()` and `close()` (bound: they may
 *  be passed around), and the time left of the current message's (or hook's) timeout. */
class SocketContext extends rt.Context {
  #socket;

  constructor(socket, ...contextArgs) {
    super(...contextArgs);
    this.#socket = socket;
    this.connectionId = this.requestId;
    this.send = (data) => socket.send(data);
    this.close = (code = 1000, reason = '') => socket.close(code, reason);
  }

  getRemainingTimeInMillis() {
    return Math.max(0, Math.floor(this.#socket.deadline - performance.now()));
  }

  toJSON() {
    return { ...super.toJSON(), connectionId: this.connectionId };
  }
}

// ------------------------------------------------------------------ a socket

class Socket {
  constructor(socket, req, event, host, hooks) {
    this.socket = socket;
    this.host = host;
    this.hooks = hooks;
    this.event = event;
    this.state = CONNECTING;
    this.deadline = performance.now() + host.timeoutMs;
    const headers = event._headers;
    this.context = new SocketContext(
      this, host.functionName, host.environment, headers['x-request-id'], this.deadline,
      headers.traceparent, headers.tracestate, host.exporter === null ? undefined : rt.randomHex(8),
    );
    this.call = rt.newCall(this.context);
    this.start = host.exporter === null ? 0n : rt.nowNs();
    // what the peer sent in its close frame; 1006 while none came
    this.code = 1006;
    this.reason = '';
    this.closeReceived = false;
    // the parser: the header read so far, the frame whose payload is being read
    this.head = Buffer.allocUnsafe(14);
    this.headLength = 0;
    this.frame = null;
    this.reading = true; // false once nothing the peer sends matters any more
    // a fragmented message: its opcode (0: none open), pieces and size
    this.fragmentOpcode = 0;
    this.fragments = [];
    this.fragmentBytes = 0;
    // messages waiting for the handler
    this.queue = [];
    this.queueSizes = []; // each message's size in bytes, as it came
    this.queuedBytes = 0;
    this.pumping = false;
    this.running = null; // the handler's run for the current message, until it settles
    this.paused = false;
    this.onDrained = null;
    // the one timer, and what it watches
    this.timer = null;
    this.openedAt = 0;
    this.lastReceived = 0;
    this.pingedAt = 0;
    this.closeDeadline = 0;
  }

  /** Runtime lines about the socket, tagged as the call's; a partial line of the
   *  handler's is ended first, so they start lines of their own. */
  log(line) {
    rt.runInCall(this.call, () => {
      rt.endPartialLines(this.call);
      process.stderr.write(`[sless] ${line}\n`);
    });
  }

  /** `fn(arg, context)` within the timeout, its lines tagged; resolves to
   *  { err, result, timedOut } (the handler is not waited for past its timeout). */
  run(fn, arg) {
    this.deadline = performance.now() + this.host.timeoutMs;
    return new Promise((resolve) => {
      rt.runInCall(this.call, rt.invoke, fn, arg, this.context, this.host.timeoutMs, (err, result, timedOut) =>
        resolve({ err, result, timedOut }),
      );
    });
  }

  // ---------------------------------------------------------------- open

  /** Answer 101 and start: `head` is what the client sent after its request. */
  open(accept, protocol, head) {
    const socket = this.socket;
    socket.setTimeout(0);
    socket.write(
      'HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n' +
        `Sec-WebSocket-Accept: ${accept}\r\n${protocol === null ? '' : `Sec-WebSocket-Protocol: ${protocol}\r\n`}\r\n`,
    );
    this.state = OPEN;
    const now = performance.now();
    this.openedAt = now;
    this.lastReceived = now;
    this.pingedAt = now;
    socket.on('data', (chunk) => this.receive(chunk));
    socket.on('drain', () => this.drained());
    // the peer's FIN: our side ends too (the server's sockets allow half-open ones); after
    // its close frame, once the answers to the messages before it are out; without one,
    // at once (it vanished: the messages still queued have nobody to answer)
    socket.on('end', () => {
      if (!(this.state === OPEN && this.closeReceived)) this.shut();
    });
    socket.on('close', () => this.ended());
    this.schedule();
    if (head.length > 0) this.receive(head);
  }

  // ---------------------------------------------------------------- reading

  receive(chunk) {
    this.lastReceived = performance.now();
    let at = 0;
    while (at < chunk.length && this.reading) {
      let frame = this.frame;
      if (frame === null) {
        at = this.readHead(chunk, at);
        frame = this.frame;
        if (frame === null) continue; // more bytes to come, or the header failed the socket
      }
      if (frame.got < frame.length) {
        const take = Math.min(frame.length - frame.got, chunk.length - at);
        // a payload that does not matter (past our close, or over the limit) is skipped, not kept
        if (frame.payload !== null) chunk.copy(frame.payload, frame.got, at, at + take);
        frame.got += take;
        at += take;
        if (frame.got < frame.length) break;
      }
      this.frame = null;
      if (frame.payload !== null) this.dispatch(frame);
    }
  }

  /** Read a frame's header from `chunk` at `at`: once it is whole, `this.frame` is the
   *  frame (or the socket failed). Returns where the header ends in `chunk`. */
  readHead(chunk, at) {
    const head = this.head;
    if (this.headLength < 2) {
      while (this.headLength < 2 && at < chunk.length) head[this.headLength++] = chunk[at++];
      if (this.headLength < 2) return at;
    }
    const short = head[1] & 0x7f;
    const masked = (head[1] & 0x80) !== 0;
    const size = 2 + (short === 126 ? 2 : short === 127 ? 8 : 0) + (masked ? 4 : 0);
    if (this.headLength < size) {
      const take = Math.min(size - this.headLength, chunk.length - at);
      chunk.copy(head, this.headLength, at, at + take);
      this.headLength += take;
      at += take;
      if (this.headLength < size) return at;
    }
    this.headLength = 0;
    let length = short;
    if (short === 126) length = head.readUInt16BE(2);
    else if (short === 127) length = head.readUInt32BE(2) * 0x100000000 + head.readUInt32BE(6);
    const fin = (head[0] & 0x80) !== 0;
    const opcode = head[0] & 0x0f;
    const frame = { fin, opcode, length, got: 0, payload: null, mask: null };
    const problem = this.check(head[0], opcode, fin, masked, short, length);
    if (problem !== null) {
      this.fail(problem[0], problem[1]);
      if (!this.reading) return at;
      this.frame = frame; // its payload is skipped: the peer's close may follow it
      return at;
    }
    if (this.state !== OPEN && opcode !== CLOSE) {
      this.frame = frame; // past our close only the peer's close matters
      return at;
    }
    frame.mask = Buffer.allocUnsafe(4);
    head.copy(frame.mask, 0, size - 4, size);
    frame.payload = length === 0 ? EMPTY : Buffer.allocUnsafe(length);
    this.frame = frame;
    return at;
  }

  /** What is wrong with a frame's header: [close code, reason], else null. */
  check(first, opcode, fin, masked, short, length) {
    if ((first & 0x70) !== 0) return [1002, 'reserved bits set'];
    if (!masked) return [1002, 'client frames must be masked'];
    if (opcode >= CLOSE) {
      if (opcode > PONG) return [1002, 'unknown opcode'];
      if (!fin || short > 125) return [1002, 'control frames must be whole and at most 125 bytes'];
      return null;
    }
    if (opcode > BINARY) return [1002, 'unknown opcode'];
    if (this.state !== OPEN) return null; // its payload is skipped whatever it holds
    if (opcode === CONTINUATION) {
      if (this.fragmentOpcode === 0) return [1002, 'continuation without a message'];
    } else if (this.fragmentOpcode !== 0) {
      return [1002, 'a new message inside a fragmented one'];
    }
    // from the header alone: a frame over the limit is never kept
    if (length > this.hooks.maxMessageBytes || this.fragmentBytes + length > this.hooks.maxMessageBytes) {
      return [1009, 'message too big'];
    }
    return null;
  }

  dispatch(frame) {
    const payload = frame.payload;
    if (payload.length > 0) unmask(payload, frame.mask);
    switch (frame.opcode) {
      case CLOSE:
        this.peerClosed(payload);
        return;
      case PING:
        if (this.state === OPEN) this.writeFrame(PONG, payload, undefined);
        return;
      case PONG:
        return; // activity, counted as it was read
      default:
        this.data(frame.opcode, frame.fin, payload);
    }
  }

  /** A data frame: a whole message goes to the queue. */
  data(opcode, fin, payload) {
    let message = payload; // a message in one frame, the common case: nothing to join
    if (opcode === CONTINUATION || !fin) {
      if (opcode !== CONTINUATION) this.fragmentOpcode = opcode;
      this.fragments.push(payload);
      this.fragmentBytes += payload.length;
      if (!fin) return;
      opcode = this.fragmentOpcode;
      message = this.fragments.length === 1 ? this.fragments[0] : Buffer.concat(this.fragments, this.fragmentBytes);
      this.fragmentOpcode = 0;
      this.fragments = [];
      this.fragmentBytes = 0;
    }
    let value = message;
    if (opcode === TEXT) {
      try {
        value = utf8.decode(message);
      } catch {
        this.fail(1007, 'text message is not UTF-8');
        return;
      }
    }
    this.queue.push(value);
    this.queueSizes.push(message.length);
    this.queuedBytes += message.length;
    this.flow();
    if (!this.pumping) {
      this.pump().catch((err) => this.log(`the socket's message loop failed: ${rt.errorStack(err)}`));
    }
  }

  /** The peer's close frame: answered (when it came first) once the messages before it are
   *  handled and answered, then the TCP connection ends. */
  peerClosed(payload) {
    let code = 1005; // a close frame without a code
    let reason = '';
    if (payload.length === 1) {
      this.fail(1002, 'close frame of 1 byte');
      return;
    }
    if (payload.length >= 2) {
      code = payload.readUInt16BE(0);
      if (!closeCodeValid(code)) {
        this.fail(1002, 'invalid close code');
        return;
      }
      try {
        reason = utf8.decode(payload.subarray(2));
      } catch {
        this.fail(1002, 'close reason is not UTF-8');
        return;
      }
    }
    this.code = code;
    this.reason = reason;
    this.closeReceived = true;
    this.reading = false; // nothing after a close frame counts
    if (this.state === OPEN) {
      if (this.pumping) return; // the message loop answers it once it is done
      this.answerClose();
    }
    this.shut();
  }

  /** Our close frame in answer to the peer's: its code echoed, or none where it sent none. */
  answerClose() {
    this.writeFrame(CLOSE, this.code === 1005 ? EMPTY : closePayload(this.code, ''), undefined);
  }

  // ---------------------------------------------------------------- the handler

  /** The handler, once per message in order; stops once the socket is no longer open. */
  async pump() {
    this.pumping = true;
    try {
      while (this.state === OPEN && this.queue.length > 0) {
        const message = this.queue.shift();
        this.queuedBytes -= this.queueSizes.shift();
        this.flow();
        this.running = this.run(this.hooks.handler, message);
        const { err, result, timedOut } = await this.running;
        this.running = null;
        if (err) {
          this.log(
            `the message handler raised (request ${this.context.requestId})` +
              `${this.state === OPEN ? '; the socket is closed' : ''}:\n${rt.errorStack(err)}`,
          );
          this.close(1011, '');
          return;
        }
        if (this.state !== OPEN) return; // closed meanwhile: its answer goes nowhere
        if (timedOut) {
          const limit = rt.formatSeconds(this.host.timeoutSec);
          this.log(`the message handler ran past timeoutSec (${limit}s); the socket is closed`);
          this.close(1011, '');
          return;
        }
        if (result === undefined || result === null) continue;
        let frame;
        try {
          frame = encode(result);
        } catch (encodeErr) {
          this.log(`the message handler's answer cannot be sent; the socket is closed: ${rt.describeError(encodeErr)}`);
          this.close(1011, '');
          return;
        }
        // the next message waits while the peer does not take the answers
        if (!this.writeFrame(frame[0], frame[1], undefined)) await new Promise((resolve) => (this.onDrained = resolve));
      }
    } finally {
      this.pumping = false;
    }
    if (this.closeReceived && this.state === OPEN) {
      this.answerClose();
      this.shut();
    }
  }

  /** context.send: the frame is written now; resolves (to whether it was) once written. */
  send(data) {
    if (this.state !== OPEN) {
      throw new Error(this.state === CONNECTING ? 'the WebSocket is not open yet' : 'the WebSocket is closed');
    }
    const [opcode, payload] = encode(data);
    return new Promise((resolve) => this.writeFrame(opcode, payload, (err) => resolve(!err)));
  }

  /** context.close, and the runtime's own closes: a close frame, then up to 5 s for the
   *  peer's (the timer ends the TCP connection then). */
  close(code, reason) {
    if (!Number.isInteger(code) || !closeCodeValid(code)) {
      throw new RangeError(`a close code is 1000-1003, 1007-1014 or 3000-4999, not ${code}`);
    }
    const text = String(reason);
    if (Buffer.byteLength(text) > 123) throw new RangeError('a close reason is at most 123 UTF-8 bytes');
    if (this.state !== OPEN) return;
    this.writeFrame(CLOSE, closePayload(code, text), undefined);
    if (this.closeReceived) {
      this.shut(); // the peer's close came first (its answer was waiting for the messages)
      return;
    }
    this.state = CLOSING;
    this.stopMessages();
    this.closeDeadline = performance.now() + CLOSE_WAIT_MS;
    this.schedule();
  }

  /** The peer broke the protocol: our close frame says why and the TCP connection ends at
   *  once (RFC 6455 7.1.7); the peer's close, where it still comes, is read for its code. */
  fail(code, reason) {
    if (this.state === OPEN) {
      this.writeFrame(CLOSE, closePayload(code, reason), undefined);
    } else {
      this.reading = false; // a broken frame past the close: nothing more to read
    }
    this.shut();
  }

  /** No more frames either way: end our side; the socket is closed once that is written
   *  where both close frames went (nothing more is to come), else the peer gets 5 s to end
   *  its side (its close frame may still come, for onDisconnect's code). */
  shut() {
    if (this.state >= CLOSED) {
      if (this.closeReceived) this.socket.destroySoon();
      return;
    }
    this.state = CLOSED;
    this.stopMessages();
    if (this.closeReceived) this.socket.destroySoon();
    else this.socket.end();
    if (this.closeDeadline === 0) this.closeDeadline = performance.now() + CLOSE_WAIT_MS;
    this.schedule();
  }

  stopMessages() {
    this.queue = [];
    this.queueSizes = [];
    this.queuedBytes = 0;
    this.fragments = [];
    this.flow(); // the peer's close must be read
  }

  // ---------------------------------------------------------------- writing

  /** One whole frame, in one synchronous write: never interleaved with another. Returns
   *  socket.write's answer (false: the peer is not taking what is written). */
  writeFrame(opcode, payload, callback) {
    const socket = this.socket;
    const length = payload.length;
    const size = headSize(length);
    let more;
    if (length <= SMALL_FRAME) {
      const out = frameHead(opcode, length, size + length);
      payload.copy(out, size);
      more = socket.write(out, callback);
    } else {
      socket.cork(); // header and payload in one writev, not two packets
      socket.write(frameHead(opcode, length, size));
      more = socket.write(payload, callback);
      socket.uncork();
    }
    if (!more) this.flow();
    return more;
  }

  drained() {
    const waiting = this.onDrained;
    this.onDrained = null;
    this.flow();
    if (waiting !== null) waiting();
  }

  /** Read from the peer unless it does not take what is written or the handler is behind;
   *  past the open state always (its close frame must be read). */
  flow() {
    const hold =
      this.state === OPEN &&
      (this.socket.writableNeedDrain || this.queue.length >= MAX_QUEUED || this.queuedBytes > this.hooks.maxMessageBytes);
    if (hold === this.paused) return;
    this.paused = hold;
    if (hold) {
      this.socket.pause();
    } else {
      this.lastReceived = performance.now(); // a pause of ours is not the peer's silence
      this.socket.resume();
    }
  }

  // ---------------------------------------------------------------- the timer

  /** (Re)set the timer for what is due next. */
  schedule() {
    if (this.timer !== null) clearTimeout(this.timer);
    if (this.state === ENDED) return;
    const now = performance.now();
    let due;
    if (this.closeDeadline !== 0) {
      due = this.closeDeadline;
    } else {
      const { idleMs, maxMs, heartbeatMs } = this.host;
      due = this.openedAt + maxMs;
      if (!this.paused) {
        due = Math.min(due, this.lastReceived + idleMs, Math.max(this.lastReceived, this.pingedAt) + heartbeatMs);
      } else {
        due = Math.min(due, now + heartbeatMs);
      }
    }
    this.timer = setTimeout(() => this.tick(), Math.max(1, due - now));
    this.timer.unref(); // the socket keeps the process alive, not its timer
  }

  tick() {
    this.timer = null;
    const now = performance.now();
    if (this.closeDeadline !== 0) {
      if (now >= this.closeDeadline) {
        this.socket.destroy(); // the peer did not answer our close, or did not end its side
        return;
      }
    } else if (now >= this.openedAt + this.host.maxMs) {
      this.log(`the socket was open for ${rt.formatSeconds(this.host.maxSec)}s (stream.maxSec); it is closed`);
      this.close(1001, 'maxSec');
      return;
    } else if (!this.paused && !this.closeReceived) {
      if (now - this.lastReceived >= this.host.idleMs) {
        this.log(`the socket received nothing for ${rt.formatSeconds(this.host.idleSec)}s (stream.idleSec); it is closed`);
        this.close(1001, 'idle');
        return;
      }
      const quiet = now - Math.max(this.lastReceived, this.pingedAt);
      if (quiet >= this.host.heartbeatMs && this.state === OPEN) {
        this.pingedAt = now;
        // a peer not taking what is written would only queue pings: it is not idle
        if (!this.socket.writableNeedDrain) this.writeFrame(PING, EMPTY, undefined);
      }
    }
    this.schedule();
  }

  /** SIGTERM's drain is over: close 1001, as any limit. */
  goAway() {
    if (this.state === OPEN) this.close(1001, 'going away');
  }

  // ---------------------------------------------------------------- the end

  /** The TCP connection has ended: onDisconnect, once, after the last handler has
   *  settled (or run past its timeout), then the call is over. */
  ended() {
    if (this.state === ENDED) return;
    this.state = ENDED;
    if (this.timer !== null) clearTimeout(this.timer);
    this.timer = null;
    this.queue = [];
    this.fragments = [];
    this.frame = null;
    this.context.abortCall(new Error('the WebSocket ended'));
    if (this.onDrained !== null) this.drained(); // the message loop ends
    if (this.running !== null) this.running.then(() => this.disconnect());
    else this.disconnect();
  }

  disconnect() {
    const onDisconnect = this.hooks.onDisconnect;
    if (onDisconnect === null) {
      this.host.ended(this, 101, null);
      return;
    }
    const { _path, _query, _headers } = this.event;
    const event = { code: this.code, reason: this.reason, _path, _query, _headers };
    this.run(onDisconnect, event).then(({ err, timedOut }) => {
      if (err) this.log(`onDisconnect raised (request ${this.context.requestId}):\n${rt.errorStack(err)}`);
      else if (timedOut) this.log(`onDisconnect ran past timeoutSec (${rt.formatSeconds(this.host.timeoutSec)}s)`);
      this.host.ended(this, 101, null);
    });
  }
}

// ------------------------------------------------------------------ the handshake

function tokens(value) {
  return typeof value === 'string' ? value.toLowerCase().split(',').map((t) => t.trim()) : [];
}

/** Whether a request asks for a WebSocket (whatever else is wrong with it). */
function wantsWebSocket(req) {
  return tokens(req.headers.upgrade).includes('websocket');
}

/** What is wrong with a WebSocket handshake: [status, message], else null. */
function handshakeProblem(req) {
  if (req.method !== 'GET') return [400, 'a WebSocket handshake is a GET'];
  if (!tokens(req.headers.connection).includes('upgrade')) return [400, "a WebSocket handshake needs 'Connection: Upgrade'"];
  const key = req.headers['sec-websocket-key'];
  if (typeof key !== 'string' || !KEY.test(key)) return [400, 'Sec-WebSocket-Key must be the base64 of 16 bytes'];
  if (req.headers['sec-websocket-version'] !== '13') return [426, 'Sec-WebSocket-Version must be 13'];
  return null;
}

/** A ServerResponse on the upgrade's socket, for an answer other than 101: rendered as
 *  any call's, then the connection ends. */
function responseOn(req, socket) {
  const res = new http.ServerResponse(req);
  res.shouldKeepAlive = false;
  res.assignSocket(socket);
  res.on('finish', () => {
    res.detachSocket(socket);
    socket.destroySoon();
  });
  return res;
}

function quiet() {
  // a socket's error (a reset) ends it: its 'close' says the rest
}

/**
 * Serve WebSocket upgrades on `server`. `hooks`: configure()'s result and the
 * `handler`; `host`: the server's own (see createServer): its replica key check, its
 * load figures, limits, and `handle(req, res, body)`, an ordinary call. Returns
 * { rejectsUpgrade(req, res), open(), goAway() } for the server's request listener and
 * its shutdown.
 */
function attach(server, hooks, host) {
  const sockets = new Set(); // from the upgrade until onDisconnect has run
  let goneAway = false;
  const own = {
    ...host,
    ended(ws, status, error) {
      sockets.delete(ws);
      host.ended(ws, status, error);
    },
  };

  /** An upgrade refused before any hook runs (a bad handshake, no replica key). */
  const refuse = (req, socket, status, message, headers) => {
    rt.send(responseOn(req, socket), status, 'application/json', JSON.stringify({ error: message }), headers);
  };

  server.on('upgrade', (req, socket, head) => {
    socket.on('error', quiet);
    if (host.fromProxy !== null && !host.fromProxy(req)) {
      refuse(req, socket, 403, 'call functions through the proxy', null);
      return;
    }
    if (!wantsWebSocket(req)) {
      // another protocol (h2c...): an ordinary call, as without WebSockets; the body of
      // an upgrade is not read by node's parser, so only a call without one
      const headers = req.headers;
      const res = responseOn(req, socket);
      if (headers['transfer-encoding'] !== undefined || (headers['content-length'] || '0') !== '0') {
        rt.sendJsonError(res, 400, 'a request asking for an Upgrade cannot have a body');
      } else {
        host.handle(req, res, EMPTY);
      }
      return;
    }
    const problem = handshakeProblem(req);
    if (problem !== null) {
      refuse(req, socket, problem[0], problem[1], problem[0] === 426 ? { 'Sec-WebSocket-Version': '13' } : null);
      return;
    }
    if (host.state.stopping) {
      refuse(req, socket, 503, 'the function is stopping', null);
      return;
    }
    let event;
    try {
      event = rt.buildEvent(req, EMPTY);
    } catch (err) {
      refuse(req, socket, 400, `cannot read the request: ${rt.describeError(err)}`, null);
      return;
    }
    connect(req, socket, head, event);
  });

  function connect(req, socket, head, event) {
    const ws = new Socket(socket, req, event, own, hooks);
    sockets.add(ws);
    host.track(1); // in flight from its onConnect until its onDisconnect has run
    const accept = crypto.createHash('sha1').update(req.headers['sec-websocket-key'] + GUID).digest('base64');
    if (hooks.onConnect === null) {
      ws.open(accept, null, head);
      return;
    }
    ws.run(hooks.onConnect, event).then(({ err, result, timedOut }) => {
      const refused = (status, error) => own.ended(ws, status, error);
      if (socket.destroyed) {
        refused(499, 'the client went away during onConnect'); // nothing to answer
        return;
      }
      const res = () => responseOn(req, socket);
      if (timedOut) {
        const text = `function timed out after ${rt.formatSeconds(host.timeoutSec)}s`;
        ws.log(`${text}; the call is abandoned`);
        rt.sendJsonError(res(), 504, text);
        refused(504, text);
        return;
      }
      if (err) {
        const { requestId } = ws.context;
        rt.runInCall(ws.call, rt.handlerFailed, res(), err, req.method, event._path, requestId, host.errorDetail);
        refused(500, rt.describeError(err));
        return;
      }
      const verdict = acceptance(result);
      if (verdict === true && !goneAway) {
        const wanted = result !== null && typeof result === 'object' ? result.protocol : undefined;
        ws.open(accept, typeof wanted === 'string' && offeredProtocols(req).includes(wanted) ? wanted : null, head);
        return;
      }
      const out = res();
      if (verdict === true) rt.sendJsonError(out, 503, 'the function is stopping');
      else if (verdict === false) rt.sendJsonError(out, 403, 'connection refused');
      else if (verdict === null) rt.sendJsonError(out, 500, `onConnect returned a ${typeof result}: not a verdict`);
      else rt.sendStatusForm(out, result);
      refused(out.statusCode, null);
    });
  }

  return {
    /** A request with `Upgrade: websocket` that node did not take as an upgrade: its
     *  Connection header does not name it. Answered 400 here (true), else false. */
    rejectsUpgrade(req, res) {
      if (!wantsWebSocket(req)) return false;
      rt.sendJsonError(res, 400, "a WebSocket handshake needs 'Connection: Upgrade'");
      return true;
    },
    /** The sockets not ended yet (onDisconnect included). */
    open: () => sockets.size,
    /** SIGTERM's drain is over: each open socket is closed with 1001. */
    goAway() {
      goneAway = true;
      for (const ws of sockets) ws.goAway();
    },
  };
}

/** The protocols the client offers, as it spelled them. */
function offeredProtocols(req) {
  const offered = req.headers['sec-websocket-protocol'];
  if (typeof offered !== 'string') return [];
  return offered.split(',').map((p) => p.trim()).filter((p) => p !== '');
}

/** onConnect's verdict: true (accepted), false (refused 403), 'form' (a status form to
 *  answer with), null (not a result it may return). */
function acceptance(result) {
  if (result === undefined || result === null || result === true) return true;
  if (result === false) return false;
  if (typeof result !== 'object' || Array.isArray(result)) return null;
  if (!('statusCode' in result)) return true;
  const status = result.statusCode;
  return Number.isInteger(status) && status >= 200 && status <= 299 ? true : 'form';
}

module.exports = { configure, attach };
