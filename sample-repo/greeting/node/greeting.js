// HTTP greeting: `?name=Ada` or `{"name": "Ada"}` -> {"message": "hello, Ada"}.
module.exports.handler = async (event, context) => {
  // `_query` holds the query string; the JSON body's fields sit at the top level.
  const name = (event._query || {}).name || event.name || 'world';
  const greeting = process.env.GREETING || 'hello';
  return { message: `${greeting}, ${name}` }; // any JSON value -> 200 JSON
};
