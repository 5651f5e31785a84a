// Two entrypoints in one file: a job that takes the time, a function that shows it.

// Job: returns the current UTC time; the platform keeps it as the job's result.
module.exports.getTime = async () => ({ utc: new Date().toISOString() });

// HTTP: shows the time the job took (fixed at deploy time) next to the time now.
module.exports.display = async () => {
  const raw = process.env.JOB_TIME;
  if (!raw) {
    return {
      statusCode: 500,
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ error: 'JOB_TIME is not set' }),
    };
  }
  return { time: JSON.parse(raw).utc, now: new Date().toISOString() };
};
