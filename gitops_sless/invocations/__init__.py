"""Asynchronous invocations: a call accepted now (202), run later, retried, and seen.

``model`` is the record every engine keeps; ``engine`` says what a queue engine does,
and ``sqlite`` (embedded) and ``nats`` (NATS JetStream) do it; ``worker`` runs one
attempt through the proxy and decides retry, dead or done; ``callbacks`` reports the
end to the caller's URL, signed; ``submit`` takes the requests (``Prefer:
respond-async`` and ``/async/``); ``service`` ties them to the routes.

May import: proxy, state, manifests and the layers below.
"""
