'use strict';

exports.handler = (event) => ({ nested: true, path: event._path });
