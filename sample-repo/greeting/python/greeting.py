"""HTTP greeting: `?name=Ada` or `{"name": "Ada"}` -> {"message": "hello, Ada"}."""
import os


def handler(event, context=None):
    # `_query` holds the query string; the JSON body's fields sit at the top level.
    name = (event.get("_query") or {}).get("name") or event.get("name") or "world"
    greeting = os.environ.get("GREETING", "hello")
    return {"message": f"{greeting}, {name}"}  # any JSON value -> 200 JSON
