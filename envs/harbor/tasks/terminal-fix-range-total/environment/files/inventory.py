def total_between(counts, start, end):
    """Sum counts[start..end], both ends included."""
    return sum(counts[start:end])
