// Job: runs {"statements": ["CREATE TABLE ...", ...]} in one transaction -> {"executed": N}.
//
// Deliberately has no trigger in sless.yaml: it runs whatever SQL its event
// holds, so it must only be reachable as a job defined in git.
const { connect } = require('./db');

module.exports.run = async (event) => {
  const { statements } = event;
  if (!Array.isArray(statements) || !statements.every((s) => typeof s === 'string' && s.trim())) {
    throw new TypeError("'statements' must be a list of non-empty SQL strings");
  }
  const db = await connect();
  try {
    await db.query('BEGIN');
    for (const [i, sql] of statements.entries()) {
      try {
        await db.query(sql);
      } catch (err) {
        await db.query('ROLLBACK'); // all or nothing: no half-done schema
        throw new Error(`statement ${i} failed: ${err.message}`);
      }
    }
    await db.query('COMMIT');
  } finally {
    await db.end();
  }
  return { executed: statements.length };
};
