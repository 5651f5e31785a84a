"""The HTTP side for people and tools: the status API, the dashboard, sign-in.

Owns the FastAPI app with webhooks and health (``api``), its response models
(``models``), the server-rendered dashboard and its ``static/`` files
(``dashboard``), who may read and write (``access``) and the API token kept in
the state folder (``tokenfile``). The ``/fn/`` proxy is ``proxy``, a layer below.

May import: ``previews``, the coordinator and every layer below; only ``serve``
and ``cli`` import it.
"""
