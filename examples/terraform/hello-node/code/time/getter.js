// The job: its result is the event it was given, plus the time it ran.
module.exports.main = async (event) => ({ event, utc: new Date().toISOString() });
