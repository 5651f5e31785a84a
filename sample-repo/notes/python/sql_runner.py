"""Job: runs {"statements": ["CREATE TABLE ...", ...]} in one transaction -> {"executed": N}.

Deliberately has no trigger in sless.yaml: it runs whatever SQL its event
holds, so it must only be reachable as a job defined in git.
"""
import pg8000.native

from db import connect


def run(event, context=None):
    statements = event.get("statements")
    if not isinstance(statements, list) or not all(isinstance(s, str) and s.strip() for s in statements):
        raise ValueError("'statements' must be a list of non-empty SQL strings")
    con = connect()
    try:
        con.run("START TRANSACTION")
        for i, sql in enumerate(statements):
            try:
                con.run(sql)
            except pg8000.native.DatabaseError as exc:
                # pg8000 puts the server's error fields in a dict; "M" is the message.
                fields = exc.args[0] if exc.args and isinstance(exc.args[0], dict) else {}
                raise RuntimeError(f"statement {i} failed: {fields.get('M', exc)}") from exc
        con.run("COMMIT")  # all or nothing: an error above leaves no half-done schema
    finally:
        con.close()
    return {"executed": len(statements)}
