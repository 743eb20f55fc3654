import os


def load():
    mode = os.environ.get("MODE", "development")
    return {"mode": mode, "data_dir": os.environ.get("DATA_DIR", "/tmp/data"), "debug": mode == "production"}
