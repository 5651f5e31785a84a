"""Notes CRUD, routed on the sub-path after /fn/{env}/notes-py:

  GET      /list                          -> {"notes": [...]}
  POST|GET /add?title=..&body=..          -> 201 {"note": {...}}
  GET      /get?id=..                     -> {"note": {...}}
  POST|GET /update?id=..&title=..&body=.. -> {"note": {...}}
  GET|POST /delete?id=..                  -> {"deleted": id}

Parameters come from the query string or from a JSON body. All SQL is
parametrised: values never become part of the SQL text.
"""
import json

from db import connect

COLUMNS = "id, title, body, created_at"


def _reply(status, payload):
    return {"statusCode": status, "headers": {"Content-Type": "application/json"},
            "body": json.dumps(payload)}


def _note(row):
    id_, title, body, created_at = row
    return {"id": id_, "title": title, "body": body, "created_at": created_at.isoformat()}


def _list(con, params):
    return {"notes": [_note(r) for r in con.run(f"SELECT {COLUMNS} FROM notes ORDER BY id")]}


def _add(con, params):
    if not params.get("title"):
        return _reply(400, {"error": "title is required"})
    rows = con.run(f"INSERT INTO notes (title, body) VALUES (:title, :body) RETURNING {COLUMNS}",
                   title=str(params["title"]), body=str(params.get("body", "")))
    return _reply(201, {"note": _note(rows[0])})


def _get(con, params, id_):
    rows = con.run(f"SELECT {COLUMNS} FROM notes WHERE id = :id", id=id_)
    return {"note": _note(rows[0])} if rows else _reply(404, {"error": f"note {id_} not found"})


def _update(con, params, id_):
    # A field that is not given keeps its value.
    title, body = params.get("title"), params.get("body")
    rows = con.run(f"UPDATE notes SET title = COALESCE(:title, title), body = COALESCE(:body, body) "
                   f"WHERE id = :id RETURNING {COLUMNS}",
                   id=id_, title=None if title is None else str(title),
                   body=None if body is None else str(body))
    return {"note": _note(rows[0])} if rows else _reply(404, {"error": f"note {id_} not found"})


def _delete(con, params, id_):
    rows = con.run("DELETE FROM notes WHERE id = :id RETURNING id", id=id_)
    return {"deleted": id_} if rows else _reply(404, {"error": f"note {id_} not found"})


# path -> (allowed methods, handler, needs ?id=)
ROUTES = {
    "/list": ({"GET"}, _list, False),
    "/add": ({"GET", "POST"}, _add, False),
    "/get": ({"GET"}, _get, True),
    "/update": ({"GET", "POST"}, _update, True),
    "/delete": ({"GET", "POST"}, _delete, True),
}


def crud(event, context=None):
    path = "/" + event.get("_path", "/").strip("/")
    route = ROUTES.get(path)
    if route is None:
        return _reply(404, {"error": f"no route {path}", "routes": sorted(ROUTES)})
    methods, action, needs_id = route
    method = event.get("_method", "GET").upper()
    if method not in methods:
        return _reply(405, {"error": f"{method} not allowed on {path}"})

    # Query string first, JSON body fields (the event's own keys) win.
    params = dict(event.get("_query") or {})
    params.update({k: v for k, v in event.items() if not k.startswith("_")})

    args = ()
    if needs_id:
        id_ = str(params.get("id", "")).strip()
        if not id_:
            return _reply(400, {"error": "id is required"})
        if not id_.isascii() or not id_.isdigit():
            return _reply(400, {"error": f"id must be a positive integer, got {id_!r}"})
        args = (int(id_),)

    con = connect()
    try:
        return action(con, params, *args)
    finally:
        con.close()
