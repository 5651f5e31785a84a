"""The invoke proxy: ``/fn/{env}/{name}/{path}`` forwarded to the function's upstream.

Its modules, each importing only those before it:

- :mod:`.http`: the HTTP details both paths share (target, request and
  response headers, JSON errors) and the edge's :class:`Limits`;
- :mod:`.upstream`: keep-alive connections to the upstreams, pooled;
- :mod:`.spans`: each call's span, when spans are exported (``--otlp-endpoint``);
- :mod:`.fast`: uvicorn's httptools protocol with the edge's limits, and
  ``/fn/`` served from its callbacks;
- :mod:`.app`: :class:`ProxyApp`, the proxy as an ASGI application, and
  :func:`config`, the uvicorn settings that put the fast path in front of it.

``history`` is what the proxy did (:class:`Invocation`), buffered for the status store.

May import: ``state``, ``plan`` and the shared top-level modules; the hot path
(``fast``) as little as it can.
"""

from .app import Invocation, Limits, ProxyApp, config

__all__ = ["Invocation", "Limits", "ProxyApp", "config"]
