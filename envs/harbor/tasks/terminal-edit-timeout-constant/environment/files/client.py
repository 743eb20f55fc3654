def request_timeout():
    return 30
