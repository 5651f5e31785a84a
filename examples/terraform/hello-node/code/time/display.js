const crypto = require('crypto');

// Shows the job's result, and a digest of the DSN (never the DSN itself).
module.exports.main = async () => ({
  job: JSON.parse(process.env.JOB_TIME),
  dsnSha256: crypto.createHash('sha256').update(process.env.DB_DSN || '').digest('hex'),
});
