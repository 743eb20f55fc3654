import json

def load():
    with open("settings.json") as f:
        s = json.load(f)
    return s["name"], int(s["port"]), bool(s["debug"])

if __name__ == "__main__":
    print(*load())
