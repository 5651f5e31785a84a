// `npm test` (needs the dev dependency baretest, which the build leaves out).
const assert = require('assert');
const test = require('baretest')('slugify-js');
const { handler } = require('./lib/slug');

test('slugifies the query text', async () => {
  const res = await handler({ _query: { text: 'Hello Wörld!' } });
  assert.strictEqual(res.slug, 'hello-world');
});

test('400 without text', async () => {
  const res = await handler({ _query: {} });
  assert.strictEqual(res.statusCode, 400);
});

test.run();
