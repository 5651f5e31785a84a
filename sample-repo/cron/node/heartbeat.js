// Cron + HTTP: returns the time of the beat and the event that caused it.
module.exports.handler = async (event) => {
  // Echo the event, minus the request headers of a call made by hand.
  const { _headers, ...rest } = event;
  return { beat: new Date().toISOString(), event: rest };
};
