import configparser, os, sys

LEVELS = ("debug", "info", "warning", "error")


def load(path=os.path.join(os.path.dirname(os.path.abspath(__file__)), "service.ini")):
    cp = configparser.ConfigParser()
    if not cp.read(path):
        raise SystemExit(f"{path}: missing")
    cfg = {"host": cp.get("server", "host"), "port": cp.getint("server", "port"),
           "workers": cp.getint("server", "workers"), "level": cp.get("logging", "level"),
           "data_dir": cp.get("storage", "data_dir")}
    if not 1 <= cfg["port"] <= 65535 or cfg["workers"] < 1 or cfg["level"] not in LEVELS:
        raise SystemExit(f"bad config: {cfg}")
    if not os.path.isdir(cfg["data_dir"]):
        raise SystemExit(f"data_dir {cfg['data_dir']} does not exist")
    return cfg


if __name__ == "__main__" and "--check" in sys.argv:
    load()
    print("config ok")
