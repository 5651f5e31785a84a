// Shared by both functions of this folder: open a connection from $PG_DSN
// (postgresql://user:password@host:5432/dbname[?sslmode=require]).
const { Client } = require('pg');

module.exports.connect = async () => {
  if (!process.env.PG_DSN) throw new Error('PG_DSN is not set (Secret notes-db, key dsn)');
  const client = new Client({ connectionString: process.env.PG_DSN, connectionTimeoutMillis: 10000 });
  await client.connect();
  return client;
};
