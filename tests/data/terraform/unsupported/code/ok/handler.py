import os


def main(event, context=None):
    return {"word": os.environ.get("WORD")}
