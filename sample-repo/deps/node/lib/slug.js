// HTTP: `?text=Hello Wörld!` or {"text": "..."} -> {"slug": "hello-world"} (uses slugify).
const slugify = require('slugify'); // from package.json "dependencies"

module.exports.handler = async (event) => {
  const text = (event._query || {}).text || event.text;
  if (typeof text !== 'string' || !text) {
    return {
      statusCode: 400,
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ error: 'give the text as ?text=... or a JSON body {"text": ...}' }),
    };
  }
  return { text, slug: slugify(text, { lower: true, strict: true }) };
};
