def handler(event):
    return {"nested": True, "path": event["_path"]}
