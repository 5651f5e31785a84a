module.exports.main = async (event) => ({
  message: `${process.env.GREETING}: ${event._query.name || 'nobody'}`,
  retries: process.env.RETRIES,
});
