// Request bodies read as they come (SLESS_STREAM_REQUEST=1): tests/test_runtime_uploads.py.
const crypto = require('crypto');

exports.handler = async (event) => {
  const body = event._stream;
  if (event._path === '/first') {
    for await (const chunk of body) return { first: Math.min(chunk.length, 10) };
    return { first: 0 };
  }
  const digest = crypto.createHash('sha256');
  let total = 0;
  let largest = 0;
  for await (const chunk of body) {
    digest.update(chunk);
    total += chunk.length;
    largest = Math.max(largest, chunk.length);
  }
  return { bytes: total, sha256: digest.digest('hex'), largest, parsed: 'n' in event };
};
