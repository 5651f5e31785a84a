"""Echoes what the runtime made of the request, for tests/proxy/test_proxy.py."""


def main(event, context):
    return {"event": event, "request_id": context.request_id}
