import os


def run(event, context=None):
    # a stand-in for a SQL runner: says what it would run, never the DSN
    return {"would_run": event.get("statements", []), "has_dsn": bool(os.environ.get("PG_DSN"))}
