def join_names(names):
    return ", ".join(sorted(names))
