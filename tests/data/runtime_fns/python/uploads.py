"""Request bodies read as they come (SLESS_STREAM_REQUEST=1): tests/test_runtime_uploads.py."""

import hashlib


def handler(event, context):
    body = event["_stream"]
    if event["_path"] == "/first":  # reads one piece, leaves the rest unread
        return {"first": len(body.read1(10))}
    if event["_path"] == "/exact":  # read(n) gives n bytes until the end
        sizes = []
        while piece := body.read(1000):
            sizes.append(len(piece))
        return {"sizes": sorted(set(sizes)), "total": sum(sizes)}
    digest = hashlib.sha256()
    total = largest = 0
    for chunk in body:  # never the whole body at once
        digest.update(chunk)
        total += len(chunk)
        largest = max(largest, len(chunk))
    parsed = "n" in event
    return {"bytes": total, "sha256": digest.hexdigest(), "largest": largest, "parsed": parsed}
