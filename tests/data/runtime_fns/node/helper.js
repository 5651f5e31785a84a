'use strict';

exports.add = (a, b) => a + b;
