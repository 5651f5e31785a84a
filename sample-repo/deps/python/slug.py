"""HTTP: `?text=Hello Wörld!` or {"text": "..."} -> {"slug": "hello-world"} (uses python-slugify)."""
import json

from slugify import slugify  # from requirements.txt


def handler(event, context=None):
    text = (event.get("_query") or {}).get("text") or event.get("text")
    if not isinstance(text, str) or not text:
        return {"statusCode": 400, "headers": {"Content-Type": "application/json"},
                "body": json.dumps({"error": "give the text as ?text=... or a JSON body {\"text\": ...}"})}
    return {"text": text, "slug": slugify(text)}
