// Notes CRUD, routed on the sub-path after /fn/{env}/notes-js:
//
//   GET      /list                          -> {"notes": [...]}
//   POST|GET /add?title=..&body=..          -> 201 {"note": {...}}
//   GET      /get?id=..                     -> {"note": {...}}
//   POST|GET /update?id=..&title=..&body=.. -> {"note": {...}}
//   GET|POST /delete?id=..                  -> {"deleted": id}
//
// Parameters come from the query string or from a JSON body. All SQL is
// parametrised ($1, $2): values never become part of the SQL text.
const { connect } = require('./db');

const COLUMNS = 'id, title, body, created_at';

const reply = (statusCode, payload) => ({
  statusCode,
  headers: { 'Content-Type': 'application/json' },
  body: JSON.stringify(payload),
});
const notFound = (id) => reply(404, { error: `note ${id} not found` });
const str = (v) => (v === undefined || v === null ? null : String(v));

const actions = {
  async list(db) {
    const { rows } = await db.query(`SELECT ${COLUMNS} FROM notes ORDER BY id`);
    return { notes: rows };
  },
  async add(db, params) {
    if (!params.title) return reply(400, { error: 'title is required' });
    const { rows } = await db.query(
      `INSERT INTO notes (title, body) VALUES ($1, $2) RETURNING ${COLUMNS}`,
      [String(params.title), str(params.body) ?? ''],
    );
    return reply(201, { note: rows[0] });
  },
  async get(db, params, id) {
    const { rows } = await db.query(`SELECT ${COLUMNS} FROM notes WHERE id = $1`, [id]);
    return rows.length ? { note: rows[0] } : notFound(id);
  },
  async update(db, params, id) {
    // A field that is not given keeps its value.
    const { rows } = await db.query(
      `UPDATE notes SET title = COALESCE($2, title), body = COALESCE($3, body)
       WHERE id = $1 RETURNING ${COLUMNS}`,
      [id, str(params.title), str(params.body)],
    );
    return rows.length ? { note: rows[0] } : notFound(id);
  },
  async delete(db, params, id) {
    const { rowCount } = await db.query('DELETE FROM notes WHERE id = $1', [id]);
    return rowCount ? { deleted: id } : notFound(id);
  },
};

// path -> [allowed methods, needs ?id=]
const ROUTES = {
  '/list': [['GET'], false],
  '/add': [['GET', 'POST'], false],
  '/get': [['GET'], true],
  '/update': [['GET', 'POST'], true],
  '/delete': [['GET', 'POST'], true],
};

module.exports.crud = async (event) => {
  const path = '/' + (event._path || '/').replace(/^\/+|\/+$/g, '');
  const route = ROUTES[path];
  if (!route) return reply(404, { error: `no route ${path}`, routes: Object.keys(ROUTES).sort() });
  const [methods, needsId] = route;
  const method = (event._method || 'GET').toUpperCase();
  if (!methods.includes(method)) return reply(405, { error: `${method} not allowed on ${path}` });

  // Query string first, JSON body fields (the event's own keys) win.
  const params = { ...(event._query || {}) };
  for (const [k, v] of Object.entries(event)) if (!k.startsWith('_')) params[k] = v;

  const args = [];
  if (needsId) {
    const id = String(params.id ?? '').trim();
    if (!id) return reply(400, { error: 'id is required' });
    if (!/^[0-9]+$/.test(id)) return reply(400, { error: `id must be a positive integer, got ${JSON.stringify(id)}` });
    args.push(Number(id));
  }

  const db = await connect();
  try {
    return await actions[path.slice(1)](db, params, ...args);
  } finally {
    await db.end();
  }
};
