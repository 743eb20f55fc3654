def poll_timeout():
    return 30 * 2
