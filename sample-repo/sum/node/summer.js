// Job handler: {"numbers": [1, 2, 3.5, 4]} -> {"sum": 10.5}.
module.exports.handler = async (event) => {
  const { numbers } = event;
  if (!Array.isArray(numbers)) {
    throw new TypeError(`'numbers' must be a list of numbers, got ${JSON.stringify(numbers)}`);
  }
  numbers.forEach((n, i) => {
    if (typeof n !== 'number' || !Number.isFinite(n)) {
      throw new TypeError(`numbers[${i}] is ${JSON.stringify(n)}, not a number`);
    }
  });
  return { sum: numbers.reduce((a, b) => a + b, 0) }; // printed as the job's JSON result
};
